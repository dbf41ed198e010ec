"""Planning per input signature (longstraw/trace/specialize.py, backend.py): a
value the plan folds is a key of the plan, a value it does not fold is
computed at every call, checkpointed regions are inlined, a loss that
builds its sequences twice has one prompt, and the plan cache is bounded.
Every call is compared with eager: never a silent wrong gradient."""

from __future__ import annotations

import itertools
import logging
import re
import warnings

import pytest
import torch
import torch.utils.checkpoint as checkpoint

import longstraw

from conftest import raises_longstraw
from helpers.compare import assert_close, assert_grads_close
from helpers.harness import compile_loss, compiled_loss_and_grads, count_live_states
from helpers.losses import grpo_loss_f64, grpo_tail, kl_tail, kl_to_reference_loss, logits_of, pg_tail, sequences
from helpers.reference import (
    detached_at_attention,
    detached_logits,
    detached_reference,
    eager_loss_and_grads,
    with_fresh_grads,
)
from helpers.tiny_models import make_group, make_model

PLAIN_TOL, HF_TOL = 1e-9, 1e-6


class Recording(longstraw.Backend):
    """Keeps the `CompiledGroupLoss` of every graph Dynamo hands over."""

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.compiled = []

    def __call__(self, gm, example_inputs, options=None):
        compiled = super().__call__(gm, example_inputs, options)
        self.compiled.append(compiled)
        return compiled


def assert_matches(got, want, tol):
    assert_close(got[0], want[0], tol, "loss")
    assert_grads_close(got[1], want[1], tol)


def token_logp(model, prompt, responses):
    """log p(response token) [G, R] of `[prompt; response_g]`."""
    ids = torch.cat([prompt.expand(responses.shape[0], -1), responses], dim=1)
    logits = logits_of(model(input_ids=ids))[:, prompt.shape[0] - 1 : -1]
    return torch.log_softmax(logits, -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)


def scalar(beta):
    """A Python float, or the value of a 0-d tensor argument (`.item()`)."""
    return beta.item() if isinstance(beta, torch.Tensor) else beta


# --- 1. Python scalars: a KL-coefficient schedule, an integer that shapes the loss -------------


def kl_scheduled_loss(model, prompt, responses, advantages, mask, beta: float):
    """Policy gradient + beta * a model-dependent penalty; `beta` changes every call."""
    beta = scalar(beta)
    logp = token_logp(model, prompt, responses)
    pg = -((logp * advantages[:, None]) * mask).sum() / mask.sum()
    return pg + beta * ((logp**2) * mask).sum() / mask.sum()


SCHEDULE = (0.1, 0.5, -0.3, 0.0, 0.5)


@pytest.mark.parametrize("dynamic", [None, True], ids=["default", "dynamic"])
def test_kl_coefficient_schedule(dynamic):
    model = make_model("plain")
    args = make_group(3, 13, 5)
    backend = longstraw.Backend(prefix_chunk_size=4)
    step = compile_loss(kl_scheduled_loss, backend, dynamic=dynamic)
    losses = []
    for beta in SCHEDULE:
        got = compiled_loss_and_grads(step, model, *args, beta)
        assert_matches(got, eager_loss_and_grads(kl_scheduled_loss, model, *args, beta), PLAIN_TOL)
        losses.append(got[0].item())
    assert len(set(losses)) == 4  # beta changes the loss: a stale beta would not match eager
    # the float is never folded, so one plan per Dynamo graph serves every beta: by default
    # Dynamo first compiles beta = 0.1 as a constant, then once more with beta as an input
    assert len(backend.plans) == (1 if dynamic else 2)


def temperature_loss(model, prompt, responses, advantages, mask, temperature: float):
    """A sampling temperature divides the logits: the float reaches the branch steps."""
    ids = torch.cat([prompt.expand(responses.shape[0], -1), responses], dim=1)
    logits = logits_of(model(input_ids=ids))[:, prompt.shape[0] - 1 : -1] / temperature
    return pg_tail(logits, responses, advantages, mask)


