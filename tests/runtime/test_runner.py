"""Runtime behaviour visible to users (longstraw/runtime/runner.py): progress bars,
replay determinism and RNG replay, failures in backward, state checks,
inputs, isolation, compiles over changing shapes, per-row inputs that
require grad, and verify_state (repeated and higher-order backward:
test_autograd_boundary.py)."""

from __future__ import annotations

import pytest
import torch

import longstraw
from longstraw.runtime.prompt_state import StepContext
from longstraw.runtime.runner import GroupRunner

from conftest import raises_longstraw
from helpers.batches import batch_loss, make_batch
from helpers.compare import assert_close, assert_grads_close, grads_equal
from helpers.harness import compile_loss, compiled_loss_and_grads
from helpers.losses import TAILS, grpo_loss_f64, grpo_tail, logits_of
from helpers.plain_transformer import make_plain
from helpers.reference import (
    detached_logits,
    detached_reference,
    eager_loss_and_grads,
    grads_of,
    seed_grads,
    with_fresh_grads,
)
from helpers.tiny_models import make_group, make_model, make_qwen3, parity_tol


@pytest.mark.parametrize("mode", ["exact", "detached"])
def test_progress_bars_count_tokens(mode, capsys):
    model = make_model("plain")
    step = compile_loss(grpo_loss_f64, longstraw.Backend(prompt_grad=mode, prefix_chunk_size=8, progress=True))
    compiled_loss_and_grads(step, model, *make_group(2, 41, 5))
    err = capsys.readouterr().err
    assert "longstraw prompt capture" in err and "40.0/40.0" in err and "tok/s" in err
    assert ("longstraw reverse pass" in err) == (mode == "exact")


def test_no_progress_when_not_a_terminal(capsys):
    model = make_model("plain")
    step = compile_loss(grpo_loss_f64, longstraw.Backend(prefix_chunk_size=4))  # progress=None, 10 chunks
    compiled_loss_and_grads(step, model, *make_group(2, 41, 5))
    assert "longstraw" not in capsys.readouterr().err


# --- replay: the same values, the same random draws ---------------------------------


def record_steps(plan):
    """(grad_enabled, offset, outputs) of every prefix and branch step call."""
    calls = {"prefix": [], "branch": []}
    for kind in calls:
        module = getattr(plan.runner, kind).module

        def hook(mod, args, out, kind=kind):
            ctx = args[0]
            calls[kind].append((ctx.grad_enabled, ctx.offset, [o.detach().clone() for o in out]))

        module.register_forward_hook(hook)
    return calls


def assert_replays_match_forward(calls):
    for kind, steps in calls.items():
        forward = [s for s in steps if not s[0]]
        replay = [s for s in steps if s[0]]
        if kind == "prefix":  # the reverse pass runs the chunks backwards
            forward, replay = sorted(forward, key=lambda s: s[1]), sorted(replay, key=lambda s: s[1])
        assert len(forward) == len(replay) > 0, kind
        for (_, o1, a), (_, o2, b) in zip(forward, replay):
            assert o1 == o2
            assert all(torch.equal(x, y) for x, y in zip(a, b)), f"{kind} step at {o1} replayed differently"


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_replay_reproduces_the_forward_bit_for_bit(dropout):
    """Branch replays and reverse-pass chunks recompute exactly what the
    forward computed, dropout masks included (the RNG state is replayed)."""
    model = make_model("plain") if dropout == 0 else make_plain(dropout=dropout)
    model.train()
    backend = longstraw.Backend(prefix_chunk_size=8)
    step = compile_loss(grpo_loss_f64, backend)
    args = make_group(3, 30, 6)
    step(model, *args).backward()  # plan
    calls = record_steps(backend.plans[-1])
    torch.manual_seed(1)
    step(model, *args).backward()
    assert_replays_match_forward(calls)
    assert backend.plans[-1].runner.random == (dropout > 0)


# --- failures in backward leave .grad untouched ------------------------------------


