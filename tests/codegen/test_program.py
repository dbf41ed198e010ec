"""A partition's step program (`codegen/program.py`): the replayed stage's
steps, whether a step draws random numbers (and so whether context
parallelism may run rounds), and the prompt positions the graph alone fixes."""

from __future__ import annotations

import longstraw

from helpers.harness import compile_loss
from helpers.losses import grpo_loss_f64
from helpers.plain_transformer import make_plain
from helpers.tiny_models import make_group


def _program(model, group):
    backend = longstraw.Backend(prefix_chunk_size=8)
    compile_loss(grpo_loss_f64, backend)(model, *group).backward()
    return backend.plans[-1].program


def test_a_deterministic_loss_runs_rounds_and_fixes_its_prompt():
    """One prompt of 20 positions and responses of 4 (`make_group`): the
    prompt is an input of its own, so the graph alone fixes the 19
    positions before the first one the loss reads."""
    program = _program(make_plain(), make_group(2, 20, 4))
    assert program.prefix is program.stages[-1].prefix and program.branch is program.stages[-1].branch
    assert not program.random and program.runs_rounds
    assert program.structural_prefix_len == program.traced_prefix_len == program.partition.first_consumed == 19
    assert program.padding_roots == frozenset()


def test_dropout_makes_every_step_restore_its_generator_and_no_rounds():
    program = _program(make_plain(dropout=0.3).train(), make_group(2, 20, 4))
    assert program.random and not program.runs_rounds
