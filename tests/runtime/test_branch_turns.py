"""A group's branch steps (`runtime/branch_turns.py`): where a step is cut
after its rows' last read position, how many rows a step holds, and the
check that a cut step returned every read position its loss reads."""

from __future__ import annotations

import pytest
import torch

import longstraw
from longstraw.runtime import branch_turns
from longstraw.runtime.branch_turns import ReadLengths, StepCut


def test_a_step_is_cut_after_its_longest_row():
    reads = ReadLengths(needed=(5, 2, 0, 3), reads=5)
    assert reads.cut((1, 3), 6) == StepCut(length=4, needed=3, reads=5)
    assert reads.cut((2,), 6) == StepCut(length=2, needed=1, reads=5)  # a row with nothing to read runs one
    assert reads.cut((0, 1), 6) is None  # it would save nothing
    # at R = 1024 lengths are rounded up to multiples of 1025 // 16 = 64 (a handful of shapes a call)
    long = ReadLengths(needed=(600, 1000, 1024), reads=1024)
    assert long.cut((0,), 1025) == StepCut(length=640, needed=600, reads=1024)
    assert long.cut((0, 1), 1025) == StepCut(length=1024, needed=1000, reads=1024)
    assert long.cut((2,), 1025) is None


def test_rows_per_step_runs_the_fewest_positions():
    """A group of 8 completions of R = 1024 (one full, the rest shorter),
    lengths rounded up to multiples of 64: one step of 8 runs 8 x 1,025
    positions, sorted steps of 4 run 6,916, of 2 6,530, one row per step
    6,273. At 640 positions a step (and at 256), steps of 4; at 128, of 2."""
    reads = ReadLengths(needed=(1024, 520, 600, 700, 800, 900, 950, 560), reads=1024)
    rows = tuple(range(8))
    assert branch_turns.STEP_POSITIONS == 640
    assert reads.rows_per_step(rows, 1025, 8) == 4
    assert reads.steps(rows, 4) == [(0, 6, 5, 4), (3, 2, 7, 1)]
    assert reads.rows_per_step(rows, 1025, 3) == 3  # never more rows than memory allows
    full = ReadLengths(needed=(1024,) * 8, reads=1024)
    assert full.rows_per_step(rows, 1025, 8) == 8  # nothing to leave out: the fewest steps


def test_rows_per_step_follow_the_cost_of_a_step(monkeypatch):
    monkeypatch.setattr(branch_turns, "STEP_POSITIONS", 128)
    reads = ReadLengths(needed=(1024, 520, 600, 700, 800, 900, 950, 560), reads=1024)
    assert reads.rows_per_step(tuple(range(8)), 1025, 8) == 2


def test_a_cut_step_that_lost_read_positions_is_an_error():
    """The runtime's own check: a step that returned fewer read positions
    than its rows' loss reads is reported, never padded over."""
    cut = StepCut(length=4, needed=3, reads=5)
    logits = torch.ones(1, 3, 7)
    padded = cut.padded([logits], "running branch 0 of 3")[0]
    assert padded.shape == (1, 5, 7) and bool((padded[:, 3:] == 0).all()) and bool((padded[:, :3] == 1).all())
    with pytest.raises(longstraw.LongStrawError, match="returned 2 read positions where its rows' loss reads 3"):
        cut.padded([logits[:, :2]], "running branch 0 of 3")