def embedding_scale_loss(model, prompt, responses, advantages, mask, scale: float):
    """The float scales the embeddings of a PlainTransformer: it reaches the prompt steps."""
    ids = torch.cat([prompt.expand(responses.shape[0], -1), responses], dim=1)
    x = model.embed(ids) * scale
    for block in model.blocks:
        x = block(x)[0]
    logits = model.lm_head(model.norm(x))[:, prompt.shape[0] - 1 : -1]
    return pg_tail(logits, responses, advantages, mask)


@pytest.mark.parametrize("mode,loss_fn", [  # CI: the prompt steps in both modes, the branch steps detached (exact:
    # test_scalar_schedule_through_every_region[branch-default-exact]); `-m slow` the branch steps exact
    pytest.param("exact", temperature_loss, id="exact-temperature_loss", marks=pytest.mark.slow),
    pytest.param("exact", embedding_scale_loss, id="exact-embedding_scale_loss"),
    pytest.param("detached", temperature_loss, id="detached-temperature_loss"),
    pytest.param("detached", embedding_scale_loss, id="detached-embedding_scale_loss"),
])
def test_float_inside_the_steps_changes_every_call(loss_fn, mode):
    model = make_model("plain")
    args = make_group(3, 13, 5, pad=True)
    backend = longstraw.Backend(prompt_grad=mode, prefix_chunk_size=4)
    step = compile_loss(loss_fn, backend, dynamic=True)
    for value in (0.7, 1.3, 0.9):
        got = compiled_loss_and_grads(step, model, *args, value)
        reference = eager_loss_and_grads if mode == "exact" else detached_at_attention
        want = reference(lambda m, *a: loss_fn(m, *a, value), model, *args)
        assert_matches(got, want, PLAIN_TOL)
    assert len(backend.plans) == 1


def head_scalar_loss(model, prompt, responses, advantages, mask, beta):
    """beta scales a per-token term: it lands in the branch step's LM head chunks."""
    logp = token_logp(model, prompt, responses)
    per_token = -advantages[:, None] * torch.exp(logp - logp.detach()) + beta * logp**2
    return (per_token * mask).sum() / mask.sum()


def branch_scalar_loss(model, prompt, responses, advantages, mask, beta):
    """beta enters a per-response mean: the branch step, after its head chunks."""
    logp = token_logp(model, prompt, responses)
    per_row = (logp * mask).sum(-1) / (mask.sum(-1) + beta)
    return -(torch.exp(per_row - per_row.detach()) * advantages).mean()


def prompt_scalar_loss(model, prompt, responses, advantages, mask, beta):
    """beta scales the input embeddings: the prompt's capture and every branch step."""
    ids = torch.cat([prompt.expand(responses.shape[0], -1), responses], dim=1)
    logits = logits_of(model(inputs_embeds=model.get_input_embeddings()(ids) * (1 + beta)))
    return pg_tail(logits[:, prompt.shape[0] - 1 : -1], responses, advantages, mask)


def stage_scalar_loss(reference):
    """beta is the temperature of a frozen reference's logits: the stage captured first."""

    def loss_fn(model, prompt, responses, advantages, mask, beta):
        p = prompt.shape[0]
        logits = logits_of(model(input_ids=sequences(prompt, responses)))[:, p - 1 : -1]
        with torch.no_grad():
            ref_logits = logits_of(reference(input_ids=sequences(prompt, responses)))[:, p - 1 : -1] / (1 + beta)
        return kl_tail(logits, ref_logits, responses, advantages, mask)

    return loss_fn


SCALAR_REGIONS = {
    "head": lambda ref: head_scalar_loss,
    "tail": lambda ref: kl_scheduled_loss,
    "branch": lambda ref: branch_scalar_loss,
    "prompt": lambda ref: prompt_scalar_loss,
    "stage": stage_scalar_loss,
}
SCALAR_TRACES = {  # how Dynamo hands the float over
    "default": ({}, None),  # a constant, then `beta.item()` of an input once it changed (automatic dynamic)
    "specialize_float": ({"specialize_float": True}, None),  # a constant, recompiled per value
    "dynamic": ({}, True),  # `beta.item()` from the first call
}


