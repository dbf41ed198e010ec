"""Attention with learned sinks (gpt-oss, MiMo-V2-Flash) as one operator.

A sink is one more logit per query head, `s_h`, in the softmax's
denominator, with no value: `out = sum_j e^{z_j} v_j / (e^{s_h} + sum_j
e^{z_j})`. Equivalently `out = o * sigmoid(lse - s_h)` with `o` and `lse`
the ordinary attention's output and log-sum-exp over the visible keys, so
the sink enters once per query row, after every key of the row is seen.

`longstraw::sink_attention(q, k, v, attn_mask, sinks, dropout_p, scale,
enable_gqa)` is SDPA (`attn_mask` boolean or additive, as SDPA takes it;
None: no mask) with the sinks of the query heads `[Hq]`, or none.
HF's eager sink attention reaches it through `longstraw.models.sinks`. Two
passes run it, both over the masks HF builds for eager attention
(`where(mask, 0, finfo.min)`, proved through `boolean_mask`):

- `SinkAttentionPass`: causal (or padded) attention, K/V per position as
  `CausalAttentionPass` keeps them; the step's row-wide output and
  log-sum-exp take the sink (`passes.attention.attention_step`'s `sinks`).
- `SlidingSinkAttentionPass`: a proved window of W, the last W-1 keys and
  values carried as `SlidingWindowAttentionPass` carries them; the step's
  kernel attends to the window and the sink as one more key.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula

from longstraw.analysis.dims import DimRules
from longstraw.nodes import op_name, tensor_of
from longstraw.runtime.carry import CarryKernel, recompute_grads

from .attention import CausalAttentionPass, attention_step, mask_reason
from .base import CarryPass, SiteState, StepEmitter
from .sliding_window import window_keys, window_of_mask


def attend_with_sinks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, sinks: torch.Tensor | None,
    dropout_p: float, scale: float, enable_gqa: bool,
) -> torch.Tensor:
    """SDPA with each query head's sink as one more key: its logit is
    `s_h` for every query (an extra query coordinate `s_h / scale` against
    a key coordinate 1, which every other key has 0) and its value zero."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale,
                                              enable_gqa=enable_gqa)
    b, hq, n, _ = q.shape
    extra = (sinks.to(q.dtype) / scale).view(1, hq, 1, 1).expand(b, hq, n, 1)
    sink_key = torch.cat([k.new_zeros(*k.shape[:2], 1, k.shape[-1]), k.new_ones(*k.shape[:2], 1, 1)], -1)
    keys = torch.cat([torch.cat([k, k.new_zeros(*k.shape[:-1], 1)], -1), sink_key], -2)
    values = torch.cat([v, v.new_zeros(*v.shape[:-2], 1, v.shape[-1])], -2)
    if attn_mask is not None:
        shape = (*attn_mask.shape[:-2], n, 1)
        seen = attn_mask.new_ones(shape) if attn_mask.dtype == torch.bool else attn_mask.new_zeros(shape)
        attn_mask = torch.cat([attn_mask.expand(*attn_mask.shape[:-2], n, k.shape[-2]), seen], -1)
    return F.scaled_dot_product_attention(torch.cat([q, extra], -1), keys, values, attn_mask=attn_mask,
                                          dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa)


@torch.library.custom_op("longstraw::sink_attention", mutates_args=())
def sink_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, sinks: torch.Tensor | None,
    dropout_p: float, scale: float, enable_gqa: bool,
) -> torch.Tensor:
    """q [B, Hq, L, D], k [B, Hkv, L, D], v [B, Hkv, L, Dv], sinks [Hq] or
    None; returns [B, Hq, L, Dv]."""
    return attend_with_sinks(q, k, v, attn_mask, sinks, dropout_p, scale, enable_gqa)


@sink_attention.register_fake
def _(q, k, v, attn_mask, sinks, dropout_p, scale, enable_gqa):
    return q.new_empty(*q.shape[:-1], v.shape[-1])


