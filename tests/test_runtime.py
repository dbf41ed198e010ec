"""Runtime behaviour visible to users (longstraw/runtime.py): progress bars."""

from __future__ import annotations

import pytest

import longstraw
from harness import compile_loss, compiled_loss_and_grads
from losses import grpo_loss_f64
from tiny_models import make_group, make_model


@pytest.mark.parametrize("mode", ["exact", "detached"])
def test_progress_bars_count_tokens(mode, capsys):
    model = make_model("plain")
    step = compile_loss(grpo_loss_f64, longstraw.Backend(prompt_grad=mode, prefix_chunk_size=8, progress=True))
    compiled_loss_and_grads(step, model, *make_group(2, 41, 5))
    err = capsys.readouterr().err
    assert "longstraw prompt capture" in err and "40.0/40.0" in err and "tok/s" in err
    assert ("longstraw reverse pass" in err) == (mode == "exact")


def test_no_progress_when_not_a_terminal(capsys):
    model = make_model("plain")
    step = compile_loss(grpo_loss_f64, longstraw.Backend(prefix_chunk_size=4))  # progress=None, 10 chunks
    compiled_loss_and_grads(step, model, *make_group(2, 41, 5))
    assert "longstraw" not in capsys.readouterr().err
