"""Eager references the compiled losses are compared against.

- `eager_loss_and_grads`: the exact-mode reference, plain eager PyTorch.
- `detached_reference`: the detached-mode contract (docs/architecture.md,
  "The gradient contract"): the state at prompt positions 0..P-2 (K and V
  after RoPE) is computed under `no_grad` and is a constant; the last prompt
  token opens every branch, so a branch has exactly R input positions
  P-1..P+R-2 and runs with grad.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

import torch
from torch import nn

from helpers.losses import grpo_tail
from helpers.plain_transformer import PlainTransformer


def trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def grads_of(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """name -> clone of .grad (None stays None) for every trainable parameter."""
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in trainable(model).items()}


def seed_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """Every other parameter gets a `.grad`, the rest keep None; returns
    `grads_of(model)`, for checking that a refused call left `.grad` alone."""
    for i, p in enumerate(model.parameters()):
        p.grad = torch.full_like(p, 0.25 * (i + 1)) if i % 2 == 0 else None
    return grads_of(model)


def with_fresh_grads(model: nn.Module, run: Callable[[], torch.Tensor]):
    """Run `run()` (which calls backward) from empty .grad, return (loss,
    grads) and put the model's previous .grad back."""
    params = trainable(model)
    saved = {n: p.grad for n, p in params.items()}
    for p in params.values():
        p.grad = None
    try:
        loss = run()
        return loss.detach(), grads_of(model)
    finally:
        for n, p in params.items():
            p.grad = saved[n]


def eager_loss_and_grads(loss_fn, model, *args):
    """Plain eager loss and name -> grad clone for trainable parameters.

    The model's .grad is left as it was found.
    """

    def run():
        loss = loss_fn(model, *args)
        loss.backward()
        return loss

    return with_fresh_grads(model, run)


def branch_inputs(prompt, responses):
    """[prompt[-1], responses[:, :-1]] -> [G, R]: the R input positions of a
    branch (positions P-1..P+R-2)."""
    g = responses.shape[0]
    return torch.cat([prompt[-1:].expand(g, 1), responses[:, :-1]], dim=1)


def detached_logits(model, prompt, responses):
    """Logits [G, R, V] at positions P-1..P+R-2, with the prompt state
    (positions 0..P-2) computed under no_grad and shared by all branches.

    HF models: `past_key_values` of `prompt[:-1]` (a DynamicCache), repeated
    G times along the batch; positions continue from P-1 because HF derives
    them from the cache length. `PlainTransformer`: its `past_kv` path.
    P == 1 means no past at all.
    """
    g, p = responses.shape[0], prompt.shape[0]
    ids = branch_inputs(prompt, responses)  # [G, R]
    if isinstance(model, PlainTransformer):
        past = None
        if p > 1:
            with torch.no_grad():
                _, kv = model.forward_with_kv(prompt[None, :-1])
            past = [(k.expand(g, -1, -1, -1), v.expand(g, -1, -1, -1)) for k, v in kv]
        return model(ids, past_kv=past)
    if p == 1:
        return model(input_ids=ids).logits
    with torch.no_grad():
        cache = model(input_ids=prompt[None, :-1], use_cache=True).past_key_values
    # DynamicCache.batch_repeat_interleave is in place (per layer
    # repeat_interleave on dim 0); the cache is fresh, nothing else sees it.
    cache.batch_repeat_interleave(g)
    return model(input_ids=ids, past_key_values=cache, use_cache=True).logits


def detached_reference(model, prompt, responses, advantages, mask, tail=grpo_tail):
    """Detached-mode reference: (loss, name -> grad) for `tail` applied to
    `detached_logits`. `tail(logits, responses, advantages, mask)` is the
    loss after the model (see `losses.TAILS`).
    """

    def run():
        loss = tail(detached_logits(model, prompt, responses), responses, advantages, mask)
        loss.backward()
        return loss

    return with_fresh_grads(model, run)


@contextlib.contextmanager
def prompt_state_detached(prompt_len: int) -> Iterator[None]:
    """Inside, every `F.scaled_dot_product_attention` sees its keys and values
    at positions 0..P-2 detached: the detached contract stated at the
    attention, where LongStraw captures state, whatever a model's cache holds.
    (HF DeepSeek-V3 caches the latents before `kv_b_proj` and expands the
    cached prompt again in every step, so its cache path gives `kv_b_proj` a
    gradient through the prompt that this contract does not.)"""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    cut = prompt_len - 1

    def detached_prefix(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x[..., :cut, :].detach(), x[..., cut:, :]], dim=-2)

    def patched(q, k, v, *args, **kwargs):
        return sdpa(q, detached_prefix(k), detached_prefix(v), *args, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = patched
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa


@contextlib.contextmanager
def eager_attention_state_detached(module, prompt_len: int) -> Iterator[None]:
    """`prompt_state_detached` for a model whose attention is its modeling
    `module`'s `eager_attention_forward` (HF's eager sink attention, which
    calls no SDPA): its keys and values at positions 0..P-2 detached."""
    eager = module.eager_attention_forward
    cut = prompt_len - 1

    def detached_prefix(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x[..., :cut, :].detach(), x[..., cut:, :]], dim=-2)

    def patched(attention, query, key, value, *args, **kwargs):
        return eager(attention, query, detached_prefix(key), detached_prefix(value), *args, **kwargs)

    module.eager_attention_forward = patched
    try:
        yield
    finally:
        module.eager_attention_forward = eager


