"""Context parallelism's collectives besides attention (`parallel/collectives.py`), on two ranks as
threads: a failure raised together on every rank, gradient parts summed with what every rank already
held counted once, outputs gathered in rank order, the first rank's tensors replicated in place."""

from __future__ import annotations

import types

import torch

from longstraw.errors import InputError, LongStrawError
from longstraw.parallel import collectives
from longstraw.parallel.collectives import (
    all_gathered,
    raise_together,
    replicate_from_first,
    summed_carry_grads,
    summed_over_ranks,
)

from helpers.thread_ranks import on_ranks, same_on_every_rank, this_thread

CPU = torch.device("cpu")


def test_no_failure_on_any_rank_raises_nothing():
    assert on_ranks(lambda ranks: raise_together(None, ranks, CPU)) == [None, None]


def test_one_ranks_failure_is_raised_on_every_rank_naming_where_it_was_found():
    outcomes = on_ranks(lambda ranks: raise_together(
        InputError("rank 1's check") if ranks.rank == 1 else None, ranks, CPU))
    error = same_on_every_rank(outcomes)
    assert isinstance(error, InputError) and str(error) == "rank 1's check"
    assert all(e.longstraw_shared for e in outcomes)
    assert getattr(outcomes[1], "__notes__", []) == []
    assert outcomes[0].__notes__ == [
        "longstraw: raised on rank 1 of the context-parallel group, and so on every rank"]


def test_when_several_ranks_fail_the_lowest_ranks_error_is_raised():
    outcomes = on_ranks(lambda ranks: raise_together(LongStrawError(f"rank {ranks.rank}'s check"), ranks, CPU), size=3)
    assert str(same_on_every_rank(outcomes)) == "rank 0's check"


def _leaf(values: list[float], grad: list[float] | None) -> torch.Tensor:
    leaf = torch.tensor(values, dtype=torch.float64, requires_grad=True)
    leaf.grad = None if grad is None else torch.tensor(grad, dtype=torch.float64)
    return leaf


def test_gradient_parts_are_summed_and_what_every_rank_held_is_counted_once():
    """Before the block each rank holds the same branch gradient [1, 2];
    inside, rank r adds its part (r + 1) * [10, 100]: after it every rank
    holds [1, 2] + [10, 100] + [20, 200]. A leaf only rank 1 adds to gets
    rank 1's part; one no rank adds to keeps no gradient."""

    def step(ranks) -> list[torch.Tensor | None]:
        held, rank_one_only, untouched = _leaf([0.0, 0.0], [1.0, 2.0]), _leaf([0.0], None), _leaf([0.0], None)
        with summed_over_ranks([held, rank_one_only, untouched], ranks):
            (held * torch.tensor([10.0, 100.0], dtype=torch.float64) * (ranks.rank + 1)).sum().backward()
            if ranks.rank == 1:
                (rank_one_only * 5.0).sum().backward()
        return [held.grad, rank_one_only.grad, untouched.grad]

    for held, rank_one_only, untouched in on_ranks(step):
        assert held.tolist() == [31.0, 302.0]
        assert rank_one_only.tolist() == [5.0]
        assert untouched is None


def test_without_leaves_no_collective_runs():
    ran = []
    with summed_over_ranks([], types.SimpleNamespace(rank=1)):
        ran.append(True)
    assert ran == [True]


def test_carry_gradients_at_the_prompts_end_are_summed_over_the_ranks():
    """Slot 0's carry gradient is held by both ranks, slot 1's by rank 1
    alone, slot 2's by none: the sums, and nothing where no rank has one."""

    def step(ranks) -> dict[int, dict[int, torch.Tensor]]:
        grads = {0: {8: torch.full((2,), 1.0 + ranks.rank)}, 1: {8: torch.full((2,), 5.0)} if ranks.rank else {}, 2: {}}
        state = types.SimpleNamespace(carry_grads=grads, carry_at=lambda slot, position: torch.zeros(2),
                                      shard=types.SimpleNamespace(ranks=ranks))
        summed_carry_grads(state, 8)
        return grads

    for grads in on_ranks(step):
        assert grads[0][8].tolist() == [3.0, 3.0] and grads[1][8].tolist() == [5.0, 5.0] and grads[2] == {}


def test_every_ranks_tensors_are_gathered_in_rank_order_whatever_their_layout():
    def step(ranks) -> list[list[torch.Tensor]]:
        square = torch.arange(6.0).view(2, 3).t() + 10 * ranks.rank  # not contiguous
        return all_gathered([square, torch.tensor([ranks.rank])], ranks)

    for per_rank in on_ranks(step):
        for rank, (square, number) in enumerate(per_rank):
            assert torch.equal(square, torch.arange(6.0).view(2, 3).t() + 10 * rank) and number.tolist() == [rank]


def test_every_rank_takes_the_first_ranks_tensors_in_place(monkeypatch):
    monkeypatch.setattr(collectives, "Ranks", lambda group: this_thread())

    def step(ranks) -> tuple[torch.Tensor, torch.Tensor]:
        plain = torch.full((3,), 1.0 + ranks.rank)
        storage = torch.arange(6.0).view(2, 3) * (ranks.rank + 1)
        transposed = storage.t()  # not contiguous: sent as a copy, written back into the tensor
        replicate_from_first([plain, None, transposed], None)
        return plain, storage

    for plain, storage in on_ranks(step):
        assert plain.tolist() == [1.0, 1.0, 1.0]
        assert torch.equal(storage, torch.arange(6.0).view(2, 3))


def test_over_three_ranks_each_part_and_the_held_gradient_count_once():
    def step(ranks) -> torch.Tensor:
        leaf = _leaf([0.0], [7.0])
        with summed_over_ranks([leaf], ranks):
            (leaf * (ranks.rank + 1.0)).sum().backward()
        return leaf.grad

    assert [g.tolist() for g in on_ranks(step, size=3)] == [[7.0 + 1.0 + 2.0 + 3.0]] * 3
