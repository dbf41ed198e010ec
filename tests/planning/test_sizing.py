"""How a plan's chunk size and recomputation are decided (`planning/sizing.py`): the user's kept, the
defaults off CUDA without a budget, otherwise the planner's choice for the budget, with the room beside
its predicted peak (`KeptRoom`); under context parallelism, the smallest budget of the group. The
planner itself is a stub here: what it is asked, and what is made of its answer."""

from __future__ import annotations

import dataclasses
import math
import types

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx

from longstraw.options import Options
from longstraw.parallel.agreement import PLANNING, graph_fingerprint
from longstraw.planning import sizing
from longstraw.planning.planner import MemoryPlan
from longstraw.planning.sizing import KEEP_EVERY_STATE, KeptRoom, size_plan

CPU = torch.device("cpu")
ARGS = (torch.zeros(3), 0.5)
PROGRAM = types.SimpleNamespace(partition=types.SimpleNamespace(placeholders=[], params=set(), graph=fx.Graph()))


class _Planner:
    """A `MemoryModel` for a prompt of 19 positions and branches of 5, choosing `plan` whatever it is asked."""

    plan: MemoryPlan
    asked: list[tuple]
    weights, prompt_len, branch_len = 0, 19, 5

    def __init__(self, program, options: Options, activations) -> None:
        assert program is PROGRAM

    def choose(self, P, R, mode, device, budget, chunk=None, recompute=None, ranks=1) -> MemoryPlan:
        _Planner.asked.append((P, R, mode, device, budget, chunk, recompute, ranks))
        return _Planner.plan


def _plan(activations: int = 400) -> MemoryPlan:
    """A choice of chunks of 256 with recomputation, predicted at a peak of 600 + `activations` bytes."""
    return MemoryPlan(P=20, G=1, R=5, prompt_grad="exact", prefix_chunk_size=256, recompute_layers=True, weights=100,
                      grads=100, state=300, state_grad=100, activations=activations, budget=None, largest_prompt=None)


@pytest.fixture
def planner(monkeypatch) -> type[_Planner]:
    _Planner.plan, _Planner.asked = _plan(), []
    monkeypatch.setattr(sizing, "MemoryModel", _Planner)
    return _Planner


@pytest.fixture
def no_planner(monkeypatch) -> None:
    monkeypatch.setattr(sizing, "MemoryModel", lambda *args: pytest.fail("planned"))


@pytest.mark.parametrize("keep_group_states, keep_graphs, room", [
    (None, None, KeptRoom()),
    (True, False, KeptRoom(states=KEEP_EVERY_STATE)),
    (False, True, KeptRoom(graphs=KEEP_EVERY_STATE)),
])
def test_the_users_chunk_and_recomputation_skip_planning(keep_group_states, keep_graphs, room, no_planner):
    opts = Options(prefix_chunk_size=64, recompute_layers=False, memory_budget_gb=1.0,
                   keep_group_states=keep_group_states, keep_graphs=keep_graphs)
    sized, kept = size_plan(PROGRAM, opts, ARGS, None)
    assert sized is opts and kept == room


@pytest.mark.parametrize("chunk, recompute, want", [
    (None, None, (8192, False)),
    (64, None, (64, False)),
    (None, True, (8192, True)),
])
def test_off_cuda_without_a_budget_the_defaults_fill_what_the_user_left(chunk, recompute, want, no_planner):
    sized, kept = size_plan(PROGRAM, Options(prefix_chunk_size=chunk, recompute_layers=recompute), ARGS, None)
    assert (sized.prefix_chunk_size, sized.recompute_layers) == want and kept == KeptRoom()


def test_a_budget_is_planned_for_and_the_room_beside_the_peak_kept(planner):
    opts = Options(memory_budget_gb=2e-6, prompt_grad="detached", head_chunk_size=64)  # 2000 bytes
    sized, kept = size_plan(PROGRAM, opts, ARGS, None)
    assert planner.asked == [(20, 5, "detached", CPU, 2000, None, None, 1)]
    assert sized == dataclasses.replace(opts, prefix_chunk_size=256, recompute_layers=True)
    spare = 2000 - 1000
    assert kept == KeptRoom(states=spare, graphs=spare, graph_chunk=400, step=300 + 100 + 400, spare=spare)


