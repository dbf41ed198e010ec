"""Branch steps cut after their rows' last read position (`analysis/read_cut.py`):
the scorer's loss is proved to read nothing past it and runs fewer positions
with eager's loss and gradients (float64, NaN-filled memory, every schedule
below); a loss the proof does not cover runs every position, and says why."""

from __future__ import annotations

import pytest
import torch

import longstraw
from longstraw.models import qwen3_5
from longstraw.runtime import branch_turns
from longstraw.runtime.kernels.logprobs import logprobs_and_entropy

from helpers.compare import assert_close, assert_grads_close
from helpers.harness import assert_parity, compile_loss, compiled_loss_and_grads
from helpers.kept_room import room_for_graphs
from helpers.padding import MODELS, padded_group, scored_grpo_loss
from helpers.parity import deterministic_algorithms

TOL = 2e-5  # the scorer computes log-probs and entropies in float32, as TRL does


def batch():
    """Two prompts (one left-padded) of three rows, completions of 5, 2, 3
    and 1, 4, 2 real tokens right-padded to 5."""
    groups = [padded_group(3, 6, 5, 1, [5, 2, 3], seed=1), padded_group(3, 6, 5, 0, [1, 4, 2], seed=2)]
    return tuple(torch.cat(parts) for parts in zip(*groups))


def _scored(model, prompt_ids, prompt_mask, completion_ids, completion_mask, advantages, logits_of, mask_of=None):
    """The scorer's loss with the logits and the mask taken by `logits_of(out, R)` and `mask_of(...)`."""
    R = completion_ids.shape[1]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    logits = logits_of(model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=R + 2).logits, R)
    real = attention_mask[:, -R:] != 0
    if mask_of is not None:
        real = real & mask_of(model)
    logps, entropy = logprobs_and_entropy(logits, input_ids[:, -R:], real, 0.7)
    mask = completion_mask.to(logps.dtype)
    per_token = -torch.exp(logps - logps.detach()) * advantages[:, None].to(logps.dtype) - 0.01 * entropy
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean(), logits


def scored_without_the_last_input(model, prompt_ids, prompt_mask, completion_ids, completion_mask, advantages):
    """The logits of positions P-1 .. P+R-2 taken whole (no `[:, :-1]`), so
    the LM head and the op's inputs are a head region `head.py` chunks."""
    R = completion_ids.shape[1]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)[:, :-1]
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)[:, :-1]
    logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=R).logits
    logps, entropy = logprobs_and_entropy(logits, completion_ids, completion_mask != 0, 0.7)
    mask = completion_mask.to(logps.dtype)
    per_token = -torch.exp(logps - logps.detach()) * advantages[:, None].to(logps.dtype) - 0.01 * entropy
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def reads_logits_too(model, *batch):
    """Adds nothing (0 x the logits' mean), but the tail reads every logit."""
    loss, logits = _scored(model, *batch, lambda out, R: out[:, 1:-1])
    return loss + 0.0 * logits.float().mean()


def slices_from_the_end(model, *batch):
    return _scored(model, *batch, lambda out, R: out[:, -R - 1:-1])[0]


def regroups_with_a_traced_size(model, *batch):
    return _scored(model, *batch, lambda out, R: out[:, 1:-1].reshape(out.shape[0], R, -1))[0]


def masks_by_the_model(model, *batch):
    """A mask that reads a parameter (always True here): the proof reads the graph, not the values."""
    return _scored(model, *batch, lambda out, R: out[:, 1:-1], lambda model: model.lm_head.weight[0, 0] < 1e9)[0]


def scored_from_the_front(model, *batch):
    return _scored(model, *batch, lambda out, R: out[:, 1:-1])[0]


def reads_the_padding_too(model, prompt_ids, prompt_mask, completion_ids, completion_mask, advantages):
    """The scorer's operator over every completion position, padding
    included (its mask from the ids alone): the padded queries are read."""
    R = completion_ids.shape[1]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=R + 1).logits[:, :-1]
    logps, entropy = logprobs_and_entropy(logits, completion_ids, completion_ids >= 0, 0.7)
    return (-torch.exp(logps - logps.detach()) * advantages[:, None].to(logps.dtype) - 0.01 * entropy).mean()


SCHEDULES = [
    {},
    {"branch_rows": 2},
    {"branch_rows": 3, "keep_graphs": False},
    {"recompute_layers": True, "head_chunk_size": 1, "keep_graphs": False},
    {"prefix_chunk_size": 2, "keep_group_states": True},
]