def failing_on(module, *, replay_offset=None, row_counter=None, error):
    """Make a step module raise during its replay (grad enabled)."""

    def hook(mod, args):
        ctx = args[0]
        if not ctx.grad_enabled:
            return
        if row_counter is not None:
            row_counter[0] += 1
            if row_counter[0] == 2:
                raise error
        elif ctx.offset == replay_offset:
            raise error

    return module.register_forward_pre_hook(hook)


@pytest.mark.parametrize("where", ["branch", "chunk"])
def test_failed_backward_changes_no_grad_and_says_where(where):
    model = make_model("plain")
    backend = longstraw.Backend(prefix_chunk_size=8)
    step = compile_loss(grpo_loss_f64, backend)
    args = make_group(3, 30, 6)
    step(model, *args).backward()  # plan
    plan = backend.plans[-1]
    before = seed_grads(model)
    if where == "branch":
        error = RuntimeError("simulated failure")
        handle = failing_on(plan.runner.branch.module, row_counter=[0], error=error)
        expected_type, note = RuntimeError, "replaying branch 1 of 3"
    else:
        error = torch.OutOfMemoryError("simulated out of memory")
        handle = failing_on(plan.runner.prefix.module, replay_offset=8, error=error)
        expected_type, note = torch.OutOfMemoryError, "reverse pass over prompt chunk [8, 16)"
    loss = step(model, *args)
    with pytest.raises(expected_type) as info:
        loss.backward()
    assert any(note in n for n in getattr(info.value, "__notes__", [])), getattr(info.value, "__notes__", None)
    assert grads_equal(grads_of(model), before)
    handle.remove()
    # the model and the compiled loss still work
    got = compiled_loss_and_grads(step, model, *args)
    want = eager_loss_and_grads(grpo_loss_f64, model, *args)
    assert_grads_close(got[1], want[1], 1e-9)


def test_non_finite_state_is_reported_with_its_layer():
    model = make_model("plain")
    with torch.no_grad():
        model.blocks[1].attn.k_proj.weight[0, 0] = float("inf")
    before = seed_grads(model)
    with raises_longstraw(r"blocks\.1\.attn.*NaN or Inf.*check_finite"):
        compile_loss(grpo_loss_f64, longstraw.Backend(prefix_chunk_size=8))(model, *make_group(2, 20, 4)).backward()
    assert grads_equal(grads_of(model), before)


def test_finite_checks_are_read_once_a_call_and_name_the_prompt_that_failed(monkeypatch):
    """`check_finite` launches a check after each group's capture and reads
    them together (one device sync) after the last group's branches. Two
    prompts: one read of both checks; then a token only the second prompt
    holds, its embedding row set to Inf, is reported with the layer, and
    `.grad` is untouched."""
    from longstraw.runtime import runner as runner_module

    reads = []
    read = runner_module.nonfinite
    monkeypatch.setattr(runner_module, "nonfinite", lambda checks: reads.append(len(checks)) or read(checks))
    model = make_qwen3().double()
    ids, advantages, mask = make_batch([2, 3], P=13, R=3, vocab=model.config.vocab_size)
    compile_loss(batch_loss, longstraw.Backend(prefix_chunk_size=4))(model, ids, advantages, mask).backward()
    assert reads == [2]
    prompts = ids[:, :13]
    second = prompts[(prompts != prompts[:1]).any(1)][0]
    token = next(t for t in second.tolist() if t not in prompts[0].tolist())
    with torch.no_grad():
        model.model.embed_tokens.weight[token] = float("inf")
    before = seed_grads(model)
    torch._dynamo.reset()
    with raises_longstraw(r"layers\.0\.self_attn.*NaN or Inf.*check_finite"):
        compile_loss(batch_loss, longstraw.Backend(prefix_chunk_size=4))(model, ids, advantages, mask).backward()
    assert grads_equal(grads_of(model), before)


# --- inputs and isolation -------------------------------------------------------------


