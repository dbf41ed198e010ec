"""The backend object: fallback to eager, records, and the README's loss."""

from __future__ import annotations

import warnings

import pytest
import torch

import longstraw

from conftest import raises_longstraw
from helpers.compare import assert_close, assert_grads_close
from helpers.harness import compile_loss, compiled_loss_and_grads
from helpers.losses import grpo_loss_f64
from helpers.plain_transformer import make_plain
from helpers.reference import eager_loss_and_grads
from helpers.tiny_models import make_group, make_model


def test_on_unsupported_eager_runs_the_graph_unchanged():
    """A position-mixing operator no pass claims: warn once, run the graph
    as traced (same loss and gradients as eager), record no plan but a
    `Fallback` naming the operator."""
    model = make_plain(mixer="cumsum")
    backend = longstraw.Backend(on_unsupported="eager")
    compiled = compile_loss(grpo_loss_f64, backend)
    args = make_group(3, 9, 5, pad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got_loss, got = compiled_loss_and_grads(compiled, model, *args)
        compiled_loss_and_grads(compiled, model, *args)
    ours = [w for w in caught if "longstraw" in str(w.message)]
    assert len(ours) == 1 and "cumsum" in str(ours[0].message)
    want_loss, want = eager_loss_and_grads(grpo_loss_f64, model, *args)
    assert_close(got_loss, want_loss, 1e-12, "loss")
    assert_grads_close(got, want, 1e-12)
    assert len(backend.plans) == 0
    (fallback,) = backend.fallbacks  # one per signature, as the warning
    assert fallback.kind == "unsupported" and fallback.node == "cumsum" and "cumsum" in fallback.reason
    assert fallback.module is not None


def test_summary_names_regions_and_state():
    model = make_model("plain")
    backend = longstraw.Backend(prefix_chunk_size=5)
    compile_loss(grpo_loss_f64, backend)(model, *make_group(2, 12, 4)).backward()
    plan = backend.plans[-1]
    text = plan.summary()
    assert "G=2 sequences of 16 positions" in text
    assert "11 prompt positions captured" in text and "4 positions each" in text
    assert text.count("causal_attention") == len(plan.partition.slots) == 4
    assert plan.state_bytes_per_position == 2 * 2 * 2 * 8 * 8  # layers x (K, V) x heads x head_dim x float64
    assert plan.state_fixed_bytes == 0
    seconds = plan.seconds
    assert f"planned in {seconds.total:.3f} s: specialisation {seconds.specialize:.3f}, analysis" in text


def readme_loss(model, prompt_ids, response_ids, advantages, completion_mask):
    """The loss shown in README.md (logits_to_keep, float32 log-softmax)."""
    G, R = response_ids.shape
    input_ids = torch.cat([prompt_ids.expand(G, -1), response_ids], dim=1)
    logits = model(input_ids, logits_to_keep=R + 1).logits[:, :-1]
    logp = torch.log_softmax(logits.float(), dim=-1)
    logp = logp.gather(-1, response_ids.unsqueeze(-1)).squeeze(-1)
    per_token = -advantages[:, None] * torch.exp(logp - logp.detach())
    return (per_token * completion_mask).sum() / completion_mask.sum()


def test_readme_loss():
    model = make_model("qwen3")
    prompt, responses, advantages, mask = make_group(3, 20, 6, pad=True)
    args = (prompt[None], responses, advantages, mask)
    backend = longstraw.Backend(prefix_chunk_size=7)
    got_loss, got = compiled_loss_and_grads(compile_loss(readme_loss, backend), model, *args)
    want_loss, want = eager_loss_and_grads(readme_loss, model, *args)
    assert_close(got_loss, want_loss, 1e-5, "loss")
    assert_grads_close(got, want, 1e-5)
    assert backend.plans[-1].prefix_len == 19


@pytest.mark.parametrize("mode", ["exact", "detached"])
def test_every_call_past_dynamos_recompile_limit_raises(mode):
    """Past `recompile_limit` compiles Dynamo would run the loss eagerly
    without asking the backend (detached mode would silently get eager's
    exact gradient): every such call raises instead, naming the fix, while
    calls that match a compile keep running through LongStraw."""
    model = make_model("plain")

    def scaled_loss(model, scale, *group):  # a new Python string: a new Dynamo guard, a recompile
        return grpo_loss_f64(model, *group) * len(scale)

    backend = longstraw.Backend(prompt_grad=mode, prefix_chunk_size=8)
    compiled = compile_loss(scaled_loss, backend)
    group = make_group(2, 12, 3)
    what = "eager's exact gradient instead of the detached one" if mode == "detached" else "without LongStraw's memory"
    with torch._dynamo.config.patch(recompile_limit=2):
        compiled(model, "a", *group)
        compiled(model, "ab", *group)
        for _ in range(2):
            with raises_longstraw(
                rf"Dynamo has compiled `scaled_loss` \(test_backend\.py:\d+\) as often as torch\._dynamo\.config\."
                rf"recompile_limit \(2\) allows.*{what}.*LongStraw refuses that on every such call.*raise "
                r"torch\._dynamo\.config\.recompile_limit"
            ):
                compiled(model, "abc", *group)
        runner = backend.plans[-1].runner
        runner.last_call = None
        compiled(model, "ab", *group)  # guards a compile matches: LongStraw's plan runs, as before
        assert runner.last_call is not None


def test_dynamos_own_refusal_at_the_recompile_limit_is_left_to_it():
    model = make_model("plain")

    def scaled_loss(model, scale, *group):
        return grpo_loss_f64(model, *group) * len(scale)

    compiled = compile_loss(scaled_loss, longstraw.Backend(prefix_chunk_size=8))
    group = make_group(2, 12, 3)
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        compiled(model, "a", *group)
        with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
            compiled(model, "ab", *group)


def test_a_plan_records_where_planning_took_its_time():
    """`GroupPlan.seconds`: specialising, the analysis and the memory plan,
    separately (a benchmark reports them beside Dynamo's own compile time)."""
    model = make_model("plain")
    backend = longstraw.Backend(memory_budget_gb=100.0)
    compile_loss(grpo_loss_f64, backend)(model, *make_group(2, 12, 3)).backward()
    seconds = backend.plans[-1].seconds
    assert min(seconds.specialize, seconds.analysis, seconds.memory) > 0
    assert seconds.total == seconds.specialize + seconds.analysis + seconds.memory