def _cases():
    """In CI each family once and the first two schedules once each: the dense model planned, the hybrid two
    rows a step (its carried state across a step's rows); the fuzz property draws the others; every one with
    `-m slow`."""
    in_ci = {("qwen3", 0), ("qwen3_5", 1)}
    for family in ("qwen3", "qwen3_5"):
        for i, options in enumerate(SCHEDULES):
            name = ",".join(f"{k}={v}" for k, v in options.items()) or "planned"
            slow = (family, i) not in in_ci
            yield pytest.param(family, options, id=f"{family}-{name}", marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("family, options", list(_cases()))
def test_the_scorer_runs_only_the_read_positions(family, options):
    """Eager's loss and gradients (exact mode) from 23 of the padded rows'
    36 branch positions (rows sorted into steps by their last read position)."""
    model = MODELS[family](seed=0)
    temperature = torch.linspace(0.5, 1.5, 6, dtype=torch.float64)  # one per row, as verl samples
    backend = longstraw.Backend(prompt_grad="exact", verify_state=True, **options)
    with qwen3_5.bound(), deterministic_algorithms(False):
        assert_parity(scored_grpo_loss, backend, None, model, *batch(), temperature, tol=TOL)
    runner = backend.plans[-1].runner
    assert runner.program.read_masks is not None, runner.program.uncut
    ran, padded = runner.last_call.branch_positions
    # one row per step: 5, 2, 3 | 1, 4, 2 reads, each run to its own + 1 (the position before the first read)
    # branch_rows=2 sorts each group into steps (5, 3 | 2) and (4, 2 | 1); 3 runs a group to its longest
    want = {1: 6 + 3 + 4 + 2 + 5 + 3, 2: 2 * 6 + 3 + 2 * 5 + 2, 3: 3 * 6 + 3 * 5}[options.get("branch_rows", 1)]
    assert (ran, padded) == (want, 36)


@pytest.mark.parametrize("step_positions, want", [(0, 23), pytest.param(1000, 33, marks=pytest.mark.slow)])
def test_planned_rows_per_step_run_the_fewest_positions(monkeypatch, step_positions, want):
    """With room for every row in one step, the runner deals each group into
    the steps that cost the least (`ReadLengths.rows_per_step`): one row per
    step where a step costs nothing beside its positions, whole groups where
    it costs more than any cut saves. Eager's loss and gradients either way."""
    room_for_graphs(monkeypatch, 8)
    monkeypatch.setattr(branch_turns, "STEP_POSITIONS", step_positions)
    model = MODELS["qwen3"](seed=0)
    backend = longstraw.Backend(prompt_grad="exact", verify_state=True, memory_budget_gb=100.0, keep_graphs=False)
    assert_parity(scored_grpo_loss, backend, None, model, *batch(), 0.7, tol=TOL)
    assert backend.plans[-1].runner.last_call.branch_positions == (want, 36)


def test_a_chunked_head_runs_the_read_positions_of_a_cut_step():
    """`HeadChunks` (two read positions a chunk) over a step cut short runs
    the read positions its last exit reaches: 17 of 30 branch positions."""
    model = MODELS["qwen3"](seed=0)
    backend = longstraw.Backend(prompt_grad="exact", verify_state=True, head_chunk_size=2)
    with deterministic_algorithms(False):
        assert_parity(scored_without_the_last_input, backend, None, model, *batch()[:5], tol=TOL)
    runner = backend.plans[-1].runner
    assert runner.program.branch.head is not None
    assert runner.last_call.branch_positions == (17, 30)


def test_detached_mode_is_unchanged_by_the_cut():
    """Detached mode: the cut run equals a padded run of the same loss
    (made uncut by reading the logits with weight 0)."""
    model = MODELS["qwen3"](seed=0)
    args = batch()[:5]
    backend = longstraw.Backend(prompt_grad="detached", verify_state=True)
    cut_loss, cut = compiled_loss_and_grads(compile_loss(scored_from_the_front, backend), model, *args)
    ran, padded = backend.plans[-1].runner.last_call.branch_positions
    assert ran < padded
    whole = longstraw.Backend(prompt_grad="detached", verify_state=True)
    want_loss, want = compiled_loss_and_grads(compile_loss(reads_logits_too, whole), model, *args)
    ran, padded = whole.plans[-1].runner.last_call.branch_positions
    assert ran == padded
    assert_close(cut_loss, want_loss, 1e-12, "loss")
    assert_grads_close(cut, want, 1e-12)


@pytest.mark.parametrize("loss_fn, recomputed", [(scored_from_the_front, 0), (reads_the_padding_too, 10)],
                         ids=["reads-the-real-tokens", "reads-the-padding-too"])
def test_padded_queries_run_as_eagers_only_where_the_loss_reads_them(monkeypatch, loss_fn, recomputed):
    """Steps of a group's three rows (5, 2, 3 and 1, 4, 2 real tokens): a
    padded completion's queries see every key of its span in eager, and
    LongStraw computes them so again (`attention._padded_queries`) only
    where the loss reads them; where it reads only the real tokens they
    stay causal, and loss and gradients are eager's either way (exact mode:
    the five padded rows, forward and replayed, 10 runs a layer)."""
    from longstraw.passes import attention

    calls = []
    original = attention._padded_queries
    monkeypatch.setattr(attention, "_padded_queries", lambda *a: calls.append(1) or original(*a))
    model = MODELS["qwen3"](seed=0)
    backend = longstraw.Backend(prompt_grad="exact", verify_state=True, branch_rows=3, keep_graphs=False)
    assert_parity(loss_fn, backend, None, model, *batch()[:5], tol=TOL)
    layers = model.config.num_hidden_layers
    assert len(calls) == recomputed * layers


@pytest.mark.parametrize("loss_fn, over_span", [(scored_from_the_front, 0), (reads_the_padding_too, 8)],
                         ids=["reads-the-real-tokens", "reads-the-padding-too"])
def test_a_one_row_step_rounded_past_its_row_attends_causally_where_unread(monkeypatch, loss_fn, over_span):
    """One row a step, 40-token completions of 33, 16 and 40 and 20, 40 and
    9 real tokens: a cut step is rounded up to a multiple of 41 // 16 = 2
    positions, so the rows of 16 and 20 tokens run one padded query. Eager's
    form of a padded row's queries (`attention._attention_over_span`) runs
    only where the loss reads them: where it reads the padding too, every
    row short of 40 runs whole, forward and replayed (8 a layer)."""
    from longstraw.passes import attention

    calls = []
    original = attention._attention_over_span
    monkeypatch.setattr(attention, "_attention_over_span", lambda *a: calls.append(1) or original(*a))
    groups = [padded_group(3, 6, 40, 1, [33, 16, 40], seed=1), padded_group(3, 6, 40, 0, [20, 40, 9], seed=2)]
    args = tuple(torch.cat(parts) for parts in zip(*groups))[:5]
    model = MODELS["qwen3"](seed=0)
    backend = longstraw.Backend(prompt_grad="exact", verify_state=True, branch_rows=1, keep_graphs=False)
    assert_parity(loss_fn, backend, None, model, *args, tol=TOL)
    assert len(calls) == over_span * model.config.num_hidden_layers


@pytest.mark.parametrize("loss_fn, why", [
    (reads_logits_too, "is read by `float"),
    (slices_from_the_end, "slices positions counted from the end"),
    (regroups_with_a_traced_size, "sizes a read axis with a traced constant"),
    (masks_by_the_model, "computed from the model's values"),
])
def test_what_the_proof_does_not_cover_runs_every_position(loss_fn, why):
    """Negative controls: each loss reads past a row's last real token, or
    could move a read position at another length; it runs the padded rows,
    says why, and still matches eager."""
    model = MODELS["qwen3"](seed=0)
    backend = longstraw.Backend(prompt_grad="exact", verify_state=True)
    assert_parity(loss_fn, backend, None, model, *batch()[:5], tol=TOL)
    runner = backend.plans[-1].runner
    assert runner.program.read_masks is None
    assert why in runner.program.uncut
    ran, padded = runner.last_call.branch_positions
    assert ran == padded


def test_explain_says_whether_the_branch_steps_are_cut():
    model = MODELS["qwen3"](seed=0)
    cut = str(longstraw.explain(scored_from_the_front, model, *batch()[:5]))
    assert "branch steps: stop after each row's last read position" in cut
    whole = str(longstraw.explain(slices_from_the_end, model, *batch()[:5]))
    assert "branch steps: run every position: `logits_1` (getitem) slices positions counted from the end" in whole