def test_non_contiguous_inputs():
    model = make_model("plain")
    prompt, responses, advantages, mask = make_group(3, 20, 6)
    responses = responses.t().contiguous().t()  # same values, column-major
    mask = mask.t().contiguous().t()
    assert not responses.is_contiguous()
    args = (prompt, responses, advantages, mask)
    got = compiled_loss_and_grads(compile_loss(grpo_loss_f64, longstraw.Backend(prefix_chunk_size=8)), model, *args)
    want = eager_loss_and_grads(grpo_loss_f64, model, *args)
    assert_grads_close(got[1], want[1], 1e-9)


def test_two_compiled_losses_do_not_share_state():
    """A policy and a second model, each with its own compiled loss, called
    in turns with different groups: each matches its own eager gradients."""
    policy, other = make_model("plain", seed=0), make_model("plain", seed=1)
    policy_step = compile_loss(grpo_loss_f64, longstraw.Backend(prefix_chunk_size=8))
    other_step = compile_loss(grpo_loss_f64, longstraw.Backend(prompt_grad="detached", prefix_chunk_size=8))
    for seed in range(2):
        a, b = make_group(3, 25, 5, seed=seed), make_group(2, 17, 7, seed=seed + 10)
        got_policy = compiled_loss_and_grads(policy_step, policy, *a)
        got_other = compiled_loss_and_grads(other_step, other, *b)
        assert_grads_close(got_policy[1], eager_loss_and_grads(grpo_loss_f64, policy, *a)[1], 1e-9)
        assert_grads_close(got_other[1], detached_reference(other, *b, tail=TAILS[grpo_loss_f64])[1], 1e-9)


# --- compiles over changing shapes ---------------------------------------------------


def test_compiles_over_a_dozen_steps_with_changing_shapes():
    """Dynamo compiles the loss twice (the first shapes, then once with
    dynamic sizes); LongStraw plans once per new (G, P, R) signature of each
    compiled graph and reuses the plan when a signature comes back: the
    static first graph's plan, then one per distinct signature."""
    model = make_model("plain")
    compiles = []

    class Counting(longstraw.Backend):
        def __call__(self, gm, example_inputs, options=None):
            compiles.append(gm)
            return super().__call__(gm, example_inputs, options)

    backend = Counting(prefix_chunk_size=16, plan_cache_size=32)
    step = compile_loss(grpo_loss_f64, backend)
    shapes = [(3, 20 + 7 * (i % 3), 4 + (i % 2)) for i in range(12)]
    for i, (G, P, R) in enumerate(shapes):
        loss, grads = compiled_loss_and_grads(step, model, *make_group(G, P, R, seed=i))
        assert torch.isfinite(loss)
    assert len(compiles) == 2
    assert len(set(shapes)) == 6
    assert len(backend.plans) == 1 + 6


# --- per-row inputs that require grad ------------------------------------------------


def ppo_tail(logits, responses, advantages, old_logp, mask):
    """PPO's clipped objective against old log-probs: both per-row inputs
    are read by the loss, so both get gradients."""
    logp = torch.log_softmax(logits, -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)  # [G, R]
    ratio = torch.exp(logp - old_logp)
    per_token = -torch.minimum(ratio * advantages[:, None], ratio.clamp(0.8, 1.2) * advantages[:, None])
    return (per_token * mask).sum() / mask.sum()


def ppo_loss(model, prompt, responses, advantages, old_logp, mask):
    ids = torch.cat([prompt.expand(responses.shape[0], -1), responses], dim=1)
    logits = logits_of(model(input_ids=ids))[:, prompt.shape[0] - 1 : -1]
    return ppo_tail(logits, responses, advantages, old_logp, mask)


def detached_ppo_loss(model, prompt, responses, advantages, old_logp, mask):
    """The detached-mode contract for `ppo_loss` (see reference.detached_reference)."""
    return ppo_tail(detached_logits(model, prompt, responses), responses, advantages, old_logp, mask)


