"""verl's plugin module (`longstraw/integrations/verl_plugin.py`): importing
it registers LongStraw's actor engine for verl's `fsdp2` strategy with the
options of `LONGSTRAW_OPTIONS` (JSON; none set or empty: the defaults), and
options that are not JSON or not LongStraw's are refused at the import,
leaving verl's registry as it was. Registration through verl's own model
config is `tests/integrations/test_verl.py`'s."""

from __future__ import annotations

import importlib
import json
import sys

import pytest
from verl.workers.engine.base import EngineRegistry

from longstraw import LongStrawError, Options
from longstraw.integrations.verl import LongStrawActorEngine

PLUGIN = "longstraw.integrations.verl_plugin"


@pytest.fixture
def engines(monkeypatch) -> dict:
    """verl's engines for `fsdp2` by device, restored after the test; the plugin imported anew."""
    registered = dict(EngineRegistry._engines["language_model"]["fsdp2"])
    monkeypatch.setitem(EngineRegistry._engines["language_model"], "fsdp2", registered)
    monkeypatch.delitem(sys.modules, PLUGIN, raising=False)
    return registered


def test_the_options_in_the_environment_are_registered(engines, monkeypatch):
    monkeypatch.setenv("LONGSTRAW_OPTIONS", '{"prompt_grad": "detached", "prefix_chunk_size": 16}')
    importlib.import_module(PLUGIN)
    engine = engines["cuda"]
    assert issubclass(engine, LongStrawActorEngine)
    assert engine.longstraw_options == Options(prompt_grad="detached", prefix_chunk_size=16)


@pytest.mark.parametrize("value", [None, ""], ids=["unset", "empty"])
def test_without_options_the_defaults_are_registered(engines, monkeypatch, value):
    if value is None:
        monkeypatch.delenv("LONGSTRAW_OPTIONS", raising=False)
    else:
        monkeypatch.setenv("LONGSTRAW_OPTIONS", value)
    importlib.import_module(PLUGIN)
    assert engines["cuda"].longstraw_options == Options()


@pytest.mark.parametrize("value,error,message", [
    ('{"prompt_gradd": "exact"}', LongStrawError, r"unknown longstraw option\(s\) \['prompt_gradd'\]"),
    ('{"prompt_grad": "sometimes"}', LongStrawError, "prompt_grad must be 'exact' or 'detached', got 'sometimes'"),
    ("prompt_grad=exact", json.JSONDecodeError, "Expecting value"),
], ids=["unknown-option", "bad-value", "not-json"])
def test_options_that_are_not_longstraws_are_refused_at_the_import(engines, monkeypatch, value, error, message):
    before = dict(engines)
    monkeypatch.setenv("LONGSTRAW_OPTIONS", value)
    with pytest.raises(error, match=message):
        importlib.import_module(PLUGIN)
    assert engines == before
