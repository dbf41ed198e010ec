"""Runtime behaviour visible to users (longstraw/runtime.py): progress bars,
replay determinism and RNG replay, failures in backward, state checks,
inputs, isolation, and compiles over changing shapes."""

from __future__ import annotations

import pytest
import torch

import longstraw
from compare import assert_grads_close, grads_equal
from conftest import raises_longstraw
from harness import compile_loss, compiled_loss_and_grads
from losses import TAILS, grpo_loss_f64
from plain_transformer import make_plain
from reference import detached_reference, eager_loss_and_grads, grads_of
from tiny_models import make_group, make_model


def seed_grads(model):
    """Every other parameter gets a .grad, the rest keep None."""
    for i, p in enumerate(model.parameters()):
        p.grad = torch.full_like(p, 0.25 * (i + 1)) if i % 2 == 0 else None
    return grads_of(model)


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


def test_compiles_over_twenty_steps_with_changing_shapes():
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
    shapes = [(3, 20 + 7 * (i % 5), 4 + (i % 3)) for i in range(20)]
    for i, (G, P, R) in enumerate(shapes):
        loss, grads = compiled_loss_and_grads(step, model, *make_group(G, P, R, seed=i))
        assert torch.isfinite(loss)
    assert len(compiles) == 2
    assert len(set(shapes)) == 15
    assert len(backend.plans) == 1 + 15