# CI: the head in both modes, the `specialize_float` trace, the branch and the stage; the tail, the prompt steps and
# the `dynamic` trace are CI's in the tests above (test_kl_coefficient_schedule, test_float_inside_the_steps_...)
SCALAR_CI = [
    ("head", "default", "detached"), ("head", "specialize_float", "exact"), ("branch", "default", "exact"),
    ("stage", "default", "exact"),
]


@pytest.mark.parametrize("region, trace, mode", [*SCALAR_CI, *[
    pytest.param(*case, marks=pytest.mark.slow)
    for case in itertools.product(SCALAR_REGIONS, SCALAR_TRACES, ("exact", "detached")) if case not in SCALAR_CI
]])
def test_scalar_schedule_through_every_region(region, trace, mode):
    """A float that changes every call (a KL or entropy coefficient
    schedule, a temperature) wherever it enters the plan: each call equals
    eager at that value, in both modes and however Dynamo traces the float."""
    policy, reference = make_model("qwen3", seed=0), make_model("qwen3", seed=1)
    reference.requires_grad_(False)
    loss_fn = SCALAR_REGIONS[region](reference)
    args = make_group(3, 13, 5, pad=True)
    config, dynamic = SCALAR_TRACES[trace]
    backend = longstraw.Backend(prompt_grad=mode, prefix_chunk_size=4, head_chunk_size=2)
    with torch._dynamo.config.patch(**config):
        step = compile_loss(loss_fn, backend, dynamic=dynamic)
        for beta in (0.1, 0.5, -0.3):
            got = compiled_loss_and_grads(step, policy, *args, beta)
            if mode == "exact":
                want = eager_loss_and_grads(loss_fn, policy, *args, beta)
            else:
                want = detached_at_attention(lambda m, *a: loss_fn(m, *a, beta), policy, *args)
            assert_matches(got, want, HF_TOL)
    assert all(plan.runner.options.head_chunk_size == 2 for plan in backend.plans)


def first_tokens_loss(model, prompt, responses, advantages, mask, n):
    """Only the first `n` response tokens count: `n` shapes the tail."""
    logp = token_logp(model, prompt, responses)
    n = scalar(n)
    return -((logp[:, :n] * advantages[:, None]) * mask[:, :n]).sum() / mask[:, :n].sum()


@pytest.mark.parametrize("dynamic", [None, True], ids=["default", "dynamic"])
def test_integer_argument_that_shapes_the_loss_replans(dynamic):
    """A Python int is part of the signature: each value gets its plan, a
    value seen before reuses it."""
    model = make_model("plain")
    args = make_group(3, 13, 5)
    backend = Recording(prefix_chunk_size=4)
    step = compile_loss(first_tokens_loss, backend, dynamic=dynamic)
    planned = []
    for n in (2, 4, 3, 4):
        got = compiled_loss_and_grads(step, model, *args, n)
        assert_matches(got, eager_loss_and_grads(first_tokens_loss, model, *args, n), PLAIN_TOL)
        planned.append(len(backend.plans))
    assert planned == [1, 2, 3, 3]  # n = 4 again: the cached plan
    # the default compile starts static (n = 2 baked in), then Dynamo makes n dynamic
    assert len(backend.compiled) == (1 if dynamic else 2)


# --- 2. `.item()` ------------------------------------------------------------------------------


