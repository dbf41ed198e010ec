"""HF's once-only logging calls (`longstraw.models.hf_logging`): importing
longstraw makes transformers' `warning_once`, `info_once` and
`warning_advice` no-ops in Dynamo traces, where they would break the graph,
while eager calls still log; only the functions a module defines are added,
and any other logger call still breaks the graph."""

from __future__ import annotations

import logging
import types

import pytest
import torch
from transformers.utils import logging as hf_logging

import longstraw  # noqa: F401 - installs the trace bindings
from longstraw.models.hf_logging import substitute_in_traces

ONCE = ("warning_once", "info_once", "warning_advice")


class Recorded(logging.Handler):
    """The messages a logger emitted."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def logger():
    """A transformers logger (its once-only methods included) and what it emitted."""
    logger = hf_logging.get_logger("lstest.hf_logging")
    handler = Recorded()
    logger.addHandler(handler)
    yield logger, handler.messages
    logger.removeHandler(handler)


def test_importing_longstraw_ignores_transformers_once_methods():
    assert {getattr(hf_logging, name) for name in ONCE} <= torch._dynamo.config.ignore_logging_functions


def test_only_the_once_methods_a_module_defines_are_ignored():
    def warning_once(*args):
        pass

    def warning(*args):
        pass

    module = types.ModuleType("lstest_logging")
    module.warning_once, module.warning = warning_once, warning
    with torch._dynamo.config.patch(ignore_logging_functions=set()):
        substitute_in_traces(module)
        assert torch._dynamo.config.ignore_logging_functions == {warning_once}


def test_a_traced_warning_once_logs_nothing_and_an_eager_call_logs(logger):
    log, messages = logger

    def step(x):
        log.warning_once("lstest: once, in a trace")
        return x + 1

    assert torch.equal(torch.compile(step, backend="eager", fullgraph=True)(torch.ones(2)), torch.full((2,), 2.0))
    assert messages == []
    step(torch.ones(2))
    assert messages == ["lstest: once, in a trace"]


@pytest.mark.parametrize("method,bound", [("warning", True), ("warning_once", False)],
                         ids=["another-method", "warning_once-without-the-binding"])
def test_a_logger_call_dynamo_is_not_told_to_ignore_breaks_the_graph(logger, method, bound):
    log, _ = logger

    def step(x):
        getattr(log, method)("lstest: breaks")
        return x + 1

    ignoring = torch._dynamo.config.ignore_logging_functions if bound else set()
    with torch._dynamo.config.patch(ignore_logging_functions=ignoring):
        with pytest.raises(torch._dynamo.exc.Unsupported, match="logging.Logger method not supported"):
            torch.compile(step, backend="eager", fullgraph=True)(torch.ones(2))
