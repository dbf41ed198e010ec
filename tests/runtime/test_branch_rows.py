"""Branch steps of several rows (`Options.branch_rows`, longstraw/runtime/runner.py):
the layers run on k rows at once, each row's attention reads the prompt's
state alone. Gradients are eager's (float64, NaN-filled state and
uninitialised memory) in both modes, with kept graphs and replays, over
shuffled groups, TRL's padded layout and dropout; plans whose passes read
the state one row at a time run one row per step and say so."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import longstraw
from longstraw import pipeline
from longstraw.models import qwen3_5
from longstraw.runtime.kernels import attention_over_state
from longstraw.codegen.program import StepProgram
from longstraw.options import Options
from longstraw.planning.planner import Simulations
from longstraw.planning.sizing import KeptRoom
from longstraw.runtime.phases import phase_of
from longstraw.runtime.step_seconds import StepSeconds

from conftest import raises_longstraw
from helpers.batches import batch_loss, detached_batch_reference, make_batch
from helpers.compare import assert_grads_close
from helpers.families import FAMILIES
from helpers.harness import assert_parity, compile_loss, compiled_loss_and_grads
from helpers.losses import grpo_loss_f64
from helpers.padding import MODELS, detached_reference, padded_group, trl_grpo_loss, trl_tail
from helpers.parity import deterministic_algorithms
from helpers.plain_transformer import make_plain
from helpers.tiny_models import make_group

TOL = 1e-6  # HF norms and RoPE round through float32
BATCHED, ONE_ROW = "running branches", "running branch"
REPLAYED, KEPT = "replaying branches", "differentiating the kept branches"


@contextlib.contextmanager
def steps() -> Iterator[list[str]]:
    """The full names of the runtime's steps run inside (not the planner's simulation's)."""
    seen: list[str] = []

    @contextlib.contextmanager
    def record(where: str) -> Iterator[None]:
        if not any(isinstance(mode, FakeTensorMode) for mode in _get_current_dispatch_mode_stack()):
            seen.append(where)
        yield

    with longstraw.around_steps(record):
        yield seen


def phases(seen: list[str]) -> list[str]:
    return [phase_of(where) for where in seen]


def run_batch(family: str, sizes: list[int], **options) -> list[str]:
    fam = FAMILIES[family]
    model = fam.build()
    batch = make_batch(sizes, P=13, R=3, vocab=model.config.vocab_size)
    backend = longstraw.Backend(prefix_chunk_size=4, verify_state=True, **options)
    tol = max(TOL, fam.tol)  # a family's own float32 rounding (Kimi Linear's gates), as its family test allows
    with fam.bind(), deterministic_algorithms(True), steps() as seen:
        assert_parity(batch_loss, backend, detached_batch_reference, model, *batch, tol=tol, what=f"{family} loss")
    return seen