@pytest.mark.parametrize("capture", [False, True], ids=["graph-break", "capture_scalar_outputs"])
def test_item_of_a_tensor_argument_follows_its_value(capture):
    """`beta_tensor.item()`: without capture_scalar_outputs Dynamo breaks the
    graph before anything is traced and hands the float on; with it the graph
    keeps the `.item()` node, which LongStraw leaves unfolded (one plan)."""
    model = make_model("plain")
    args = make_group(3, 13, 5)
    with torch._dynamo.config.patch(capture_scalar_outputs=capture):
        backend = longstraw.Backend(prefix_chunk_size=4)
        step = compile_loss(kl_scheduled_loss, backend)
        for beta in SCHEDULE:
            beta = torch.tensor(beta, dtype=torch.float64)
            got = compiled_loss_and_grads(step, model, *args, beta)
            assert_matches(got, eager_loss_and_grads(kl_scheduled_loss, model, *args, beta), PLAIN_TOL)
    if capture:
        assert len(backend.plans) == 1


def kl_as_weights_loss(model, prompt, responses, advantages, mask, beta):
    """beta reaches the loss through `full_like`, not an elementwise
    operator: the plan folds it and is keyed on the argument's value."""
    logp = token_logp(model, prompt, responses)
    weights = torch.full_like(mask, scalar(beta))
    return -((logp * advantages[:, None]) * mask).sum() / mask.sum() + (weights * logp * mask).sum()


@pytest.mark.parametrize("loss_fn, argument, values", [
    (kl_as_weights_loss, "l_beta_", (0.1, -0.3, 0.1, 0.7)),
    (first_tokens_loss, "l_n_", (2, 4, 2, 3)),  # not 5 = R: Dynamo guards n < R itself
], ids=["float through full_like", "int as a slice bound"])
def test_folded_item_is_guarded_on_the_value(loss_fn, argument, values):
    model = make_model("plain")
    args = make_group(3, 13, 5)
    dtype = torch.float64 if isinstance(values[0], float) else torch.int64
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        backend = Recording(prefix_chunk_size=4)
        step = compile_loss(loss_fn, backend)
        planned = []
        for v in values:
            v = torch.tensor(v, dtype=dtype)
            got = compiled_loss_and_grads(step, model, *args, v)
            assert_matches(got, eager_loss_and_grads(loss_fn, model, *args, v), PLAIN_TOL)
            planned.append(len(backend.plans))
    (compiled,) = backend.compiled  # one Dynamo graph: the values are LongStraw's keys
    names = [p.name for p in compiled.gm.graph.find_nodes(op="placeholder")]
    assert list(compiled.guarded.values()) == [(names.index(argument),)]
    assert planned == [1, 2, 2, 3]  # the first value again: its cached plan


def self_scaled_loss(model, prompt, responses, advantages, mask):
    ids = torch.cat([prompt.expand(responses.shape[0], -1), responses], dim=1)
    logits = logits_of(model(input_ids=ids))[:, prompt.shape[0] - 1 : -1]
    scale = logits.detach().abs().amax().item()  # a value the loss computes
    return pg_tail(logits / scale, responses, advantages, mask)


def test_item_of_a_computed_tensor_is_refused():
    model = make_model("plain")
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        with raises_longstraw(
            r"operator `item` \(node `\w+`\) at .*test_specialize\.py:\d+ \(self_scaled_loss\) reads a value "
            r"computed inside the loss \(`\.item\(\)` of a tensor the loss computes.*the plan cannot depend on it\. "
            r"Keep it a tensor"
        ):
            compile_loss(self_scaled_loss, longstraw.Backend(prefix_chunk_size=4))(model, *make_group(2, 9, 4))


def late_beta_loss(model, prompt, responses, advantages, mask, beta):
    """`beta.item()` after the model: without capture_scalar_outputs the graph breaks mid-loss."""
    logp = token_logp(model, prompt, responses)
    return -((logp * advantages[:, None]) * mask).sum() / mask.sum() + beta.item() * logp.sum()


@pytest.mark.parametrize("loss_fn, extra", [(self_scaled_loss, ()), (late_beta_loss, (torch.tensor(0.5),))],
                         ids=["computed", "argument"])
