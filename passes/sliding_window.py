"""Sliding-window attention: a query sees itself and the W-1 positions before it.

HF builds such a mask for Mistral-style models (`sliding_window`) and for
the sliding layers of Gemma3-style models that alternate sliding and full
attention. A position more than W-1 back is never read again, so the state
a later position needs is the keys and values of the last W-1 positions:
fixed bytes, whatever the prompt length. This pass claims SDPA calls whose
mask `longstraw.analysis.mask.band_of` proves to be such a window (from the
operators that build it, for every length) and runs them as a `CarryPass`:
the carry is those W-1 keys and values, packed with a validity flag so the
positions before the sequence start count as absent.

Written against the public pass interface only; `docs/passes.md` walks
through it.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx
import torch.nn.functional as F

from longstraw.runtime.carry import CarryKernel
from longstraw.analysis.dims import DimRules
from longstraw.analysis.mask_bands import band_of
from longstraw.nodes import arg, is_sdpa, tensor_of

from .attention import before_head_repetition
from .base import CarryPass


def window_of(node: fx.Node) -> int | None:
    """W when `node` is SDPA under a mask proved to be a causal window of W
    positions (W >= 2) narrower than the sequence, else None."""
    if not is_sdpa(node):
        return None
    mask = arg(node, 3, "attn_mask")
    if not isinstance(mask, fx.Node) or arg(node, 5, "is_causal", False):
        return None
    return window_of_mask(mask, tensor_of(node.args[0]).shape[-2])


def window_of_mask(mask: fx.Node, length: int) -> int | None:
    """W when the boolean `mask` over `length` queries is proved (`band_of`)
    a causal window of W positions (W >= 2) narrower than the sequence, else None."""
    band = band_of(mask)
    if band is None or band[0] != 0 or not math.isfinite(band[1]) or not 1 <= band[1] < length - 1:
        return None
    return int(band[1]) + 1


def window_keys(carry, k, v, n: int, window: int):
    """The keys and values queries `[o, o+n)` see: the carry's W-1 positions
    (keys, values and a validity flag packed as [B, Hk, W-1, Dk+Dv+1])
    and the step's own `k`, `v`; the boolean mask of the window over them,
    and the carry after the step."""
    dim_k = k.shape[-1]
    new = torch.cat([k, v, k.new_ones(*k.shape[:-1], 1)], -1)
    carry = carry.expand(new.shape[0], *carry.shape[1:])
    both = torch.cat([carry, new], -2)  # positions o-(W-1) .. o+n-1
    keys, values, valid = both[..., :dim_k], both[..., dim_k:-1], both[..., -1]
    seen = both.shape[-2]
    query = torch.arange(n, device=k.device)[:, None]
    key = torch.arange(seen, device=k.device)[None, :]
    # key u is position o-(W-1)+u, query t position o+t: visible when 0 <= (t+W-1) - u <= W-1
    allowed = (key >= query) & (key <= query + window - 1)
    mask = allowed & (valid[:, :1, None, :] > 0)  # validity is per position, the same for every head
    return keys, values, mask, both[..., seen - (window - 1):, :]


def window_attention(carry, q, k, v, *, window: int, scale: float | None, enable_gqa: bool):
    """SDPA of queries `q` [B, Hq, n, D] over the previous `window - 1`
    positions (the carry) and the step's own `k`, `v` (`window_keys`).
    Returns (out, the carry after the step)."""
    keys, values, mask, new_carry = window_keys(carry, k, v, q.shape[-2], window)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    return out, new_carry


class SlidingWindowAttentionPass(CarryPass):
    """SDPA under a proved sliding-window mask; the last W-1 keys and values are the carry."""

    name = "sliding_window_attention"
    overrides = ("causal_attention",)
    branch_graphs_kept = True
    sequence = (0, 2)  # q [B, H, L, D]

    def claims(self, node: fx.Node) -> bool:
        return window_of(node) is not None

    def unsupported_reason(self, node: fx.Node) -> str | None:
        dropout = arg(node, 4, "dropout_p", 0.0)
        if dropout:
            return f"attention dropout (dropout_p={dropout}) is not replayed; put the model in eval mode"
        return None

    def positional_inputs(self, node: fx.Node) -> list[fx.Node]:
        return [arg(node, 3, "attn_mask")]  # the window replaces it: never built per step

    def dim_rule(self, dims: DimRules, node: fx.Node):
        q, k, v = (dims.of(x) for x in node.args[:3])
        for other in (k, v):
            dims.same(q[0], other[0])
            dims.same(q[2], other[2])
        dims.same(k[-1], q[-1])
        dims.mixes(node, q[2])
        return q[:-1] + [v[-1]]

    def carry(self, node: fx.Node) -> tuple[tuple[int, ...], torch.dtype]:
        k, v = (tensor_of(x) for x in _keys_and_values(node)[:2])
        return (1, k.shape[1], window_of(node) - 1, k.shape[-1] + v.shape[-1] + 1), k.dtype

    def step_inputs(self, node: fx.Node):
        k, v, repeated = _keys_and_values(node)
        constants = {
            "window": window_of(node),
            "scale": arg(node, 6, "scale"),
            "enable_gqa": bool(arg(node, 7, "enable_gqa", False)) or repeated,
        }
        return (node.args[0], k, v), constants

    def kernel(self, inputs, *, window: int, scale: float | None, enable_gqa: bool) -> CarryKernel:
        return CarryKernel(
            forward=lambda carry, q, k, v: window_attention(carry, q, k, v, window=window, scale=scale,
                                                            enable_gqa=enable_gqa),
            token_dims=(2, 2, 2, 2),
            graph_key=("sliding_window_attention", window, scale, enable_gqa),
        )


def _keys_and_values(node: fx.Node) -> tuple[fx.Node, fx.Node, bool]:
    """K and V as the layer computed them, before `repeat_kv` (the carry
    then holds the K/V heads, not the query heads; SDPA's `enable_gqa`
    repeats them), and whether they were repeated. K and V repeated by
    different factors are taken as SDPA got them."""
    (k, k_repeat), (v, v_repeat) = (before_head_repetition(x) for x in node.args[1:3])
    if k_repeat != v_repeat:
        return node.args[1], node.args[2], False
    return k, v, k_repeat > 1