@pytest.mark.parametrize("keep_group_states, keep_graphs, states, graphs", [
    (False, None, 0, 1000),
    (True, False, KEEP_EVERY_STATE, 0),
])
def test_what_the_user_decided_to_keep_is_not_planned(keep_group_states, keep_graphs, states, graphs, planner):
    opts = Options(memory_budget_gb=2e-6, keep_group_states=keep_group_states, keep_graphs=keep_graphs)
    _, kept = size_plan(PROGRAM, opts, ARGS, None)
    assert (kept.states, kept.graphs, kept.spare) == (states, graphs, 1000)


def test_a_peak_over_the_budget_leaves_no_room(planner):
    planner.plan = _plan(activations=5000)
    _, kept = size_plan(PROGRAM, Options(memory_budget_gb=2e-6, prefix_chunk_size=32), ARGS, None)
    assert planner.asked[0][5] == 32
    assert kept == KeptRoom(0, 0, 5000, 300 + 100 + 5000, 0)


def test_the_budget_is_at_most_what_the_device_has(planner, monkeypatch):
    monkeypatch.setattr(sizing, "available_budget", lambda device: 1500)
    size_plan(PROGRAM, Options(memory_budget_gb=2e-6), ARGS, None)
    assert planner.asked[0][4] == 1500


def test_without_a_budget_the_devices_default_is_planned_for(planner, monkeypatch):
    monkeypatch.setattr(sizing, "default_budget", lambda device: 3000)
    size_plan(PROGRAM, Options(), ARGS, None)
    assert planner.asked[0][4] == 3000


def _group_of(answers: list[float], monkeypatch) -> list[tuple]:
    """Two ranks (`Options.context_parallel`) whose `agree` answers this rank's value, then `answers`; the calls made."""
    calls = []

    def agree(phase, fingerprint, options, value, group, device) -> list[float]:
        calls.append((phase, fingerprint, value, group, device))
        return [value, *answers]

    monkeypatch.setattr(sizing, "agree", agree)
    return calls


def test_under_context_parallelism_every_rank_plans_for_the_smallest_budget(planner, monkeypatch):
    group = dist.ProcessGroup(dist.HashStore(), 0, 2)
    calls = _group_of([1200.0], monkeypatch)
    opts = Options(memory_budget_gb=2e-6, context_parallel=group)
    sized, kept = size_plan(PROGRAM, opts, ARGS, None)
    assert calls == [(PLANNING, graph_fingerprint(PROGRAM.partition.graph), 2000.0, group, CPU)]
    assert planner.asked == [(20, 5, "exact", CPU, 1200, None, None, 2)]
    assert (sized.prefix_chunk_size, sized.recompute_layers) == (256, True)
    assert kept == KeptRoom()  # nothing kept beside the peak under context parallelism


def test_under_context_parallelism_a_fixed_plan_still_meets_the_group(no_planner, monkeypatch):
    """Every rank runs `agree`'s collective, planning or not: one rank skipping it would hang the others."""
    calls = _group_of([math.inf], monkeypatch)
    opts = Options(prefix_chunk_size=8, recompute_layers=False, context_parallel=dist.ProcessGroup(dist.HashStore(), 0, 2))
    sized, kept = size_plan(PROGRAM, opts, ARGS, None)
    assert sized is opts and kept == KeptRoom()
    assert [value for _, _, value, _, _ in calls] == [math.inf]


@pytest.mark.gpu
def test_on_cuda_what_the_process_holds_besides_the_weights_is_left_out_of_the_budget(planner):
    device = torch.device("cuda")
    args = (torch.zeros(1 << 20, device=device),)  # 4 MB held, no weight among them
    others = torch.cuda.memory_allocated(device)
    size_plan(PROGRAM, Options(memory_budget_gb=1.0), args, None)
    assert planner.asked[0][4] == 10**9 - others
