"""Compiled against eager on tiny float64 models (docs/architecture.md, "The
gradient contract").

Exact mode is compared with plain eager PyTorch, detached mode with
`reference.detached_reference`. Relative error per parameter,
||a - b|| / max(||b||, tiny): <= 1e-9 on the plain model, <= 1e-6 on HF
models (their norms and RoPE round through float32); tiny is 1e-6 times the
largest gradient norm, for gradients that are zero in exact arithmetic (see
`compare.assert_grads_close`).

The default run covers every value of every axis (G, P, R, chunk size,
model kind, mode); the full cartesian product is `slow` (`-m slow`). The
feature tests after it (other losses, frozen parameters, LoRA, repeated
calls, HF's training config) run each mode once in CI, the rest `slow`.
Note that the prefix the backend chunks has P-1 positions: chunk 13 with
P=300 divides it exactly (299 = 13 * 23), chunk 5 with P=7 leaves 5+1,
chunk 64 with P=64 is one partial chunk.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import longstraw

from helpers.compare import assert_close, assert_grads_close
from helpers.harness import compile_loss, compiled_loss_and_grads
from helpers.losses import coupled_loss, grpo_loss, grpo_loss_f64, logits_of, pg_loss, pg_tail
from helpers.parity import check_parity, expected
from helpers.reference import detached_reference, eager_loss_and_grads, grads_of
from helpers.tiny_models import KINDS, freeze_all_but_qkv_and_head, make_group, make_lora_qwen3, make_model, parity_tol

MODES = ("exact", "detached")
SLOW = pytest.mark.slow


def kinds_by_mode(*kinds: str) -> list:
    """(mode, kind) for every mode and kind: in CI the first kind in exact
    mode and the second in detached (each feature in both modes and on both
    models), the rest with `-m slow`."""
    return [pytest.param(mode, kind, marks=[] if kinds[MODES.index(mode)] == kind else [SLOW])
            for mode in MODES for kind in kinds]


# (kind, mode, G, P, R, chunk, pad): every axis value, every kind, both modes
DEFAULT_CASES = [
    ("plain", "exact", 2, 7, 9, 5, True),
    ("plain", "exact", 5, 300, 33, 13, True),
    ("plain", "exact", 1, 1, 1, 5, False),
    ("plain", "exact", 2, 64, 33, 64, False),
    ("plain", "detached", 5, 64, 9, 5, True),
    ("plain", "detached", 2, 300, 1, 64, False),
    ("plain", "detached", 1, 1, 9, 13, False),
    ("plain_repeat", "exact", 2, 64, 9, 13, True),
    ("plain_repeat", "detached", 2, 7, 9, 5, False),
    ("plain_repeat_interleave", "exact", 5, 7, 9, 5, False),
    ("plain_explicit_mask", "exact", 2, 64, 9, 5, True),
    ("plain_explicit_mask", "detached", 2, 7, 9, 13, False),
    ("plain_window_mask", "exact", 2, 64, 9, 13, False),
    ("plain_window_mask", "detached", 5, 300, 33, 64, True),
    ("plain_mha_layernorm", "exact", 2, 7, 33, 5, False),
    ("qwen3", "exact", 2, 64, 9, 13, True),
    ("qwen3", "exact", 1, 300, 9, 64, False),
    ("qwen3", "detached", 5, 7, 33, 5, True),
    ("llama", "exact", 5, 7, 1, 13, False),
    ("llama", "detached", 1, 64, 33, 64, False),
    ("llama_tied", "exact", 2, 64, 9, 5, True),
    ("llama_tied", "detached", 2, 1, 9, 13, False),
]


def _covers_every_axis_value():
    axes = list(zip(*DEFAULT_CASES))
    return (
        set(axes[0]) == set(KINDS)
        and set(axes[1]) == set(MODES)
        and set(axes[2]) == {1, 2, 5}
        and set(axes[3]) == {1, 7, 64, 300}
        and set(axes[4]) == {1, 9, 33}
        and set(axes[5]) == {5, 13, 64}
        and set(axes[6]) == {True, False}
    )


def test_default_cases_cover_every_axis_value():
    assert _covers_every_axis_value()


@pytest.mark.parametrize("kind,mode,G,P,R,chunk,pad", DEFAULT_CASES)
def test_parity(kind, mode, G, P, R, chunk, pad):
    check_parity(kind, mode, G, P, R, chunk, pad)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind,mode,G,P,R,chunk",
    list(itertools.product(KINDS, MODES, (1, 2, 5), (1, 7, 64, 300), (1, 9, 33), (5, 13, 64))),
)
def test_parity_full_product(kind, mode, G, P, R, chunk):
    check_parity(kind, mode, G, P, R, chunk, pad=R > 1)


@pytest.mark.parametrize("mode", MODES)
def test_default_chunk_size(mode):
    """No prefix_chunk_size: the whole prompt is one chunk."""
    model = make_model("plain")
    args = make_group(2, 64, 9, pad=True)
    backend = longstraw.Backend(prompt_grad=mode)
    got_loss, got = compiled_loss_and_grads(compile_loss(grpo_loss_f64, backend), model, *args)
    want_loss, want = expected(mode, grpo_loss_f64, model, *args)
    assert_close(got_loss, want_loss, 1e-9, "loss")
    assert_grads_close(got, want, 1e-9)


@pytest.mark.parametrize("mode", MODES)
def test_entry_point_with_options(mode):
    """backend="longstraw" by name, options as a dict."""
    model = make_model("plain")
    args = make_group(3, 7, 9, pad=True)
    options = {"prompt_grad": mode, "prefix_chunk_size": 5, "on_unsupported": "error"}
    got_loss, got = compiled_loss_and_grads(compile_loss(grpo_loss_f64, options), model, *args)
    want_loss, want = expected(mode, grpo_loss_f64, model, *args)
    assert_close(got_loss, want_loss, 1e-9, "loss")
    assert_grads_close(got, want, 1e-9)


@pytest.mark.parametrize("mode,kind", kinds_by_mode("qwen3", "plain"))
def test_value_dependent_loss(kind, mode):
    """Policy-gradient loss: the value depends on every log-prob, so a wrong
    forward (state, positions, masking) shows in the loss value."""
    check_parity(kind, mode, 3, 13, 9, 5, pad=True, loss_fn=pg_loss)


@pytest.mark.parametrize("kind,G,mode", [
    ("qwen3", 5, "exact"), ("plain", 5, "detached"), ("plain", 2, "exact"),
    *[pytest.param(kind, G, mode, marks=SLOW) for kind, G, mode in
      [("qwen3", 5, "detached"), ("plain", 5, "exact"), ("plain", 2, "detached")]],
])
def test_coupled_tail_stays_exact(kind, G, mode):
    """Branch log-probs standardised over the group inside the loss: the
    tail couples the branches non-linearly, so d(outputs) of one branch
    depends on every other branch's forward."""
    check_parity(kind, mode, G, 13, 9, 5, pad=True, loss_fn=coupled_loss)