def detached_at_eager_attention(loss_fn, model, prompt, responses, advantages, mask):
    """`detached_at_attention` for a model whose attention is its modeling
    module's `eager_attention_forward` (gpt-oss, MiMo-V2-Flash)."""
    module = sys.modules[type(model).__module__]
    with eager_attention_state_detached(module, prompt.shape[0]):
        return eager_loss_and_grads(loss_fn, model, prompt, responses, advantages, mask)


@contextlib.contextmanager
def selective_scan_state_detached(module, prompt_len: int) -> Iterator[None]:
    """The detached contract for a Mamba-1 mixer (`module`: its HF modeling
    module): the state at position P-2 is a constant for the positions after
    it, both the scan's (its recurrence written out, a position at a time,
    the state detached there) and the convolution's (each later output reads
    the inputs at positions 0..P-2 detached)."""
    conv, cut = module.causal_conv1d_fn, prompt_len - 1

    def detached_conv(hidden_states, weight, bias=None, activation=None, **kwargs):
        out = conv(hidden_states, weight, bias, activation)
        cut_inputs = torch.cat([hidden_states[..., :cut].detach(), hidden_states[..., cut:]], dim=-1)
        return torch.cat([out[..., :cut], conv(cut_inputs, weight, bias, activation)[..., cut:]], dim=-1)

    def detached_scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                      return_last_state=False, **kwargs):
        if delta_bias is not None:
            dt = dt + delta_bias.to(dt.dtype)[..., None]
        if delta_softplus:
            dt = torch.nn.functional.softplus(dt)
        compute = torch.promote_types(torch.promote_types(hidden_states.dtype, torch.float32), dt.dtype)
        u, dt, A, B, C = (t.to(compute) for t in (hidden_states, dt, A, B, C))
        state = u.new_zeros(u.shape[0], u.shape[1], A.shape[-1])  # [b, d, n]
        outs = []
        for t in range(u.shape[-1]):
            if t == cut:
                state = state.detach()
            state = torch.exp(A * dt[:, :, t, None]) * state + (dt[:, :, t] * u[:, :, t])[..., None] * B[:, None, :, t]
            outs.append((state * C[:, None, :, t]).sum(-1))
        out = torch.stack(outs, dim=-1)
        if D is not None:
            out = out + hidden_states * D[None, :, None]
        if z is not None:
            out = out * torch.nn.functional.silu(z)
        return (out, state) if return_last_state else out

    scan = module.mamba_selective_scan
    module.causal_conv1d_fn, module.mamba_selective_scan = detached_conv, detached_scan
    try:
        yield
    finally:
        module.causal_conv1d_fn, module.mamba_selective_scan = conv, scan


def detached_at_selective_scan(loss_fn, model, prompt, responses, advantages, mask):
    """Detached-mode reference for a model of Mamba-1 mixers (and SDPA
    attention layers, Jamba): the state at the prompt's end constant in both."""
    module = sys.modules[type(model).__module__]
    with selective_scan_state_detached(module, prompt.shape[0]), prompt_state_detached(prompt.shape[0]):
        return eager_loss_and_grads(loss_fn, model, prompt, responses, advantages, mask)


def detached_at_attention(loss_fn, model, prompt, responses, advantages, mask):
    """Detached-mode reference for any loss over an SDPA model: the eager
    loss with the prompt's keys and values (positions 0..P-2) constants."""
    with prompt_state_detached(prompt.shape[0]):
        return eager_loss_and_grads(loss_fn, model, prompt, responses, advantages, mask)


def hybrid_detached_reference(model, prompt, responses, advantages, mask):
    """The detached contract with HF's hybrid cache, which cannot be repeated
    along the batch: the prompt[:-1] cache is built for all G rows under
    no_grad, then the branches run on [prompt[-1], responses[:, :-1]], their
    positions given (Bamba's hybrid cache reports the length of a Mamba
    layer, 0, so HF would number them from 0), the cache under the name the
    model takes (`cache_params` for Mamba-2 alone)."""
    G, P, R = responses.shape[0], prompt.shape[0], responses.shape[1]
    positions = torch.arange(P - 1, P - 1 + R, device=prompt.device)

    def run():
        cache = {}
        if P > 1:
            with torch.no_grad():
                out = model(input_ids=prompt[None, :-1].expand(G, -1), use_cache=True)
            if hasattr(out, "cache_params"):
                cache = {"cache_params": out.cache_params, "cache_position": positions, "use_cache": True}
            else:
                cache = {"past_key_values": out.past_key_values, "use_cache": True}
        logits = model(input_ids=branch_inputs(prompt, responses), position_ids=positions[None].expand(G, -1),
                       **cache).logits
        loss = grpo_tail(logits, responses, advantages, mask)
        loss.backward()
        return loss

    return with_fresh_grads(model, run)
