"""The memory planner: the chunk size and recomputation the backend
chooses for a budget, as `explain(...).plan()` reports them. (The
predicted peaks are checked against the H200 in `tests/planning/test_report.py`.)"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
import transformers

import longstraw
from longstraw.codegen.recompute import layer_of
from longstraw.models import qwen3_5
from longstraw.models.tiny import tiny_causal_lm
from longstraw.planning.planner import MemoryModel

from helpers.compare import assert_close
from helpers.harness import compile_loss, compiled_loss_and_grads
from helpers.losses import grpo_loss_f64
from helpers.tiny_models import make_group, make_model, make_qwen3_5


def make_hybrid() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.Qwen3_5ForCausalLM(qwen3_5.tiny_config(num_hidden_layers=4)).double()


MODELS = {"qwen3": lambda: make_model("qwen3"), "qwen3_5": make_hybrid}
P, R = 257, 6  # a branch runs R + 1 positions


def memory_model(plan: longstraw.GroupPlan, activations=None) -> MemoryModel:
    """The planner's model of a plan's program, simulating under the plan's options."""
    return MemoryModel(plan.program, plan.options, activations)


def explain(kind: str, **options) -> longstraw.ExplainReport:
    with qwen3_5.bound():
        return longstraw.explain(grpo_loss_f64, MODELS[kind](), *make_group(2, P, R), options=options or None)


@pytest.fixture(scope="module")
def explained() -> Callable[[str], longstraw.ExplainReport]:
    """`explain(kind)`, traced once per module: the tests only read a
    report and plan from it, and the simulations its plans keep are
    functions of the traced step (one test's plans may reuse another's,
    as one graph's plans do in the backend)."""
    return functools.cache(explain)


def test_a_budget_chooses_the_chunk_and_recomputation(explained):
    """The fastest choice that fits: the largest chunk without
    recomputation; with less memory recomputation or a smaller chunk; and
    the backend runs what `explain(...).plan(P, budget_gb=...)` reports."""
    report = explained("qwen3_5")
    roomy = report.plan(P=P, budget_gb=100.0)
    assert (roomy.prefix_chunk_size, roomy.recompute_layers) == (P - 1, False)
    tight_budget = (roomy.peak - 4096) / 1e9
    tight = report.plan(P=P, budget_gb=tight_budget)
    assert (tight.prefix_chunk_size, tight.recompute_layers) != (P - 1, False)
    assert tight.fits and tight.peak < roomy.peak
    # what the backend chooses for the same budget, and it computes what the default plan computes
    model, group = make_hybrid(), make_group(2, P, R)
    with qwen3_5.bound():
        backend = longstraw.Backend(memory_budget_gb=tight_budget)
        loss, grads = compiled_loss_and_grads(compile_loss(grpo_loss_f64, backend), model, *group)
        chosen = backend.plans[-1].options
        assert (chosen.prefix_chunk_size, chosen.recompute_layers) == (tight.prefix_chunk_size, tight.recompute_layers)
        fixed = longstraw.Backend(prefix_chunk_size=8192, recompute_layers=False)
        want_loss, want = compiled_loss_and_grads(compile_loss(grpo_loss_f64, fixed), model, *group)
    assert_close(loss, want_loss, 1e-12)
    for name in want:
        assert_close(grads[name], want[name], 1e-10)


def test_nothing_fits_takes_the_smallest_peak_and_warns(explained, caplog):
    report = explained("qwen3")
    with caplog.at_level("WARNING", logger="longstraw.planning.planner"):
        plan = report.plan(P=P, budget_gb=1e-6)
    assert not plan.fits
    candidates = [report.plan(P=P, prefix_chunk_size=c, recompute_layers=r) for c in (P - 1, 128) for r in (False, True)]
    assert plan.peak == min(c.peak for c in candidates)
    assert "no prompt chunk fits the memory budget" in caplog.text


def test_off_cuda_without_a_budget_the_defaults_run_and_nothing_is_simulated(monkeypatch):
    """No `memory_budget_gb` on the CPU: chunks of 8192, no recomputation, no simulation at planning."""
    from longstraw.planning import planner

    assert planner.default_budget(torch.device("cpu")) is None
    monkeypatch.setattr(planner, "simulate_step", lambda *a, **k: pytest.fail("simulated without a budget"))
    backend = longstraw.Backend()
    step = compile_loss(grpo_loss_f64, backend)
    with torch.no_grad():
        step(make_model("qwen3"), *make_group(2, 20, 4))
    options = backend.plans[-1].options
    assert (options.prefix_chunk_size, options.recompute_layers) == (8192, False)