def test_verbatim_issue_loss():
    """The loss from the issue as written (`.float()` logits): float32
    log-softmax limits agreement to ~1e-7."""
    model = make_model("qwen3")
    args = make_group(3, 13, 9, pad=True)
    backend = longstraw.Backend(prefix_chunk_size=5)
    got_loss, got = compiled_loss_and_grads(compile_loss(grpo_loss, backend), model, *args)
    want_loss, want = eager_loss_and_grads(grpo_loss, model, *args)
    assert_close(got_loss, want_loss, 1e-5, "loss")
    assert_grads_close(got, want, 1e-5)


@pytest.mark.parametrize("mode,kind", kinds_by_mode("qwen3", "plain"))
def test_frozen_parameters(kind, mode):
    model = make_model(kind)
    kept = freeze_all_but_qkv_and_head(model)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert kept and frozen
    check_parity(kind, mode, 3, 13, 9, 5, pad=True, model=model)
    # compiled run leaves no .grad on frozen parameters, even after backward
    compiled = compile_loss(grpo_loss_f64, longstraw.Backend(prompt_grad=mode, prefix_chunk_size=5))
    compiled(model, *make_group(3, 13, 9, pad=True)).backward()
    assert all(p.grad is None for p in frozen)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("mode", ["exact", pytest.param("detached", marks=SLOW)])
def test_lora(mode):
    """peft LoRA on q/k/v/o of Qwen3; base weights frozen."""
    model = make_lora_qwen3()
    frozen = [p for p in model.parameters() if not p.requires_grad]
    check_parity("qwen3", mode, 3, 13, 9, 5, pad=True, model=model)
    assert all(p.grad is None for p in frozen)