@pytest.mark.parametrize(("family", "sizes", "rows", "mode", "keep", "recompute"), [
    ("qwen3", [3, 2], 2, "exact", False, False),
    ("qwen3", [4], 4, "detached", True, False),
    ("qwen3", [3, 2], 3, "exact", True, False),
    ("qwen3", [3, 2], 2, "exact", False, True),
    pytest.param("llama", [2, 3], 2, "detached", False, False, marks=pytest.mark.slow),
    # latent attention (MLA): kept graphs of several rows, and replayed layer by layer (exact mode: the
    # detached reference here holds keys and values constant, MLA's detached mode its latent state)
    ("deepseek_v3", [3, 2], 3, "exact", True, False),
    ("glm_moe_dsa", [3, 2], 3, "exact", True, False),  # and DSA's selection
    pytest.param("deepseek_v3", [3, 2], 2, "exact", False, True, marks=pytest.mark.slow),
])
def test_branch_rows_match_eager(family, sizes, rows, mode, keep, recompute):
    """Each group's branches run `rows` at a time (the last step takes what
    is left; the shuffled batch's groups are not consecutive rows), and are
    differentiated as they ran: from kept graphs, or replayed in steps of
    the same rows (layer by layer under `recompute_layers`, the attention's
    outputs kept through the recomputation)."""
    seen = run_batch(family, sizes, branch_rows=rows, prompt_grad=mode, keep_graphs=keep, recompute_layers=recompute)
    steps_of = [-(-n // rows) for n in sizes]
    multi = sum(n // rows + (n % rows > 1) for n in sizes)
    assert phases(seen).count(BATCHED) == multi
    assert phases(seen).count(BATCHED) + phases(seen).count(ONE_ROW) == sum(steps_of)
    differentiated = phases(seen).count(KEPT if keep else REPLAYED)
    assert differentiated == multi
    assert any(where.startswith(f"{BATCHED} ") and " of " in where for where in seen)


def test_gradients_equal_one_row_steps():
    """Several rows per step change the order of no sum that matters: the
    loss and gradients are the one-row steps' to float64 rounding."""
    fam = FAMILIES["qwen3"]
    model = fam.build()
    batch = make_batch([4, 3], P=13, R=3, vocab=model.config.vocab_size)
    results = []
    for rows in (1, 4):
        backend = longstraw.Backend(prefix_chunk_size=4, recompute_layers=False, branch_rows=rows)
        with fam.bind(), deterministic_algorithms(True):
            results.append(compiled_loss_and_grads(compile_loss(batch_loss, backend), model, *batch))
        torch._dynamo.reset()
    assert torch.allclose(results[0][0], results[1][0], rtol=1e-12, atol=0)
    assert_grads_close(results[0][1], results[1][1], 1e-11)


def every_position_loss(model, prompt_ids, prompt_mask, completion_ids, completion_mask, advantages):
    """TRL's forward scored at every completion position, padding included:
    what a padded position's query sees (its row's keys up to that row's
    padding) shows in the loss."""
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=completion_ids.shape[1] + 1).logits
    return trl_tail(logits[:, :-1], completion_ids, torch.ones_like(completion_mask), advantages)


@pytest.mark.parametrize("mode", ["exact", "detached"])
def test_trl_layout_left_padding_and_ragged_completions(mode):
    """TRL's rows: a left-padded prompt and completions right-padded to
    different lengths, so each row of a step has its own key span; every
    row's attention gets its own row of the mask (exact mode's loss reads
    the padded positions too)."""
    model = MODELS["qwen3"]()
    group = padded_group(4, 29, 6, 5, [6, 2, 4, 1])
    backend = longstraw.Backend(prompt_grad=mode, prefix_chunk_size=8, verify_state=True, branch_rows=4)
    loss = every_position_loss if mode == "exact" else trl_grpo_loss
    with qwen3_5.bound(), deterministic_algorithms(True), steps() as seen:
        assert_parity(loss, backend, detached_reference, model, *group, tol=TOL)
    assert phases(seen).count(BATCHED) == 1 and ONE_ROW not in phases(seen)


@pytest.mark.parametrize("lengths", [None, [6, 2, 4, 1]], ids=["full-completions", "ragged"])
def test_rows_attend_at_once_where_their_masks_agree(lengths, monkeypatch):
    """A left-padded prompt: every row's mask is a causal run of keys from
    the padding's end, and the rows' queries attend over the prompt in one
    call (`RowsOverState`); where completions are right-padded to
    different lengths, each padded completion's padded queries attend again
    over its own span. Eager's gradients either way, with a loss that reads
    the padded positions."""
    calls = []
    fused = attention_over_state.RowsOverState.apply
    monkeypatch.setattr(attention_over_state.RowsOverState, "apply", lambda *a: calls.append(a[-1]) or fused(*a))
    model = MODELS["qwen3"]()
    group = padded_group(4, 29, 6, 5, lengths)
    backend = longstraw.Backend(prefix_chunk_size=8, verify_state=True, branch_rows=4)
    with deterministic_algorithms(True):
        assert_parity(every_position_loss, backend, detached_reference, model, *group, tol=TOL)
    layers = model.config.num_hidden_layers
    assert calls == [5] * 2 * layers  # the forward and the replay, from position 5


def test_the_rows_hand_the_kernels_a_contiguous_log_sum_exp(monkeypatch):
    """Flash's backward reads the log-sum-exp as a contiguous buffer and
    ignores its strides; the rows' merged one is laid out from a transpose.
    On an H100 in bf16 that gave gradients 4 to 6 times further from
    float64 than eager's (float64, on the explicit softmax, was exact).
    Every kernel the rows' attention calls backward on gets a contiguous
    one (the explicit softmax, made strict here, on the CPU)."""
    from longstraw.runtime.kernels.attention import MathKernel

    class Strict(MathKernel):
        def backward(self, grad_out, q, keys, values, out, lse, *rest):
            assert lse.is_contiguous(), lse.stride()
            return super().backward(grad_out, q, keys, values, out, lse, *rest)

    monkeypatch.setattr(attention_over_state, "kernel_for", lambda q, mask: Strict())
    model = MODELS["qwen3"]()
    group = padded_group(4, 29, 6, 5, [6, 2, 4, 1])
    backend = longstraw.Backend(prefix_chunk_size=8, branch_rows=4)
    assert_parity(every_position_loss, backend, detached_reference, model, *group, tol=TOL)


def test_dropout_is_replayed_for_the_rows_of_a_step():
    """A step of several rows draws its dropout masks once; its replay
    restores the generators and draws the same: the gradients are those of
    the forward that gave the loss (the same run with one row per step
    draws other masks, so the check is against the step's own forward,
    recorded with its outputs)."""
    model = make_plain(dropout=0.3).train()
    args = make_group(4, 21, 5)
    backend = longstraw.Backend(prefix_chunk_size=8, branch_rows=2, recompute_layers=False)
    step = compile_loss(grpo_loss_f64, backend)
    step(model, *args).backward()  # plan
    runner = backend.plans[-1].runner
    assert runner.random
    calls: list[tuple[bool, int, list[torch.Tensor]]] = []

    def record(module, inputs, out):
        calls.append((inputs[0].grad_enabled, inputs[0].rows, [o.detach().clone() for o in out]))

    handle = runner.branch_step(2).module.register_forward_hook(record)
    torch.manual_seed(1)
    step(model, *args).backward()
    handle.remove()
    forward = [c for c in calls if not c[0]]
    replay = [c for c in calls if c[0]]
    assert len(forward) == len(replay) == 2 and all(c[1] == 2 for c in calls)
    for (_, _, a), (_, _, b) in zip(forward, replay):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), "a step of two rows replayed differently"


def test_passes_that_read_one_row_run_one_row_per_step(caplog, monkeypatch):
    """A pass that keeps `ArchitecturePass.branches_batched` False (a pass
    of your own until a parity test shows its rows; here the built-in
    sparse attention, switched off): asked for three rows, the plan runs
    one and says why, in the log and in its summary."""
    from longstraw.passes.sparse_index import SparseLatentAttentionPass

    monkeypatch.setattr(SparseLatentAttentionPass, "branches_batched", False)
    with caplog.at_level(logging.WARNING, logger="longstraw.runtime.runner"):
        seen = run_batch("glm_moe_dsa", [3], branch_rows=3)
    assert BATCHED not in phases(seen) and phases(seen).count(ONE_ROW) == 3
    assert any("sparse_latent_attention" in r.getMessage() and "one row at a time" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("family", ["deepseek_v3", "kimi_linear", "glm_moe_dsa"])
def test_latent_attention_runs_steps_of_several_rows(family):
    """Latent attention (MLA: DeepSeek-V3, Kimi Linear beside its delta
    rule; with DSA's selection: GLM-5) in steps of several rows, each row
    over the prompt's latent (and index) state with its own from the step's
    arguments (`passes.mla.latent_attention_step`,
    `passes.sparse_index.sparse_latent_attention_step`): eager's loss and
    gradients, two groups in steps of two rows and one, NaN-filled memory."""
    seen = run_batch(family, [3, 2], branch_rows=2, recompute_layers=False)
    assert phases(seen).count(BATCHED) == 2, family


def test_carried_operators_start_every_row_from_the_prompts_carry():
    """Gated DeltaNet and its short convolution (Qwen3.5), LFM2's
    convolution and Mistral's sliding window (carried passes) in steps of
    several rows: exact mode matches eager, detached mode the one-row steps
    (to the float32 rounding of Qwen3.5's norms and gates)."""
    for family in ("qwen3_5", "lfm2", "mistral"):
        seen = run_batch(family, [3, 2], branch_rows=2, recompute_layers=False)
        assert phases(seen).count(BATCHED) == 2, family
    fam = FAMILIES["qwen3_5"]
    model = fam.build()
    batch = make_batch([4], P=13, R=3, vocab=model.config.vocab_size)
    results = []
    for rows in (1, 4):
        backend = longstraw.Backend(prefix_chunk_size=4, prompt_grad="detached", branch_rows=rows, verify_state=True)
        with fam.bind(), deterministic_algorithms(True):
            results.append(compiled_loss_and_grads(compile_loss(batch_loss, backend), model, *batch))
        torch._dynamo.reset()
    assert torch.allclose(results[0][0], results[1][0], rtol=TOL, atol=0)
    assert_grads_close(results[0][1], results[1][1], TOL)  # its float32 parts round per batch shape


def spare_graphs(monkeypatch) -> dict[str, int | None]:
    """Each plan's room beside its peak set to `extra["rows"]` planned
    graphs (None: as planned); returns `extra`."""
    sized = pipeline.size_plan
    extra = {"rows": None}
    # the runs with keep_graphs=False trace one model and batch under one set of options: one simulation serves
    # their plans, as it serves one compiled graph's (the room each run is given is this test's own)
    simulations: Simulations = {}

    def with_room(program: StepProgram, opts: Options, args: Sequence[Any], activations: Simulations):
        options, room = sized(program, opts, args, simulations if opts.keep_graphs is False else activations)
        if extra["rows"] is None:
            return options, room
        spare = extra["rows"] * room.graph_chunk
        return options, KeptRoom(0, spare, room.graph_chunk, room.step, spare)

    monkeypatch.setattr(pipeline, "size_plan", with_room)
    return extra


def test_planned_rows_follow_the_room(monkeypatch):
    """`branch_rows=None` with a budget: as many rows per step as the room
    beside the planned peak holds at a branch's graph each beyond the
    first; with room for one more, steps of two; with none, one row; and
    one row where the rows' room would keep fewer graphs."""
    extra = spare_graphs(monkeypatch)
    seen = run_batch("qwen3", [4], memory_budget_gb=100.0, keep_graphs=False)
    assert phases(seen).count(BATCHED) == 1 and ONE_ROW not in phases(seen)
    for rows, batched, single in ((1, 2, 0), (0, 0, 4)):
        torch._dynamo.reset()
        extra["rows"] = rows
        seen = run_batch("qwen3", [4], memory_budget_gb=100.0, keep_graphs=False)
        assert (phases(seen).count(BATCHED), phases(seen).count(ONE_ROW)) == (batched, single)
    # where graphs may be kept, rows give way to them: room for three graphs keeps the prompt's (three
    # chunks of 4) with steps of one row, and would keep nothing beside steps of four
    torch._dynamo.reset()
    extra["rows"] = 3
    seen = run_batch("qwen3", [4], memory_budget_gb=100.0)
    assert BATCHED not in phases(seen) and phases(seen).count(ONE_ROW) == 4
    assert phases(seen).count("differentiating the kept prompt") == 3


@pytest.mark.parametrize("launch_bound", [True, False])
def test_rows_and_graphs_weighed_by_measured_seconds(monkeypatch, caplog, launch_bound):
    """Room for three graphs: steps of one row keep the prompt's (three
    chunks), steps of four keep nothing. Where the steps' forwards were
    measured (CUDA events on a GPU; set here), the faster schedule runs: a
    step of four rows that takes a step of one's time (bound by launches)
    runs the rows and the prompt's forward again; one that takes four
    times as long keeps the prompt's graph. Eager's gradients either way."""
    extra = spare_graphs(monkeypatch)
    extra["rows"] = 3
    per_position = {("branch", 1): 1e-3, ("branch", 4): 0.25e-3 if launch_bound else 1e-3, ("prompt", 1): 1e-3}
    monkeypatch.setattr(StepSeconds, "settle", lambda self: self.measured.update(per_position))
    with caplog.at_level(logging.INFO, logger="longstraw.runtime.kept_graphs"):
        seen = run_batch("qwen3", [4], memory_budget_gb=100.0)
    chose = [r.getMessage() for r in caplog.records if "by the measured forwards" in r.getMessage()]
    assert chose and all(m.endswith(": 4 rows" if launch_bound else ": one row") for m in chose), chose
    if launch_bound:
        assert phases(seen).count(BATCHED) == 1 and ONE_ROW not in phases(seen), phases(seen)
        assert "differentiating the kept prompt" not in phases(seen) and "in the reverse pass" in phases(seen)
    else:
        assert BATCHED not in phases(seen) and phases(seen).count(ONE_ROW) == 4, phases(seen)
        assert phases(seen).count("differentiating the kept prompt") == 3


def test_planned_rows_follow_the_measured_graph_bytes(monkeypatch):
    """Once a kept branch is measured (CUDA; faked here at a tenth of the
    planned bytes), a row beyond the first is counted at twice its measured
    bytes, not at the planned bytes (the largest step's, an upper bound):
    room for three planned graphs keeps the prompt's graph on the first
    call (one row per step), the branches' too on the second (one row per
    step: no branch measured yet), and runs the group's four rows as one
    step on the third, every graph kept. A new prompt length (a new plan
    of the same compiled loss) starts from what was measured: four rows
    at once at its first call. Eager's gradients every time."""
    from helpers.compare import assert_close, assert_grads_close
    from helpers.harness import compiled_loss_and_grads
    from helpers.kept_room import room_for_graphs
    from helpers.reference import eager_loss_and_grads

    planned = room_for_graphs(monkeypatch, 3)  # each kept step measured at a tenth of the first plan's graph
    fam = FAMILIES["qwen3"]
    model = fam.build()
    backend = longstraw.Backend(prefix_chunk_size=4, memory_budget_gb=100.0, verify_state=True)
    compiled = compile_loss(batch_loss, backend, dynamic=True)
    calls = []
    for P in (13, 13, 13, 17):
        batch = make_batch([4], P=P, R=3, vocab=model.config.vocab_size)
        with fam.bind(), deterministic_algorithms(True), steps() as seen:
            got_loss, got = compiled_loss_and_grads(compiled, model, *batch)
            want_loss, want = eager_loss_and_grads(batch_loss, model, *batch)
        assert_close(got_loss, want_loss, TOL, f"loss at P = {P}")
        assert_grads_close(got, want, TOL)
        calls.append(phases(seen))
    assert calls[0].count(ONE_ROW) == 4 and "differentiating the kept branch" not in calls[0], calls[0]
    assert calls[1].count(ONE_ROW) == 4 and calls[1].count("differentiating the kept branch") == 4, calls[1]
    for call in calls[2:]:
        assert call.count(BATCHED) == 1 and ONE_ROW not in call and call.count(KEPT) == 1, call
    assert all("differentiating the kept prompt" in call for call in calls)
    assert len(backend.plans) == 2  # one per length, sharing what the first measured
    runner = backend.plans[-1].runner
    assert abs(runner.graph_bytes.row(4) - 2 * (planned["graph"] // 10)) <= 2, (runner.graph_bytes.row(4), planned)


@pytest.mark.parametrize("value", [0, -2, 1.5, "4"])
def test_the_option_is_validated(value):
    with raises_longstraw(match="branch_rows must be a positive int or None"):
        longstraw.Backend(branch_rows=value)


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [None, [6, 3, 1, 6]], ids=["full-completions", "ragged"])
def test_cuda_bf16_rows_are_as_accurate_as_eager(lengths):
    """bf16 on CUDA, TRL's padded layout, four rows per step: the fused
    kernels over the prompt for the rows at once (flash, GQA) and over each
    row's own keys; against float64, the worst parameter's gradient is no
    further off than eager bf16's (within a factor 2), and float64 on CUDA
    is eager's."""
    import copy

    from helpers.compare import rel_err
    from helpers.reference import eager_loss_and_grads

    group = tuple(t.cuda() for t in padded_group(4, 41, 6, 13, lengths))
    truth_model = MODELS["qwen3"]().cuda()
    backend = longstraw.Backend(prefix_chunk_size=8, branch_rows=4, verify_state=True)
    assert_parity(every_position_loss, backend, detached_reference, truth_model, *group, tol=TOL)
    model = copy.deepcopy(truth_model).to(torch.bfloat16)
    _, truth = eager_loss_and_grads(every_position_loss, truth_model, *group)
    _, eager = eager_loss_and_grads(every_position_loss, model, *group)
    torch._dynamo.reset()
    backend = longstraw.Backend(prefix_chunk_size=8, branch_rows=4)
    _, got = compiled_loss_and_grads(compile_loss(every_position_loss, backend), model, *group)
    worst = lambda grads: max(rel_err(grads[n].double(), truth[n]) for n in truth if truth[n] is not None)  # noqa: E731
    assert worst(got) <= 2 * worst(eager), (worst(got), worst(eager))