def test_item_after_the_model_without_capture_names_the_graph_break(loss_fn, extra):
    model = make_model("plain")
    with raises_longstraw(
        rf"Dynamo broke the graph at test_specialize\.py:\d+ \({loss_fn.__name__}\): Unsupported Tensor\.item\(\) "
        r"call with capture_scalar_outputs=False.*LongStraw needs the whole loss in one graph"
    ):
        compile_loss(loss_fn, longstraw.Backend(prefix_chunk_size=4))(model, *make_group(2, 9, 4), *extra)


# --- 3. checkpointing ------------------------------------------------------------------------


def checkpointed_loss(use_reentrant: bool):
    """Every block of a PlainTransformer under torch.utils.checkpoint."""

    def loss_fn(model, prompt, responses, advantages, mask):
        ids = torch.cat([prompt.expand(responses.shape[0], -1), responses], dim=1)
        x = model.embed(ids)
        for block in model.blocks:
            x = checkpoint.checkpoint(lambda h, block=block: block(h)[0], x, use_reentrant=use_reentrant)
        logits = model.lm_head(model.norm(x))[:, prompt.shape[0] - 1 : -1]
        return pg_tail(logits, responses, advantages, mask)

    return loss_fn


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("mode", ["exact", "detached"])
def test_torch_checkpoint_inside_the_loss(mode, use_reentrant):
    """Both spellings trace to a `tag_activation_checkpoint` region, inlined."""
    model = make_model("plain")
    args = make_group(3, 13, 5, pad=True)
    loss_fn = checkpointed_loss(use_reentrant)
    got = compiled_loss_and_grads(compile_loss(loss_fn, longstraw.Backend(prompt_grad=mode, prefix_chunk_size=4)),
                                  model, *args)
    if mode == "exact":
        want = eager_loss_and_grads(loss_fn, model, *args)
    else:
        want = detached_reference(model, *args, tail=pg_tail)
    assert_matches(got, want, PLAIN_TOL)


def hf_checkpointed(use_reentrant: bool = False):
    model = make_model("qwen3")
    assert model.config.attention_dropout == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5 renames it activation_checkpointing_enable
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    model.train()
    return model


@pytest.mark.parametrize("mode", ["exact", "detached"])
def test_hf_gradient_checkpointing(mode):
    """`gradient_checkpointing_enable()` with the default config: HF logs
    that `use_cache=True` is incompatible with checkpointing (`warning_once`)
    in every training forward, which LongStraw makes a no-op in traces."""
    model = hf_checkpointed()
    assert model.config.use_cache
    args = make_group(3, 13, 5, pad=True)
    got = compiled_loss_and_grads(compile_loss(grpo_loss_f64, longstraw.Backend(prompt_grad=mode, prefix_chunk_size=4)),
                                  model, *args)
    if mode == "exact":
        want = eager_loss_and_grads(grpo_loss_f64, model, *args)
    else:
        # HF refuses a cache while checkpointing in training; dropout is 0, so eval computes the same
        model.eval()
        want = detached_reference(model, *args, tail=grpo_tail)
    assert_matches(got, want, HF_TOL)


def test_hf_reentrant_gradient_checkpointing():
    model = hf_checkpointed(use_reentrant=True)
    model.config.use_cache = False
    args = make_group(3, 13, 5, pad=True)
    got = compiled_loss_and_grads(compile_loss(grpo_loss_f64, longstraw.Backend(prefix_chunk_size=4)), model, *args)
    assert_matches(got, eager_loss_and_grads(grpo_loss_f64, model, *args), HF_TOL)


LOSS_LOG = logging.getLogger("tests.loss")


def logging_loss(model, prompt, responses, advantages, mask):
    """A user's own logger call between the model and the loss's reduction."""
    logits = logits_of(model(input_ids=sequences(prompt, responses)))[:, prompt.shape[0] - 1 : -1]
    LOSS_LOG.info("scoring %d responses", responses.shape[0])
    return grpo_tail(logits, responses, advantages, mask)


