"""What the ranks of a context-parallel group check before a step (`parallel/agreement.py`), on two
ranks as threads: `agree` gathers every rank's value and refuses, on every rank, a rank at another
point, with another graph or other options; `check_replicated` refuses other inputs, naming them."""

from __future__ import annotations

import operator
import types
import zlib

import pytest
import torch
import torch.fx as fx

from longstraw.errors import InputError
from longstraw.options import Options
from longstraw.parallel import agreement
from longstraw.parallel.agreement import CALLING, PLANNING, agree, check_replicated, graph_fingerprint

from helpers.thread_ranks import on_ranks, same_on_every_rank, this_thread

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _threads_are_the_group(monkeypatch):
    """`agree` builds its `Ranks`; `check_replicated` also asks torch.distributed for its rank and size."""
    monkeypatch.setattr(agreement, "Ranks", lambda group: this_thread())
    monkeypatch.setattr(agreement, "dist", types.SimpleNamespace(
        get_world_size=lambda group: this_thread().size, get_rank=lambda group: this_thread().rank))


def _scaled(scale: float) -> fx.Graph:
    """x * scale, the scale folded into the graph as Dynamo folds a Python float."""
    graph = fx.Graph()
    graph.output(graph.call_function(operator.mul, (graph.placeholder("x"), scale)))
    return graph


def test_a_graph_fingerprint_is_the_crc32_of_its_text_exact_in_float64():
    fingerprint = graph_fingerprint(_scaled(0.5))
    assert fingerprint == zlib.crc32(str(_scaled(0.5)).encode())
    assert fingerprint == graph_fingerprint(_scaled(0.5)) != graph_fingerprint(_scaled(1.5))
    assert torch.tensor(fingerprint, dtype=torch.float64).item() == fingerprint


def test_agreeing_ranks_get_every_ranks_value_in_rank_order():
    got = on_ranks(lambda ranks: agree(PLANNING, 7.0, Options(prefix_chunk_size=8), 10.0 + ranks.rank, None, CPU))
    assert got == [[10.0, 11.0], [10.0, 11.0]]


def test_the_budget_and_the_progress_bars_may_differ_between_ranks():
    got = on_ranks(lambda ranks: agree(
        CALLING, 7.0, Options(memory_budget_gb=1.0 + ranks.rank, progress=bool(ranks.rank)), 0.0, None, CPU))
    assert got == [[0.0, 0.0], [0.0, 0.0]]


@pytest.mark.parametrize("rank_one, cause", [
    (dict(phase=CALLING), "rank 0 is planning a step while rank 1 is calling a planned step"),
    (dict(fingerprint=8.0), "the compiled graph differs between rank 0 and rank 1"),
    (dict(options=Options(prefix_chunk_size=16)), "the option `prefix_chunk_size` differs between rank 0 and rank 1"),
    (dict(options=Options(prefix_chunk_size=8, prompt_grad="detached")), "the option `prompt_grad` differs"),
])
def test_a_rank_at_another_point_or_with_another_graph_or_options_is_refused_on_every_rank(rank_one, cause):
    def call(ranks) -> list[float]:
        mine = dict(phase=PLANNING, fingerprint=7.0, options=Options(prefix_chunk_size=8))
        mine.update(rank_one if ranks.rank == 1 else {})
        return agree(mine["phase"], mine["fingerprint"], mine["options"], 0.0, None, CPU)

    error = same_on_every_rank(on_ranks(call))
    assert isinstance(error, InputError) and error.longstraw_shared
    assert str(error).startswith("context parallelism: ") and cause in str(error)


def _inputs(rank: int, **changed) -> dict:
    """What rank `rank` calls the loss with: a weight, the data and a Python number; `changed` replaces some."""
    gen = torch.Generator().manual_seed(0)
    values = dict(weight=torch.randn(3, 4, generator=gen, dtype=torch.float64),
                  responses=torch.randint(0, 50, (3, 5), generator=gen),
                  advantages=torch.randn(3, generator=gen, dtype=torch.float64), scale=0.5)
    values.update(changed)
    return values


def _check_on_two_ranks(per_rank, generators=lambda rank: ()) -> list[None | BaseException]:
    def call(ranks) -> None:
        values = per_rank(ranks.rank)
        data = [name != "weight" for name in values]
        check_replicated(list(values.values()), list(values), data, 7.0, Options(), None, generators(ranks.rank))

    return on_ranks(call)


def test_ranks_with_the_same_inputs_pass():
    assert _check_on_two_ranks(_inputs) == [None, None]


def test_nan_at_the_same_place_on_every_rank_is_the_same_input():
    nan = torch.tensor([1.0, float("nan"), 2.0], dtype=torch.float64)
    assert _check_on_two_ranks(lambda rank: _inputs(rank, advantages=nan)) == [None, None]
    outcomes = _check_on_two_ranks(lambda rank: _inputs(rank, advantages=nan if rank else nan.nan_to_num()))
    assert all("input `advantages` differs" in str(error) for error in outcomes)


ON_RANK_ONE = {
    "advantages": lambda value: value + 1e-12,
    "responses": lambda value: value.flip(0),  # the rows swapped: the same sum and norm
    "scale": lambda value: 0.25,
}


def _changed_on_rank_one(name: str):
    return lambda rank: _inputs(rank, **({name: ON_RANK_ONE[name](_inputs(rank)[name])} if rank else {}))


@pytest.mark.parametrize("name", ON_RANK_ONE)
def test_an_input_that_differs_on_one_rank_is_named_on_every_rank(name):
    for rank, error in enumerate(_check_on_two_ranks(_changed_on_rank_one(name))):
        assert isinstance(error, InputError) and error.longstraw_shared
        assert str(error).startswith(f"context parallelism: input `{name}` differs between rank {rank} and rank {1 - rank}")
        assert "the same inputs, weights and Python values" in str(error)


def test_a_weight_is_compared_by_sum_and_norm_not_order():
    """Weights are loaded, not shuffled: only data inputs pay for the order-sensitive sum."""
    flipped = _inputs(0)["weight"].flip(0)
    assert _check_on_two_ranks(lambda rank: _inputs(rank, **({"weight": flipped} if rank else {}))) == [None, None]


def test_random_generators_in_other_states_are_refused_with_how_to_seed():
    outcomes = _check_on_two_ranks(_inputs, lambda rank: [torch.Generator().manual_seed(rank).get_state()])
    for error in outcomes:
        assert isinstance(error, InputError)
        assert "the random number generators' state differs between rank" in str(error)
        assert "seed the group's ranks alike" in str(error)
    assert _check_on_two_ranks(_inputs, lambda rank: [torch.Generator().manual_seed(3).get_state()]) == [None, None]


def test_a_rank_passing_another_number_of_inputs_is_refused_on_every_rank():
    error = same_on_every_rank(_check_on_two_ranks(lambda rank: _inputs(rank, **({"extra": 1.0} if rank else {}))))
    assert isinstance(error, InputError)
    assert "the ranks pass different numbers of inputs" in str(error)
