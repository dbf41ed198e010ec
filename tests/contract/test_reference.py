"""The eager references and fixtures are right (no backend needed).

The detached reference is checked against a second, independent
construction: the full eager loss with forward hooks that detach K and V at
prompt positions 0..P-2 in every layer.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers.compare import assert_close, assert_grads_close, rel_err
from helpers.losses import TAILS, grpo_loss_f64, logits_of
from helpers.plain_transformer import make_plain
from helpers.reference import detached_at_attention, detached_logits, detached_reference, eager_loss_and_grads, grads_of
from helpers.tiny_models import KINDS, PLAIN_KINDS, make_group, make_lora_qwen3, make_model

SHAPES = [(3, 7, 9, True), (1, 1, 5, False), (2, 64, 1, False), (5, 30, 33, True)]


@pytest.fixture(scope="module")
def models():
    return {kind: make_model(kind) for kind in KINDS}


def _full_logits(model, prompt, responses):
    ids = torch.cat([prompt.expand(responses.shape[0], -1), responses], dim=1)
    return logits_of(model(input_ids=ids))[:, prompt.shape[0] - 1 : -1]


def _detach_prompt_kv_hooks(model, P):
    """Forward hooks that cut the gradient of K (after the K norm, if any)
    and V at sequence positions < P-1. RoPE has no parameters, so this is
    'K and V after RoPE are constants at prompt positions 0..P-2'."""
    names = {n for n, _ in model.named_modules()}

    def hook(mod, inp, out):
        # out: [B, L, ...] with the sequence on dim 1
        return torch.cat([out[:, : P - 1].detach(), out[:, P - 1 :]], dim=1)

    handles = []
    for name, mod in model.named_modules():
        parent, _, leaf = name.rpartition(".")
        is_k = leaf == "k_norm" or (leaf == "k_proj" and f"{parent}.k_norm" not in names)
        if is_k or leaf == "v_proj":
            handles.append(mod.register_forward_hook(hook))
    n_layers = len([n for n in names if n.rpartition(".")[2] == "v_proj"])
    assert len(handles) == 2 * n_layers > 0
    return handles


@pytest.mark.parametrize("kind", sorted(PLAIN_KINDS))
@pytest.mark.parametrize("split", [1, 5, 12])
def test_plain_past_path_matches_full_forward(kind, split):
    model = make_plain(**PLAIN_KINDS[kind])
    ids = torch.randint(0, 64, (3, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids)
        _, kv = model.forward_with_kv(ids[:, :split])
        tail = model(ids[:, split:], past_kv=kv)
    assert_close(tail, full[:, split:], 1e-13, "logits after past")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("G,P,R,pad", SHAPES)
def test_detached_values_equal_full_values(models, kind, G, P, R, pad):
    """Detaching changes gradients only: logits and every loss value agree
    with the full eager computation."""
    model = models[kind]
    prompt, responses, advantages, mask = make_group(G, P, R, pad=pad)
    with torch.no_grad():
        assert_close(detached_logits(model, prompt, responses), _full_logits(model, prompt, responses), 1e-13)
    for loss_fn, tail in TAILS.items():
        want, _ = eager_loss_and_grads(loss_fn, model, prompt, responses, advantages, mask)
        got, _ = detached_reference(model, prompt, responses, advantages, mask, tail=tail)
        assert_close(got, want, 1e-13, loss_fn.__name__)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("G,P,R,pad", SHAPES)
def test_detached_reference_matches_hook_construction(models, kind, G, P, R, pad):
    model = models[kind]
    prompt, responses, advantages, mask = make_group(G, P, R, pad=pad)
    for loss_fn, tail in TAILS.items():
        got_loss, got = detached_reference(model, prompt, responses, advantages, mask, tail=tail)
        handles = _detach_prompt_kv_hooks(model, P)
        try:
            want_loss, want = eager_loss_and_grads(loss_fn, model, prompt, responses, advantages, mask)
        finally:
            for h in handles:
                h.remove()
        assert_close(got_loss, want_loss, 1e-13, loss_fn.__name__)
        assert_grads_close(got, want, 1e-12)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("G,P,R,pad", SHAPES)
def test_detached_at_attention_matches_the_cache_reference(models, kind, G, P, R, pad):
    """The third construction (keys and values detached where SDPA reads
    them), which the family suite uses for every SDPA model."""
    model = models[kind]
    group = make_group(G, P, R, pad=pad)
    want_loss, want = detached_reference(model, *group)
    got_loss, got = detached_at_attention(grpo_loss_f64, model, *group)
    assert_close(got_loss, want_loss, 1e-13)
    assert_grads_close(got, want, 1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_detached_gradient_differs_from_exact_iff_P_gt_1(models, kind):
    model = models[kind]
    for P in (1, 7):
        prompt, responses, advantages, mask = make_group(3, P, 9, pad=True)
        _, exact = eager_loss_and_grads(grpo_loss_f64, model, prompt, responses, advantages, mask)
        _, det = detached_reference(model, prompt, responses, advantages, mask)
        worst = max(rel_err(det[n], exact[n]) for n in exact)
        if P == 1:
            assert worst < 1e-13
        else:
            # the prompt-side term is a large part of the gradient
            assert worst > 0.1


def test_lora_reference():
    model = make_lora_qwen3()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    prompt, responses, advantages, mask = make_group(3, 7, 9, pad=True)
    _, exact = eager_loss_and_grads(grpo_loss_f64, model, prompt, responses, advantages, mask)
    _, det = detached_reference(model, prompt, responses, advantages, mask)
    assert exact.keys() == set(trainable)
    assert all(g is not None and g.norm() > 0 for g in exact.values())
    assert max(rel_err(det[n], exact[n]) for n in exact) > 0.1


def test_references_leave_grad_untouched(models):
    model = models["plain"]
    prompt, responses, advantages, mask = make_group(2, 7, 9)
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)
    before = grads_of(model)
    eager_loss_and_grads(grpo_loss_f64, model, prompt, responses, advantages, mask)
    detached_reference(model, prompt, responses, advantages, mask)
    after = grads_of(model)
    assert all(torch.equal(before[n], after[n]) for n in before)
    model.zero_grad(set_to_none=True)


class _DtypeRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.float_dtypes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.float_dtypes.add(t.dtype)
        return out


@pytest.mark.parametrize("kind", sorted(PLAIN_KINDS))
def test_plain_model_is_float64_throughout(models, kind):
    """No float32 up-casts anywhere, forward or backward, so 1e-9 parity is fair."""
    prompt, responses, advantages, mask = make_group(2, 7, 5)
    rec = _DtypeRecorder()
    with rec:
        eager_loss_and_grads(grpo_loss_f64, models[kind], prompt, responses, advantages, mask)
    assert rec.float_dtypes == {torch.float64}


def test_models_are_deterministic():
    for kind in KINDS:
        a, b = make_model(kind), make_model(kind)
        assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
        assert all(p.dtype == torch.float64 for p in a.parameters())
    assert not torch.equal(make_model("plain", seed=1).lm_head.weight, make_model("plain").lm_head.weight)


def test_llama_tied_shares_embedding():
    model = make_model("llama_tied")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.get_input_embeddings().weight.data_ptr() == model.get_output_embeddings().weight.data_ptr()


@pytest.mark.parametrize("G,P,R", [(1, 1, 1), (5, 300, 33), (4, 7, 9)])
def test_make_group(G, P, R):
    prompt, responses, advantages, mask = make_group(G, P, R, pad=True)
    assert prompt.shape == (P,) and prompt.dtype == torch.long
    assert responses.shape == (G, R) and responses.dtype == torch.long
    assert advantages.shape == (G,) and advantages.dtype == torch.float64
    assert mask.shape == (G, R) and mask.dtype == torch.float64
    assert (mask.sum(1) >= 1).all() and mask[0].all()
    # ragged: ones then zeros in every row
    assert torch.equal(mask, mask.cummin(dim=1).values)
    if G > 1 and R > 1:
        assert not mask.all()
    again = make_group(G, P, R, pad=True)
    assert all(torch.equal(x, y) for x, y in zip((prompt, responses, advantages, mask), again))