def test_a_logging_call_in_the_loss_names_the_logger_and_the_advice_works():
    model = make_model("qwen3")
    args = make_group(2, 9, 4)
    with raises_longstraw(
        r"Dynamo broke the graph at test_specialize\.py:\d+ \(logging_loss\): a logging call, "
        r"`logging\.getLogger\('tests\.loss'\)\.info\(\.\.\.\)`, which Dynamo does not trace\. Make it a no-op in "
        r"traces before the first call, `torch\._dynamo\.config\.ignore_logging_functions\.add\("
        r"logging\.getLogger\('tests\.loss'\)\.info\)`"
    ):
        compile_loss(logging_loss, longstraw.Backend(prefix_chunk_size=4))(model, *args)
    torch._dynamo.reset()
    ignored = {*torch._dynamo.config.ignore_logging_functions, logging.getLogger("tests.loss").info}
    with torch._dynamo.config.patch(ignore_logging_functions=ignored):
        got = compiled_loss_and_grads(compile_loss(logging_loss, longstraw.Backend(prefix_chunk_size=4)), model, *args)
    assert_matches(got, eager_loss_and_grads(logging_loss, model, *args), HF_TOL)


# --- 4. sequences built twice: policy and frozen reference ----------------------------------


@pytest.mark.parametrize("mode,kind", [  # in CI each mode once, each kind once; `-m slow` the other two
    ("exact", "qwen3"), ("detached", "plain"),
    pytest.param("exact", "plain", marks=pytest.mark.slow), pytest.param("detached", "qwen3", marks=pytest.mark.slow),
])
def test_policy_and_frozen_reference_build_the_sequences_twice(kind, mode):
    policy, reference = make_model(kind, seed=0), make_model(kind, seed=1)
    reference.requires_grad_(False)
    args = make_group(3, 13, 5, pad=True)
    loss_fn = kl_to_reference_loss(reference)
    backend = longstraw.Backend(prompt_grad=mode, prefix_chunk_size=4)
    got = compiled_loss_and_grads(compile_loss(loss_fn, backend), policy, *args)
    if mode == "exact":
        want = eager_loss_and_grads(loss_fn, policy, *args)
    else:
        def run():
            with torch.no_grad():
                ref_logits = detached_logits(reference, *args[:2])
            loss = kl_tail(detached_logits(policy, *args[:2]), ref_logits, *args[1:])
            loss.backward()
            return loss

        want = with_fresh_grads(policy, run)
    assert_matches(got, want, PLAIN_TOL if kind == "plain" else HF_TOL)
    plan = backend.plans[-1]
    assert plan.prefix_len == 12
    assert len(plan.partition.slots) == 2 * 2 * 2  # K and V of both models' two layers: one shared prompt


@pytest.mark.parametrize("mode", ["exact", pytest.param("detached", marks=pytest.mark.slow)])
def test_frozen_reference_state_is_freed_before_the_policy_is_captured(mode, monkeypatch):
    """The reference's prompt is captured, its branches scored and its state
    freed before the policy's capture: two states are never live together,
    and each holds only its own model's slots."""
    policy, reference = make_model("qwen3", seed=0), make_model("qwen3", seed=1)
    reference.requires_grad_(False)
    args = make_group(3, 13, 5, pad=True)
    loss_fn = kl_to_reference_loss(reference)
    states = count_live_states(monkeypatch)
    backend = longstraw.Backend(prompt_grad=mode, prefix_chunk_size=4)
    got = compiled_loss_and_grads(compile_loss(loss_fn, backend), policy, *args)
    assert states.peak == 1 and states.slots == [4, 4]  # K and V of one model's two layers each
    stages = backend.plans[-1].runner.stages
    assert [len(s.slots) for s in stages] == [4, 4] and [len(s.outputs) for s in stages] == [0, 1]
    assert stages[0].hands and stages[1].handed == frozenset(stages[0].hands)  # the reference's per-token values
    want = eager_loss_and_grads(loss_fn, policy, *args) if mode == "exact" else None
    if want is not None:
        assert_matches(got, want, HF_TOL)