def test_without_a_budget_the_device_default_is_planned_for(explained, monkeypatch):
    """No `memory_budget_gb`: the backend plans for `default_budget(device)`
    (on CUDA the device's free memory; `test_default_budget_on_cuda`), and
    chooses what `explain(...).plan()` chooses for that budget."""
    from longstraw.planning import sizing

    report = explained("qwen3")  # the dense model: test_a_budget_chooses_the_chunk_and_recomputation runs the hybrid
    roomy = report.plan(P=P, budget_gb=100.0)
    budget = roomy.peak - 4096  # the largest chunk without recomputation just misses
    expected = report.plan(P=P, budget_gb=budget / 1e9)
    asked = []
    monkeypatch.setattr(sizing, "default_budget", lambda device: asked.append(device) or budget)
    backend = longstraw.Backend()
    with torch.no_grad():
        compile_loss(grpo_loss_f64, backend)(MODELS["qwen3"](), *make_group(2, P, R))
    chosen = backend.plans[-1].options
    assert asked == [torch.device("cpu")]
    assert (chosen.prefix_chunk_size, chosen.recompute_layers) == (expected.prefix_chunk_size, expected.recompute_layers)
    assert (chosen.prefix_chunk_size, chosen.recompute_layers) != (roomy.prefix_chunk_size, roomy.recompute_layers)


@pytest.mark.gpu
def test_default_budget_on_cuda():
    """On CUDA the default budget is the device's free memory (what is allocated plus free, less the margin)."""
    from longstraw.planning import planner
    from longstraw.runtime import device_memory

    device = torch.device("cuda")
    held = torch.empty(1 << 28, dtype=torch.uint8, device=device)
    free, total = torch.cuda.mem_get_info(device)
    reserved_free = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    expected = torch.cuda.memory_allocated(device) + free + reserved_free - device_memory.BUDGET_MARGIN * total
    assert abs(planner.default_budget(device) - expected) < 64 << 20
    del held


def test_a_training_loop_reuses_the_simulation_of_a_longer_prompt(monkeypatch):
    """Plans for new prompt and completion lengths reuse the compiled
    graph's simulation of a prompt and branches at least as long: it holds
    at least as much (here the CPU's attention blocks span the whole
    prompt, so they grow with P). A longer prompt, or longer branches, is
    simulated again. (Compiled with dynamic sizes: one Dynamo graph, whose
    plans share one cache.)"""
    from longstraw.planning import planner, sizing

    simulated, caches = [], []
    simulate = planner.simulate_step
    monkeypatch.setattr(planner, "simulate_step", lambda program, *a: simulated.append(program) or simulate(program, *a))

    class Recorded(planner.MemoryModel):
        def __init__(self, program, options, activations=None):
            caches.append(activations)
            super().__init__(program, options, activations)

    monkeypatch.setattr(sizing, "MemoryModel", Recorded)
    backend = longstraw.Backend(memory_budget_gb=100.0, prefix_chunk_size=32)
    step = compile_loss(grpo_loss_f64, backend, dynamic=True)
    model = make_model("qwen3")
    # 100 and 55 reuse 120's simulation; 150 is longer; R + 2 runs longer branches; R - 2 reuses that
    lengths = ((120, R), (100, R), (55, R), (150, R), (150, R + 2), (90, R - 2))
    with torch.no_grad():
        for prompt_len, branch in lengths:
            step(model, *make_group(2, prompt_len, branch))
    ran = [(program.traced_prefix_len + 1, program.partition.end - program.traced_prefix_len) for program in simulated]
    assert ran == [(120, R), (150, R), (150, R + 2)]
    assert len(caches) == len(lengths) and all(cache is caches[0] for cache in caches)
    cpu = torch.device("cpu")
    # simulated afresh, each plan with a cache of its own: the four prompt lengths the assertions compare
    plans = {p: plan for (p, _), plan in zip(lengths, backend.plans)}
    fresh = {p: memory_model(plans[p]).activations("exact", 32, False, cpu, None) for p in (55, 100, 120, 150)}
    assert fresh[55].held < fresh[100].held < fresh[120].held < fresh[150].held  # what a reuse must cover: they grow with P
    for shorter in (1, 2):  # 100 and 55: 120's activations
        assert memory_model(backend.plans[shorter], caches[0]).activations("exact", 32, False, cpu, None) == fresh[120]