@pytest.mark.parametrize("mode,kind", kinds_by_mode("llama", "plain"))
def test_repeated_calls_accumulate(kind, mode):
    """Two calls, two backward()s, no zeroing, on top of an existing .grad:
    the same accumulated .grad as eager doing the same."""
    model = make_model(kind)
    group_a = make_group(3, 13, 9, pad=True, seed=1)
    group_b = make_group(3, 13, 9, pad=True, seed=2)  # same shapes: no recompile

    def run(step):
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.5)
        for group in (group_a, group_b):
            step(group).backward()
        out = grads_of(model)
        model.zero_grad(set_to_none=True)
        return out

    backend = longstraw.Backend(prompt_grad=mode, prefix_chunk_size=5)
    compiled = compile_loss(grpo_loss_f64, backend)
    got = run(lambda g: compiled(model, *g))
    if mode == "exact":
        want = run(lambda g: grpo_loss_f64(model, *g))
    else:
        start = {n: torch.full_like(p, 0.5) for n, p in model.named_parameters()}
        ref_a = detached_reference(model, *group_a)[1]
        ref_b = detached_reference(model, *group_b)[1]
        want = {n: start[n] + ref_a[n] + ref_b[n] for n in start}
    assert_grads_close(got, want, parity_tol(kind))
    assert len(backend.plans) == 1, "same shapes twice must not recompile"


@pytest.mark.parametrize("kind,dynamic", [
    ("qwen3", None), ("plain", True),
    pytest.param("plain", None, marks=pytest.mark.slow), pytest.param("qwen3", True, marks=pytest.mark.slow),
])
def test_new_shapes_recompile_and_stay_exact(kind, dynamic):
    """The same compiled loss over several (G, P, R): with dynamic=None the
    second shape makes Dynamo recompile with symbolic sizes (section 7)."""
    model = make_model(kind)
    compiled = compile_loss(grpo_loss_f64, longstraw.Backend(prefix_chunk_size=5), dynamic=dynamic)
    for G, P, R in [(2, 7, 9), (3, 12, 5), (2, 7, 9)]:
        args = make_group(G, P, R, pad=True, seed=P)
        got_loss, got = compiled_loss_and_grads(compiled, model, *args)
        want_loss, want = eager_loss_and_grads(grpo_loss_f64, model, *args)
        assert_close(got_loss, want_loss, parity_tol(kind), f"loss at G={G} P={P} R={R}")
        assert_grads_close(got, want, parity_tol(kind))


# --- other spellings of "the same prompt for every branch" --------------------


def _loss_from_ids(model, ids, P, responses, advantages, mask):
    logits = logits_of(model(input_ids=ids))[:, P - 1 : -1]
    return pg_tail(logits, responses, advantages, mask)


def loss_repeat(model, prompt, responses, advantages, mask):
    ids = torch.cat([prompt.unsqueeze(0).repeat(responses.shape[0], 1), responses], dim=1)
    return _loss_from_ids(model, ids, prompt.shape[0], responses, advantages, mask)


def loss_expand_sizes(model, prompt, responses, advantages, mask):
    ids = torch.cat([prompt[None, :].expand(responses.shape[0], prompt.shape[0]), responses], dim=-1)
    return _loss_from_ids(model, ids, prompt.shape[0], responses, advantages, mask)


def loss_pre_expanded(model, prompts, responses, advantages, mask):
    """`prompts` [G, P] arrives with identical rows (equal by value only)."""
    ids = torch.cat([prompts, responses], dim=1)
    return _loss_from_ids(model, ids, prompts.shape[1], responses, advantages, mask)


@pytest.mark.parametrize("loss_fn", [loss_repeat, loss_expand_sizes, loss_pre_expanded])
def test_prefix_spellings(loss_fn):
    model = make_model("plain")
    prompt, responses, advantages, mask = make_group(3, 13, 9, pad=True)
    first = prompt.expand(3, -1).clone() if loss_fn is loss_pre_expanded else prompt
    args = (first, responses, advantages, mask)
    backend = longstraw.Backend(prefix_chunk_size=5)
    got_loss, got = compiled_loss_and_grads(compile_loss(loss_fn, backend), model, *args)
    want_loss, want = eager_loss_and_grads(loss_fn, model, *args)
    assert_close(got_loss, want_loss, 1e-9, "loss")
    assert_grads_close(got, want, 1e-9)
    assert backend.plans[-1].prefix_len == 12


@pytest.mark.parametrize("mode,kind", kinds_by_mode("qwen3", "llama"))
def test_hf_training_config_without_cache(kind, mode):
    """`use_cache=False` (the usual training setting): HF then builds an
    explicit mask from a packed-sequence check (diff and cumsum over the
    positions, then indexing by position), which the attention pass rebuilds
    per block instead of the `is_causal` call."""
    model = make_model(kind)
    model.config.use_cache = False
    check_parity(kind, mode, 3, 23, 7, 5, pad=True, model=model)
