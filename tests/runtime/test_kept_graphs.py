"""What a call keeps beside the planned peak (`runtime/kept_graphs.py`):
how many branch rows a step holds, which graphs fit the room and in what
order, when several rows per step give way to kept graphs, and what a
kept graph is counted at before and after one was measured. The runner's
use of them is tested against eager in `test_branch_rows.py` and
`test_backward.py`; these pin the arithmetic those runs rely on."""

from __future__ import annotations

import types

import pytest
import torch

from longstraw.options import Options
from longstraw.runtime.call_state import GraphSpending
from longstraw.runtime.kept_graphs import (
    GraphBytes,
    graphs_keepable,
    group_seconds,
    kept_in,
    rows_or_graphs,
    rows_per_step,
)
from longstraw.runtime.step_seconds import StepSeconds


def test_rows_per_step_follow_the_option_then_the_room():
    assert rows_per_step(4, group_size=8, room=0, graph_bytes=100) == 4  # the option, whatever the room
    assert rows_per_step(16, group_size=8, room=0, graph_bytes=100) == 8  # never more than the group
    assert rows_per_step(None, group_size=8, room=250, graph_bytes=100) == 3  # one in the peak, two in the room
    assert rows_per_step(None, group_size=8, room=10_000, graph_bytes=100) == 8
    assert rows_per_step(None, group_size=8, room=99, graph_bytes=100) == 1
    assert rows_per_step(None, group_size=8, room=10_000, graph_bytes=0) == 1  # nothing measured or planned


def test_the_prompt_is_kept_first_and_the_first_graph_pays_for_the_state():
    """Room 100, the state 30: the prompt's graph (40) and the state take
    70, then branch steps of 2 rows at 10 a row fit once (20), not twice."""
    spending = GraphSpending(room=100, spent=0, state=30)
    assert kept_in(spending, prompt=40, branch=10, rows=2, group_size=8) == (True, 2)
    assert spending.spent == 90 and spending.paid
    # the prompt not wanted (detached mode): the first branch step pays for the state
    assert kept_in(GraphSpending(room=100, spent=0, state=30), None, 10, 2, 8) == (False, 6)
    # branch graphs not kept (a pass that does not allow it): only the prompt's
    assert kept_in(GraphSpending(room=100, spent=0, state=30), 40, None, 2, 8) == (True, 0)
    # a prompt that does not fit is not kept, and the branches still are
    assert kept_in(GraphSpending(room=100, spent=0, state=0), 150, 10, 4, 8) == (False, 8)


def test_a_last_step_takes_the_rows_left():
    """Seven rows in steps of 3: the last step holds one row, counted at one row's bytes."""
    spending = GraphSpending(room=70, spent=0, state=0)
    assert kept_in(spending, None, 10, 3, 7) == (False, 7)
    assert spending.spent == 70


@pytest.mark.parametrize("room, want", [(1_000, 4), (100, 1)])
def test_rows_give_way_to_graphs_that_save_more_positions(room, want):
    """Steps of 4 rows take 3 rows' bytes (30 each) beyond one from the
    room: with room for everything they stay; where that leaves no room for
    the prompt's graph (60, saving its 4,096 positions' second forward),
    one row per step keeps it and steps of 4 would not."""
    beside = lambda rows: GraphSpending(room - (rows - 1) * 30, 0, 0)  # noqa: E731
    assert rows_or_graphs(beside, prompt=60, branch=5, rows=4, group_size=8, positions=(4096, 1024)) == want


@pytest.mark.parametrize("row_seconds, want", [(1.0, 1), (0.25, 4), (None, 1)])
def test_measured_seconds_weigh_rows_against_graphs(row_seconds, want):
    """Room where steps of 4 rows lose the prompt's graph (60 bytes, 4,096
    positions) and steps of one keep it: by positions, one row. Where both
    steps' forwards and the prompt's were measured, by time: a branch step
    of 4 rows at a step of one's seconds per position (bound by arithmetic)
    runs one row; at a quarter of them (bound by launches) 4 rows, the
    prompt's second forward beside them; a row count never measured, by
    positions."""
    beside = lambda rows: GraphSpending(100 - (rows - 1) * 30, 0, 0)  # noqa: E731
    seconds = StepSeconds({("branch", 1): 1e-5, ("prompt", 1): 1e-6})
    if row_seconds is not None:
        seconds.measured["branch", 4] = row_seconds * 1e-5
    got = rows_or_graphs(beside, prompt=60, branch=5, rows=4, group_size=8, positions=(4096, 1024), seconds=seconds)
    assert got == want
    if row_seconds is not None:  # 2 steps of 4 rows keep nothing: forwards, backwards, replays; the prompt again
        want_seconds = (3 * 2 + 2) * row_seconds * 1e-5 * 4 * 1024 + 4096 * 1e-6
        assert group_seconds(seconds, 4, (False, 0), True, 8, (4096, 1024)) == pytest.approx(want_seconds)


def test_graph_bytes_follow_what_was_measured():
    """Planned bytes (an upper bound) until a kept graph of the kind is
    measured, then its bytes per position, never more than planned; a
    prompt not measured yet is counted at a branch's bytes per position."""
    bytes_ = GraphBytes(planned=1_000)
    assert bytes_.branch(2, positions=100) == 2_000
    assert bytes_.row(100) == 1_000
    assert bytes_.prompt(4096, chunks=2) == 2_000
    bytes_.measured["branch"] = 1.5
    assert bytes_.branch(2, positions=100) == 300
    assert bytes_.row(100) == 300  # twice a kept branch: its graph and its backward's working memory
    assert bytes_.prompt(400, chunks=2) == 600  # a branch's per position
    bytes_.measured["prompt"] = 4.0
    assert bytes_.prompt(400, chunks=2) == 1_600
    assert bytes_.prompt(4096, chunks=2) == 2_000  # never above the planned bytes


def test_measuring_keeps_the_largest_bytes_per_position_where_the_device_tells():
    bytes_ = GraphBytes(planned=1_000)
    with bytes_.measuring(True, "branch", 100, torch.device("cpu")):
        torch.ones(1_000)
    assert bytes_.measured == {}  # the CPU does not tell what it allocated
    if torch.cuda.is_available():
        device = torch.device("cuda")
        with bytes_.measuring(True, "branch", 100, device):
            held = torch.ones(25_600, device=device)  # 102,400 bytes
        assert bytes_.measured["branch"] >= 1_024.0
        del held


@pytest.mark.parametrize("change, keepable", [
    ({}, True), ({"keep_graphs": False}, False), ({"recompute_layers": True}, False),
    ({"attention_outputs_on_host": True}, False),
])
def test_graphs_are_keepable_only_where_the_backward_replays_nothing_else(change, keepable):
    options = Options(**{"recompute_layers": False, **change})
    assert graphs_keepable(types.SimpleNamespace(stages=[object()], random=False), options) is keepable
    # random operators, or a frozen model's stage handing values to the replayed one: never
    assert not graphs_keepable(types.SimpleNamespace(stages=[object()], random=True), options)
    assert not graphs_keepable(types.SimpleNamespace(stages=[object(), object()], random=False), options)
