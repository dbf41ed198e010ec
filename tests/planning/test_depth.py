"""A step graph's depth (`planning/depth.py`): its layers in order and the
period they repeat with, and the step graph with the middle periods taken
out, which is what the planner simulates at depth."""

from __future__ import annotations

import longstraw
from longstraw.codegen.recompute import layer_of
from longstraw.planning.depth import depth_of, without_middle

from helpers.harness import compile_loss
from helpers.losses import grpo_loss_f64
from helpers.plain_transformer import make_plain
from helpers.tiny_models import make_group


def _branch_step(layers: int):
    backend = longstraw.Backend(prefix_chunk_size=8)
    compile_loss(grpo_loss_f64, backend)(make_plain(num_layers=layers), *make_group(2, 12, 3)).backward()
    return backend.plans[-1].runner.branch.module


def test_identical_layers_repeat_with_a_period_of_one():
    step = _branch_step(6)
    depth = depth_of(step.graph)
    assert depth is not None and (depth.period, depth.periods) == (1, 6)
    assert depth.layers == [f"model.blocks.{i}" for i in range(6)]


def test_two_layers_are_too_few_periods_to_tell():
    assert depth_of(_branch_step(2).graph) is None


def test_the_middle_periods_are_taken_out():
    """Two of six periods: the first and the last layer, the last reading
    what the first computed; the dropped layers' outputs are None."""
    step = _branch_step(6)
    depth = depth_of(step.graph)
    short = without_middle(step, depth, 2)
    assert depth_of(short.graph) is None  # two layers left
    assert {layer_of(n) for n in short.graph.nodes} - {None} == {"model.blocks.0", "model.blocks.5"}
    assert without_middle(step, depth, 6) is step
    assert without_middle(step, depth, 1) is None