def test_one_model_with_and_without_grad():
    """The same model twice on the same ids, once under no_grad: the two
    logits must not be merged (one has no gradient)."""

    def loss_fn(model, prompt, responses, advantages, mask):
        p = prompt.shape[0]
        logits = logits_of(model(input_ids=sequences(prompt, responses)))[:, p - 1 : -1]
        with torch.no_grad():
            old_logits = logits_of(model(input_ids=sequences(prompt, responses)))[:, p - 1 : -1]
        return kl_tail(logits, 1.5 * old_logits, responses, advantages, mask)

    model = make_model("plain")
    args = make_group(3, 13, 5)
    got = compiled_loss_and_grads(compile_loss(loss_fn, longstraw.Backend(prefix_chunk_size=4)), model, *args)
    assert_matches(got, eager_loss_and_grads(loss_fn, model, *args), PLAIN_TOL)


# --- 5. the plan cache -------------------------------------------------------------------------


def test_plan_cache_keeps_the_most_recent_plans():
    model = make_model("plain")
    backend = Recording(prefix_chunk_size=4, plan_cache_size=2)
    step = compile_loss(grpo_loss_f64, backend, dynamic=True)
    prompt_lengths = (9, 13, 6, 11)
    R = 4

    def call(P):
        args = make_group(2, P, R, seed=P)
        got = compiled_loss_and_grads(step, model, *args)
        assert_matches(got, eager_loss_and_grads(grpo_loss_f64, model, *args), PLAIN_TOL)

    first = []
    for P in prompt_lengths:
        call(P)
        (compiled,) = backend.compiled
        assert len(compiled.plans) <= 2 and len(backend.plans) <= 2
        first.append(backend.plans[-1])
    assert [plan.seq_len for plan in compiled.plans.values()] == [6 + R, 11 + R]
    kept = dict(compiled.plans)
    call(11)  # the most recent: reused
    assert dict(compiled.plans) == kept
    call(9)  # evicted: planned again, and 6, now the least recent, drops out
    assert [plan.seq_len for plan in compiled.plans.values()] == [11 + R, 9 + R]
    assert backend.plans[-1].seq_len == 9 + R and backend.plans[-1] is not first[0]


@pytest.mark.parametrize("size", [0, -1, 1.5, "2", None])
def test_invalid_plan_cache_size(size):
    with raises_longstraw(re.escape(f"plan_cache_size must be a positive int, got {size!r}")):
        longstraw.Backend(plan_cache_size=size)


@pytest.mark.parametrize("name", ["gpt2", "falcon"])
def test_a_shape_used_whole_is_folded_under_dynamic_shapes(name):
    """Traced with dynamic sizes (as the TRL and verl integrations compile),
    a shape read whole is a node whose value is a tuple: GPT-2's Conv1D views
    its output as `x.size()[:-1] + (nf,)`, Falcon broadcasts K and V to
    `query.shape`. Folded like the integers in it, the steps get the sizes of
    each step (unfolded, GPT-2's step viewed its output as `(1,)` and Falcon's
    `size` was refused as dropping the sequence axis)."""
    from helpers.families import FAMILIES
    from helpers.padding import padded_group, scored_grpo_loss

    model = FAMILIES[name].build()
    group = padded_group(3, 9, 4, left=0, lengths=[3, 4, 4])  # a completion one token shorter
    backend = longstraw.Backend(prefix_chunk_size=4, verify_state=True)
    compiled = torch.compile(scored_grpo_loss, backend=backend, dynamic=True)
    got_loss, got = compiled_loss_and_grads(compiled, model, *group, 1.0)
    want_loss, want = compiled_loss_and_grads(scored_grpo_loss, model, *group, 1.0)
    assert_close(got_loss, want_loss, 1e-10, "loss")
    assert_grads_close(got, want, 1e-10)
    assert len(backend.plans) == 1