def test_a_dynamic_graph_is_planned_with_the_floats_it_reads():
    """`dynamic=True` makes a module's float attributes (RMSNorm's
    `variance_epsilon`) inputs read with `.item()`: the simulation gives
    them their values, as fake tensors have none, and the step is eager's."""
    from helpers.reference import eager_loss_and_grads

    model = make_model("qwen3")
    backend = longstraw.Backend(memory_budget_gb=100.0)
    step = compile_loss(grpo_loss_f64, backend, dynamic=True)
    group = make_group(2, 40, R)
    got = compiled_loss_and_grads(step, model, *group)
    items = [n for n in backend.plans[-1].partition.graph.nodes if n.op == "call_method" and n.target == "item"]
    assert items, "the dynamic graph reads no float input: the case this tests is gone"
    assert backend.plans[-1].options.prefix_chunk_size is not None  # planned, and simulated to plan
    want = eager_loss_and_grads(grpo_loss_f64, model, *group)
    assert_close(got[0], want[0], 1e-6, "loss")
    for name, grad in got[1].items():
        assert_close(grad, want[1][name], 1e-6, name)


@pytest.mark.parametrize("budget", [0, -1.0, "8", True])
def test_budget_is_validated(budget):
    with pytest.raises(longstraw.LongStrawError, match="memory_budget_gb must be a positive number"):
        longstraw.Backend(memory_budget_gb=budget)


@pytest.mark.parametrize("kind, mode, recompute", [
    # the dense exact case in CI; the hybrid's simulation runs in CI through test_simulation.py's fla case
    pytest.param("qwen3_5", "exact", True, marks=pytest.mark.slow),
    pytest.param("qwen3_5", "detached", False, marks=pytest.mark.slow), ("qwen3", "exact", True),
])
def test_simulating_three_chunks_predicts_the_whole_prompt(kind, mode, recompute, explained, monkeypatch):
    """The simulation runs the first prompt chunk and the last two
    (`ChunkSchedule.sampled`); over a prompt of eight chunks and a
    shorter ninth it predicts what running all of them does: the same
    bytes. The hybrid's carries are what a skipped chunk could get wrong;
    its exact mode runs with `-m slow`."""
    from longstraw.runtime.schedule import ChunkSchedule

    report = explained(kind)
    device = torch.device("cpu")
    assert len(ChunkSchedule(P - 1, 30).sampled(in_rounds=False)) == 3
    sampled = memory_model(report.group_plan).activations(mode, 30, recompute, device, None)
    everything = lambda schedule, in_rounds: schedule.chunks  # noqa: E731
    monkeypatch.setattr(ChunkSchedule, "sampled", everything)  # for the runner and the planner's state alike
    full = memory_model(report.group_plan).activations(mode, 30, recompute, device, None)
    assert sampled == full, (sampled, full)


DEEP = {
    # six periods of the hybrid's pattern (linear, full); six dense layers
    "qwen3_5": lambda: make_qwen3_5(num_hidden_layers=12, layer_types=["linear_attention", "full_attention"] * 6),
    "qwen3": lambda: tiny_causal_lm("qwen3", num_hidden_layers=6, hidden_size=32, intermediate_size=48, head_dim=8),
}


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.slow)])  # 2: context parallelism's rounds
@pytest.mark.parametrize("kind, mode, recompute", [
    pytest.param("qwen3_5", "exact", True, marks=pytest.mark.slow), ("qwen3_5", "detached", False),
    pytest.param("qwen3", "exact", True, marks=pytest.mark.slow),  # the hybrid's case covers the extrapolation in CI
])
def test_deep_steps_are_simulated_at_two_periods_and_extrapolated(kind, mode, recompute, ranks, monkeypatch):
    """A model of six periods of identical layers is simulated at two and
    three (`longstraw.planning.depth`), each phase's peak extrapolated to the full
    depth: the same bytes as simulating every layer."""
    from longstraw.planning import planner, simulation

    with qwen3_5.bound():
        report = longstraw.explain(grpo_loss_f64, DEEP[kind](), *make_group(2, 97, R))
    depth = simulation.step_depth(report.group_plan.program)
    assert (depth.period, depth.periods) == ((2, 6) if kind == "qwen3_5" else (1, 6))
    simulated = []  # layers of the steps each simulation ran
    phases = simulation.simulate_phases

    def simulate(*args):
        simulated.append(len({layer_of(n) for n in args[7][1].module.graph.nodes} - {None}))  # `steps`
        return phases(*args)

    monkeypatch.setattr(planner, "simulate_phases", simulate)
    model = memory_model(report.group_plan)
    device = torch.device("cpu")
    extrapolated = model.simulated_peak(mode, 32, recompute, device, None, ranks)
    assert simulated == [2 * depth.period, 3 * depth.period]  # two and three periods, no fallback to the whole depth
    plan = report.group_plan
    assert extrapolated == simulation.simulate_step(plan.program, plan.options, mode, 32, recompute, device, None, ranks)


