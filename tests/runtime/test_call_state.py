"""What one call decides and leaves for its backward (`runtime/call_state.py`):
the generators' state a replay restores, the rows a step selects from each
input (with the key mask's host copy cut alike), how a step is named, and
the room a group's kept graphs spend."""

from __future__ import annotations

import torch

from longstraw.runtime.call_state import GraphSpending, RngState, branches_named, rows_of
from longstraw.runtime.mask_block import HOST_COPY, attach_host_copy


def test_a_restored_state_draws_the_same_numbers_and_leaves_the_generator_as_found():
    torch.manual_seed(0)
    state = RngState.capture(torch.device("cpu"))
    first = torch.rand(4)
    after = torch.get_rng_state()
    with state.restored():
        again = torch.rand(4)
    assert torch.equal(first, again)
    assert torch.equal(torch.get_rng_state(), after)


def test_consecutive_rows_are_a_view_and_others_a_copy():
    value = torch.arange(24.0).reshape(6, 4)
    storage = value.untyped_storage().data_ptr()
    run = rows_of(value, 0, (2, 3, 4))
    assert run.untyped_storage().data_ptr() == storage and torch.equal(run, value[2:5])
    picked = rows_of(value, 0, (4, 1))
    assert picked.untyped_storage().data_ptr() != storage and torch.equal(picked, value[[4, 1]])
    assert torch.equal(rows_of(value.t(), 1, (5, 0)), value.t()[:, [5, 0]])


def test_the_key_masks_host_copy_comes_along():
    keys = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1]])
    attach_host_copy(keys)
    for rows in ((1, 2), (2, 0)):
        cut = rows_of(keys, 0, rows)
        host = getattr(cut, HOST_COPY)
        assert host.device.type == "cpu" and torch.equal(host, keys[list(rows)])
    assert not hasattr(rows_of(torch.ones(3, 3), 0, (0, 1)), HOST_COPY)


def test_steps_are_named_by_their_rows():
    assert branches_named((3,), 8) == "branch 3 of 8"
    assert branches_named((0, 1, 2, 3), 8) == "branches 0, 1, 2, 3 of 8"


def test_the_first_graph_taken_pays_for_the_state():
    spending = GraphSpending(room=100, spent=10, state=50)
    assert not spending.take(41)  # 10 + 41 + 50 > 100: nothing spent
    assert spending.spent == 10 and not spending.paid
    assert spending.take(40) and spending.spent == 100 and spending.paid
    assert not spending.take(1)
    assert GraphSpending(room=100, spent=10, state=50, paid=True).take(90)