def ppo_group(model, G: int, P: int, R: int):
    """A group whose old log-probs are near the model's, so that some ratios
    are clipped and some are not; advantages and old log-probs require grad."""
    prompt, responses, advantages, mask = make_group(G, P, R, pad=True)
    with torch.no_grad():
        ids = torch.cat([prompt.expand(G, -1), responses], dim=1)
        logits = logits_of(model(input_ids=ids))[:, P - 1 : -1]
        logp = torch.log_softmax(logits, -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    old_logp = logp + 0.3 * torch.randn(G, R, generator=torch.Generator().manual_seed(1), dtype=logp.dtype)
    ratio = torch.exp(logp - old_logp)
    clipped = (ratio < 0.8) | (ratio > 1.2)
    assert clipped.any() and not clipped.all()
    return prompt, responses, advantages.requires_grad_(True), old_logp.requires_grad_(True), mask


def loss_and_input_grads(loss_fn, model, args, leaves):
    """(loss, parameter grads, grads of `leaves`) of one loss and backward,
    every .grad starting empty; the model's .grad is left as it was found."""
    for leaf in leaves:
        leaf.grad = None

    def run():
        loss = loss_fn(model, *args)
        loss.backward()
        return loss

    loss, grads = with_fresh_grads(model, run)
    return loss, grads, [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("mode,kind", [  # in CI each mode and each model once; `-m slow` the other two
    ("exact", "qwen3"), ("detached", "plain"),
    pytest.param("exact", "plain", marks=pytest.mark.slow), pytest.param("detached", "qwen3", marks=pytest.mark.slow),
])
def test_per_row_inputs_that_require_grad(kind, mode):
    """advantages [G] and old log-probs [G, R] requiring grad: eager's loss
    and their gradients in both modes (detached mode changes only what flows
    into the prompt state; the loss, and its gradient with respect to
    tail-only inputs, depend only on forward values, which are eager's).
    Parameter gradients: eager's in exact mode, the detached contract's in
    detached mode. Under no_grad the loss is eager's."""
    model, tol = make_model(kind), parity_tol(kind)
    args = ppo_group(model, 3, 13, 5)
    leaves = [args[2], args[3]]
    step = compile_loss(ppo_loss, longstraw.Backend(prompt_grad=mode, prefix_chunk_size=4))
    got = loss_and_input_grads(step, model, args, leaves)
    eager = loss_and_input_grads(ppo_loss, model, args, leaves)
    assert_close(got[0], eager[0], tol, "loss")
    for name, g, w in zip(["advantages", "old_logp"], got[2], eager[2]):
        assert g is not None and w is not None and w.abs().max() > 0, name
        assert_close(g, w, tol, f"{name}.grad")
    want = eager if mode == "exact" else loss_and_input_grads(detached_ppo_loss, model, args, leaves)
    assert_grads_close(got[1], want[1], tol)
    with torch.no_grad():
        loss = step(model, *args)
    assert not loss.requires_grad
    assert_close(loss, eager[0], tol, "loss under no_grad")


# --- verify_state ------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["exact", "detached"])
def test_verify_state_passes_a_correct_run(mode, monkeypatch):
    """Every capture write and every reverse-pass replay is checked, and the
    run is exact."""
    checked = []
    verify = StepContext._verify_write
    monkeypatch.setattr(
        StepContext, "_verify_write", lambda ctx, *a: checked.append(ctx.grad_enabled) or verify(ctx, *a)
    )
    model = make_model("plain")
    args = make_group(3, 13, 5)
    step = compile_loss(grpo_loss_f64, longstraw.Backend(prompt_grad=mode, prefix_chunk_size=4, verify_state=True))
    got = compiled_loss_and_grads(step, model, *args)
    if mode == "exact":
        want = eager_loss_and_grads(grpo_loss_f64, model, *args)
    else:
        want = detached_reference(model, *args, tail=grpo_tail)
    assert_close(got[0], want[0], 1e-9, "loss")
    assert_grads_close(got[1], want[1], 1e-9)
    slots = 2 * model.cfg.num_layers  # K and V per layer, 3 prompt chunks of 4 (P - 1 = 12 positions)
    assert checked.count(False) == 3 * slots
    assert checked.count(True) == (3 * slots if mode == "exact" else 0)


def _faulty_chunks(fault: str):
    """GroupRunner._chunks with the second chunk dropped ("gap") or starting
    one position early ("overlap"): a capture that misses or repeats positions."""
    chunks = GroupRunner._chunks

    def faulty(self, schedule):
        first, (offset, length), *rest = chunks(self, schedule)
        second = [] if fault == "gap" else [(offset - 1, length + 1)]
        return [first, *second, *rest]

    return faulty


LABEL = r"state slot \d+ \(causal_attention:\w+\) of `model\.blocks\.\d\.attn`"


@pytest.mark.parametrize(
    "fault, expected",
    [
        ("gap", rf"^verify_state: the prompt capture left positions of {LABEL} unwritten"),
        ("overlap", rf"^verify_state: the prompt capture wrote {LABEL}, positions \[3, 8\) twice"),
    ],
)
def test_verify_state_catches_a_bad_capture(fault, expected, monkeypatch):
    monkeypatch.setattr(GroupRunner, "_chunks", _faulty_chunks(fault))
    model = make_model("plain")
    before = seed_grads(model)
    step = compile_loss(grpo_loss_f64, longstraw.Backend(prefix_chunk_size=4, verify_state=True))
    with raises_longstraw(expected):
        step(model, *make_group(3, 13, 5)).backward()
    assert grads_equal(grads_of(model), before)


def test_verify_state_catches_a_replay_that_differs(monkeypatch):
    """A reverse-pass replay that recomputes a prompt chunk's state with other
    values than the capture (a non-deterministic step) is named, with the
    chunk; no .grad changes."""
    write = StepContext.write

    def drifting(ctx, slot, value):
        return write(ctx, slot, value + 1e-12 if ctx.grad_enabled else value)

    monkeypatch.setattr(StepContext, "write", drifting)
    model = make_model("plain")
    before = seed_grads(model)
    step = compile_loss(grpo_loss_f64, longstraw.Backend(prefix_chunk_size=4, verify_state=True))
    loss = step(model, *make_group(3, 13, 5))
    with raises_longstraw(
        rf"^verify_state: the reverse pass recomputed {LABEL}, positions \[8, 12\) with other values than the capture"
    ) as info:
        loss.backward()
    assert any("reverse pass over prompt chunk [8, 12)" in n for n in getattr(info.value, "__notes__", []))
    assert grads_equal(grads_of(model), before)


@pytest.mark.parametrize("grad", [True, False])
def test_exact_capture_keeps_nothing_for_a_backward_that_cannot_come(grad, monkeypatch):
    """Under no_grad (a reference model scored in the loss, an evaluation)
    exact mode keeps no chunk-boundary carries and no attention outputs
    for a reverse pass; with autograd on it keeps both, and the loss is the same."""
    from longstraw.runtime import prompt_state
    from longstraw.runtime import runner as runtime

    made: list[tuple[bool, bool]] = []
    original = prompt_state.PromptState.__init__

    def recorded(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append((self.boundaries, self.attention_outputs is not None))

    monkeypatch.setattr(runtime.PromptState, "__init__", recorded)
    model = make_model("qwen3")
    group = make_group(2, 24, 4)
    backend = longstraw.Backend(prompt_grad="exact", prefix_chunk_size=8, attention_outputs_on_host=True)
    compiled = compile_loss(grpo_loss_f64, backend)
    with torch.set_grad_enabled(grad):
        loss = compiled(model, *group)
    assert made == [(grad, grad)]
    assert loss.requires_grad == grad
    with torch.no_grad():
        assert_close(loss.detach(), grpo_loss_f64(model, *group), 1e-12, "loss")