@pytest.mark.parametrize("kind, mode, recompute", [
    # the dense exact case in CI; the hybrid's simulation runs in CI through test_simulation.py's fla case
    pytest.param("qwen3_5", "exact", True, marks=pytest.mark.slow),
    pytest.param("qwen3_5", "detached", False, marks=pytest.mark.slow), ("qwen3", "exact", True),
])
def test_simulating_three_rounds_predicts_every_round(kind, mode, recompute, explained, monkeypatch):
    """Over two ranks the simulation runs one rank's steps with their
    rounds (`SimulatedRanks`: the gathers allocate, nothing is exchanged)
    and of the rounds the first and the last two (`ChunkSchedule.sampled`); over
    four rounds and a chunk after them it predicts what running them all
    does: the same bytes."""
    from longstraw.runtime.schedule import ChunkSchedule

    report = explained(kind)
    device = torch.device("cpu")
    schedule = ChunkSchedule(P - 1, 30, 2)
    chunks = schedule.chunks
    assert len(chunks) == 9 and schedule.sampled(in_rounds=True) == chunks[:2] + chunks[4:]
    sampled = memory_model(report.group_plan).activations(mode, 30, recompute, device, None, ranks=2)
    everything = lambda schedule, in_rounds: schedule.chunks  # noqa: E731
    monkeypatch.setattr(ChunkSchedule, "sampled", everything)  # for the runner and the planner's state alike
    full = memory_model(report.group_plan).activations(mode, 30, recompute, device, None, ranks=2)
    assert sampled == full, (sampled, full)


def test_a_rank_is_simulated_with_its_rounds_collectives(monkeypatch):
    """`plan(P, ranks=2)` simulates the steps of one rank of two, with no
    process group: the rounds' collectives (the capture's and the reverse
    pass's gathers and merges, the branches' outputs) go to
    `SimulatedRanks`, whose gathers allocate what a rank receives, and
    the activations are that rank's, not one process's. (Which is larger
    depends on the kernels: on the CPU the explicit softmax holds scores
    over every earlier key, and a rank attends over half of them.)"""
    from longstraw.parallel import ranks

    calls = []
    for name in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all"):
        def counted(self, *args, name=name, original=getattr(ranks.SimulatedRanks, name)):
            calls.append(name)
            return original(self, *args)
        monkeypatch.setattr(ranks.SimulatedRanks, name, counted)
    assert not torch.distributed.is_initialized()
    report = explain("qwen3", prefix_chunk_size=32)
    device = torch.device("cpu")
    model = memory_model(report.group_plan)
    one = model.activations("exact", 32, False, device, None)
    assert not calls
    two = model.activations("exact", 32, False, device, None, ranks=2)  # less each one's share of the state
    assert {"all_gather", "reduce_scatter", "all_reduce"} <= set(calls)
    assert two != one


@pytest.mark.parametrize("mode", ["exact", pytest.param("detached", marks=pytest.mark.slow)])
def test_carried_spans_of_one_signature_are_simulated_once(mode, explained, monkeypatch):
    """The simulation runs one span's backward per signature of a carried
    operator (Gated DeltaNet, the causal convolution) and accounts for the
    rest without running them: the same bytes as running every span."""
    import contextlib

    from longstraw.planning import simulation

    report = explained("qwen3_5")
    cpu = torch.device("cpu")
    plan = report.group_plan
    once = simulation.simulate_step(plan.program, plan.options, mode, 32, True, cpu, None)
    monkeypatch.setattr(simulation, "shape_only_spans", lambda spans: contextlib.nullcontext())
    assert once == simulation.simulate_step(plan.program, plan.options, mode, 32, True, cpu, None)