@register_flop_formula(torch.ops.longstraw.sink_attention)
def _sink_attention_flops(q_shape, k_shape, v_shape, *args, out_shape=None) -> int:
    """Scores and weighted values of every query-key pair (eager attention computes the masked ones too)."""
    *batch, heads, queries, dim = q_shape
    return 2 * math.prod(batch) * heads * queries * k_shape[-2] * (dim + v_shape[-1])


def _setup(ctx, inputs, output):
    ctx.constants = inputs[5:]
    ctx.save_for_backward(*inputs[:5])


def _backward(ctx, grad_out):
    """Recompute under autograd (no dropout: a drawn mask would differ)."""
    if ctx.constants[0]:
        raise NotImplementedError(
            f"longstraw::sink_attention has no backward with attention dropout (dropout_p={ctx.constants[0]}): its "
            "recomputation would draw another mask; put the model in eval mode or set attention_dropout=0")
    grads = recompute_grads(lambda *tensors: [attend_with_sinks(*tensors, *ctx.constants)], ctx.saved_tensors,
                            [grad_out], ctx.needs_input_grad[:5])
    return (*grads, None, None, None)


sink_attention.register_autograd(_backward, setup_context=_setup)

OP = torch.ops.longstraw.sink_attention.default


def is_sink_attention(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is OP


def boolean_mask(mask: fx.Node | None) -> fx.Node | None:
    """The boolean mask a sink attention's mask is: itself, or `b` for HF's
    eager mask `where(b, 0, m)` with `m` at most half the dtype's minimum
    (adding it leaves `exp` of the score 0, as `b`'s False does). None for
    any other mask."""
    value = None if mask is None else tensor_of(mask)
    if value is None:
        return None
    if value.dtype == torch.bool:
        return mask
    if op_name(mask) != "where" or len(mask.args) != 3:
        return None
    b, zero, fill = mask.args
    if not isinstance(b, fx.Node) or tensor_of(b) is None or tensor_of(b).dtype != torch.bool:
        return None
    if not (_is_zero(zero) and isinstance(fill, float) and value.is_floating_point()
            and fill <= torch.finfo(value.dtype).min / 2):
        return None
    return b


def _is_zero(x: object) -> bool:
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return x == 0
    return isinstance(x, fx.Node) and op_name(x) in ("zeros", "zeros_like") and tensor_of(x) is not None \
        and tensor_of(x).numel() == 1


def _mask(node: fx.Node) -> fx.Node | None:
    return node.args[3]


def _masks(node: fx.Node) -> list[fx.Node]:
    """The op's mask and the boolean mask it is built from, where they differ."""
    mask = _mask(node)
    if not isinstance(mask, fx.Node):
        return []
    return list(dict.fromkeys(m for m in (mask, boolean_mask(mask)) if m is not None))


def sink_window_of(node: fx.Node) -> int | None:
    """W when `node` is sink attention under a mask proved to be a causal
    window of W positions (W >= 2) narrower than the sequence, else None."""
    if not is_sink_attention(node):
        return None
    mask = boolean_mask(_mask(node))
    if mask is None:
        return None
    return window_of_mask(mask, tensor_of(node.args[0]).shape[-2])


def _dim_rule(dims: DimRules, node: fx.Node):
    """SDPA's rule: q, k, v share batch and positions, the mask is
    `[..., queries, keys]`; the output mixes along the positions."""
    q, k, v = (dims.of(x) for x in node.args[:3])
    for other in (k, v):
        dims.same(q[0], other[0])
        dims.same(q[2], other[2])
    dims.same(k[-1], q[-1])
    mask = _mask(node)
    if isinstance(mask, fx.Node):
        m, shape = dims.of(mask), tensor_of(mask).shape
        dims.same(m[-1], k[2])
        dims.same(m[-2], q[2])
        for i in range(-3, -len(shape) - 1, -1):  # leading mask dims against [batch, heads], where not broadcast
            if i >= -4 and shape[i] != 1:
                dims.same(m[i], q[4 + i])
    dims.mixes(node, q[2])
    return q[:-1] + [v[-1]]


def _dropout_reason(node: fx.Node) -> str | None:
    dropout = node.args[5]
    if dropout:
        return f"attention dropout (dropout_p={dropout}) is not replayed; put the model in eval mode"
    return None


class SinkAttentionPass(CausalAttentionPass):
    """Causal sink attention: K/V per position, the sink applied to each
    step's rows over all their keys (`attention_step`'s `sinks`)."""

    name = "sink_attention"
    runs_rounds = False  # context parallelism's rounds merge partials without the sink: refused in the step

    def claims(self, node: fx.Node) -> bool:
        return is_sink_attention(node) and sink_window_of(node) is None

    def positional_inputs(self, node: fx.Node) -> list[fx.Node]:
        return _masks(node)

    def unsupported_reason(self, node: fx.Node) -> str | None:
        mask = _mask(node)
        if mask is None:
            return "attention without a mask lets earlier positions see later ones, so the prompt cannot be captured once"
        allowed = boolean_mask(mask)
        if allowed is None:
            return ("its attention mask is neither boolean nor HF's eager mask `where(mask, 0, finfo.min)`, so "
                    "LongStraw cannot prove which keys each query sees; build the mask with HF's mask functions")
        if tensor_of(node.args[0]).dim() != 4:
            return "the query must be [batch, heads, positions, head_dim]"
        return _dropout_reason(node) or mask_reason(allowed)

    def dim_rule(self, dims: DimRules, node: fx.Node):
        return _dim_rule(dims, node)

    def emit_step(self, emitter: StepEmitter, node: fx.Node, sites: list[SiteState]) -> fx.Node:
        k_site, v_site = sites
        q, sinks = node.args[0], node.args[4]
        kwargs = {
            "mask": emitter.query_key_block(_mask(node)),
            "k_slot": k_site.slot,
            "v_slot": v_site.slot,
            "scale": node.args[6],
            "enable_gqa": node.args[7],
            "sinks": emitter.mapped(sinks),
        }
        args = (emitter.ctx, *emitter.mapped((q, k_site.cut, v_site.cut)))
        return emitter.graph.call_function(attention_step, args, kwargs)


def window_sink_attention(carry, q, k, v, sinks, *, window: int, scale: float, enable_gqa: bool):
    """`sliding_window.window_attention` with the sinks: the step's queries
    over the carried W-1 positions, their own and the sink."""
    keys, values, mask, new_carry = window_keys(carry, k, v, q.shape[-2], window)
    return attend_with_sinks(q, keys, values, mask, sinks, 0.0, scale, enable_gqa), new_carry


class SlidingSinkAttentionPass(CarryPass):
    """Sink attention under a proved window of W: the last W-1 keys and
    values are the carry (`SlidingWindowAttentionPass`'s)."""

    name = "sliding_sink_attention"
    branch_graphs_kept = True
    runs_rounds = False  # context parallelism's rounds not shown for it yet (its full layers refuse them)
    sequence = (0, 2)

    def claims(self, node: fx.Node) -> bool:
        return sink_window_of(node) is not None

    def unsupported_reason(self, node: fx.Node) -> str | None:
        return _dropout_reason(node)

    def positional_inputs(self, node: fx.Node) -> list[fx.Node]:
        return _masks(node)  # the window replaces them: never built per step

    def dim_rule(self, dims: DimRules, node: fx.Node):
        return _dim_rule(dims, node)

    def carry(self, node: fx.Node) -> tuple[tuple[int, ...], torch.dtype]:
        k, v = (tensor_of(x) for x in node.args[1:3])
        return (1, k.shape[1], sink_window_of(node) - 1, k.shape[-1] + v.shape[-1] + 1), k.dtype

    def step_inputs(self, node: fx.Node):
        constants = {"window": sink_window_of(node), "scale": node.args[6], "enable_gqa": node.args[7]}
        return (*node.args[:3], node.args[4]), constants

    def kernel(self, inputs, *, window: int, scale: float, enable_gqa: bool) -> CarryKernel:
        return CarryKernel(
            forward=lambda carry, q, k, v, sinks: window_sink_attention(carry, q, k, v, sinks, window=window,
                                                                        scale=scale, enable_gqa=enable_gqa),
            token_dims=(2, 2, 2, 2, None),
            graph_key=("sliding_sink_attention", window, scale, enable_gqa, inputs[3] is None),
        )
