"""Attention whose earlier keys and values live in the prompt state's
buffers: the autograd functions the attention pass's step runs
(`passes/attention.py`), over the kernels of `kernels/attention.py`.

The forward reads the buffers by reference (a branch never copies the
prompt's keys) and keeps each row's output and log-sum-exp; the backward
walks the keys in blocks that never straddle the step's offset, so with
the whole row's output and log-sum-exp each block's gradients are exact:
dQ is their sum, the step's own dK/dV come from the blocks over its own
positions, the earlier blocks' go to d(state) (exact mode).
"""

from __future__ import annotations

import math

import torch
from torch.utils.flop_counter import register_flop_formula

from longstraw.errors import LongStrawError
from longstraw.parallel.partials import merge_with_own
from longstraw.runtime.kernels.attention import AttentionKernel, compute_dtype, kernel_for
from longstraw.runtime.mask_block import MaskBlock
from longstraw.runtime.prompt_state import StepContext


class RowsOverState(torch.autograd.Function):
    """Causal attention of a step's branch rows (`q`, `k`, `v` `[rows, H, n,
    D]`, the rows' own positions `[o, o+n)`) over the prompt's keys
    `[first, o)` in the state and each row's own: the rows' queries as one
    row of `rows * n` queries after every prompt key (one kernel call over
    the prompt, whose keys are read once), and each row causal over its own
    keys as a batch, merged by log-sum-exp. Backward as
    `AttentionOverState`'s, block by block with the merged output and
    log-sum-exp: the folded queries over the prompt's key blocks (their
    dK/dV, summed over the rows by the kernel, go to d(state)), the batch
    over its own square."""

    @staticmethod
    def forward(ctx, step: StepContext, q, k, v, k_slot, v_slot, scale, first):
        o = step.offset - first
        rows = q.shape[0]
        out, lse = torch.ops.longstraw.causal_attention_forward(q, k, v, scale, 0)
        if o > 0:
            keys = _visible_from(step, k_slot, first).narrow(-2, 0, o)
            values = _visible_from(step, v_slot, first).narrow(-2, 0, o)
            out_p, lse_p = torch.ops.longstraw.causal_attention_forward(_folded(q), keys, values, scale, o)
            compute = compute_dtype(q)
            merged, lse = merge_with_own(_unfolded(out_p, rows).to(compute), _unfolded(lse_p, rows), out.to(compute), lse)
            # the merge follows `_unfolded`'s transposed strides; the fused kernels' backward reads the
            # log-sum-exp as a contiguous buffer (flash ignores its strides)
            out, lse = merged.to(q.dtype), lse.contiguous()
        ctx.step, ctx.slots, ctx.scale, ctx.first = step, (k_slot, v_slot), scale, first
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        step, first = ctx.step, ctx.first
        q, k, v, out, lse = ctx.saved_tensors
        o = step.offset - first
        kernel = kernel_for(q, None)
        own = [(start, length) for start, length in kernel.blocks(q, o) if start >= o]
        grad_q, grad_k, grad_v = _backward_over_blocks(step, kernel, own, grad_out, q, k, v, out, lse, None, ctx.scale,
                                                       o, first, ctx.slots)
        if o > 0:
            folded = _folded(q)
            prompt = kernel.earlier_blocks(folded, o)
            ahead, _, _ = _backward_over_blocks(step, kernel, prompt, _folded(grad_out), folded, k[:1], v[:1],
                                                _folded(out), _folded(lse), None, ctx.scale, o, first, ctx.slots)
            grad_q = grad_q + _unfolded(ahead, q.shape[0])
        return None, grad_q, grad_k, grad_v, None, None, None, None


def _folded(x: torch.Tensor) -> torch.Tensor:
    """`[rows, H, n, ...]` -> `[1, H, rows * n, ...]`: the rows' queries (or their outputs) as one row."""
    x = x.transpose(0, 1)
    return x.reshape(1, x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def _unfolded(x: torch.Tensor, rows: int) -> torch.Tensor:
    """`_folded`'s inverse."""
    return x[0].reshape(x.shape[1], rows, x.shape[2] // rows, *x.shape[3:]).transpose(0, 1)


class AttentionOverSpan(torch.autograd.Function):
    """Queries after every key of the step's `[first, o+n)`: attention over
    all of them (the fused kernels' non-causal call, `AttentionKernel`'s
    `q_start` past the last key). `step` is the span's real rows (`k`, `v`
    [1, Hkv, n, D], its own keys); the queries are not its rows. Backward
    as `AttentionOverState`'s, on key blocks that never straddle the offset."""

    @staticmethod
    def forward(ctx, step: StepContext, q, k, v, k_slot, v_slot, scale, first, sinks):
        keys, values = _visible_from(step, k_slot, first), _visible_from(step, v_slot, first)
        kernel = kernel_for(q, None)
        out, lse = with_sinks(*kernel.forward(q, keys, values, None, scale, keys.shape[-2]), sinks)
        ctx.step, ctx.slots, ctx.scale, ctx.kernel, ctx.first = step, (k_slot, v_slot), scale, kernel, first
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        step, kernel, first = ctx.step, ctx.kernel, ctx.first
        q, k, v, out, lse, sinks = ctx.saved_tensors
        o = step.offset - first
        own = [(o + start, length) for start, length in kernel.earlier_blocks(q, k.shape[-2])]
        blocks = [*kernel.earlier_blocks(q, o), *own]
        grads = _backward_over_blocks(step, kernel, blocks, grad_out, q, k, v, out, lse, None, ctx.scale,
                                      o + k.shape[-2], first, ctx.slots)
        return None, *grads, None, None, None, None, sink_grad(grad_out, out, lse, sinks, ctx.needs_input_grad[-1])


class AttentionOverState(torch.autograd.Function):
    """Attention whose keys/values before the step live in the state buffers.

    Forward saves q, the step's own k/v, the output and its log-sum-exp; the
    buffers are read by reference, so a branch never copies the prompt state.
    Backward walks the keys in blocks (`_AttentionKernel.blocks`): with the
    output and log-sum-exp of the whole row each block's gradients are
    exact, so dQ is their sum, the step's dK/dV come from the blocks over
    its own positions and the earlier blocks' dK/dV go to d(state) (exact
    mode). Peak memory is one key block, not the whole visible range (flash
    attention's GQA backward expands dK/dV to all query heads). `first`:
    keys before it are left padding no query sees (`MaskBlock.first_key`):
    the kernels run causal over `[first, o+n)`, positions counted from it."""

    @staticmethod
    def forward(ctx, step: StepContext, q, k, v, mask, k_slot, v_slot, scale, first, sinks):
        kernel = kernel_for(q, mask)
        keys, values = _visible_from(step, k_slot, first), _visible_from(step, v_slot, first)
        if mask is None:
            out, lse = _causal_over_state(step, k_slot, q, keys, values, scale, step.offset - first)
        else:
            out, lse = kernel.forward(q, keys, values, mask, scale, step.offset)
        out, lse = with_sinks(out, lse, sinks)
        ctx.step, ctx.slots, ctx.scale, ctx.kernel, ctx.mask = step, (k_slot, v_slot), scale, kernel, mask
        ctx.first = first
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        step, kernel, first = ctx.step, ctx.kernel, ctx.first
        q, k, v, out, lse, sinks = ctx.saved_tensors
        o = step.offset - first  # positions from the first visible key
        grads = _backward_over_blocks(step, kernel, kernel.blocks(q, o), grad_out, q, k, v, out, lse, ctx.mask,
                                      ctx.scale, o, first, ctx.slots)
        return (None, *grads, None, None, None, None, None,
                sink_grad(grad_out, out, lse, sinks, ctx.needs_input_grad[-1]))


def with_sinks(
    out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A row's output and log-sum-exp over all its keys, with each query
    head's sink (one more logit `s`, value zero) taken in:
    `out * exp(lse - lse')`, `lse' = logaddexp(lse, s)`. The block
    backward with these is the sink softmax's for q, k and v (its
    probabilities are `exp(score - lse')`, its row term `dout . out`)."""
    if sinks is None:
        return out, lse
    total = torch.logaddexp(lse, sinks.to(lse.dtype).view(1, -1, 1))
    kept = torch.exp(lse - total)  # 0 for a row that sees no key (lse = -inf)
    return (out.to(kept.dtype) * kept[..., None]).to(out.dtype), total


def sink_grad(
    grad_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None, wanted: bool
) -> torch.Tensor | None:
    """d(sinks) from the rows `with_sinks` returned: the sink's probability
    `exp(s - lse')` times `-(dout . out)`, summed over the rows."""
    if sinks is None or not wanted:
        return None
    compute = compute_dtype(out)
    rows = (grad_out.to(compute) * out.to(compute)).sum(-1)
    share = torch.exp(sinks.to(compute).view(1, -1, 1) - lse.to(compute))
    return -(share * rows).sum((0, 2)).to(sinks.dtype)


def _backward_over_blocks(
    step: StepContext, kernel: AttentionKernel, blocks: list[tuple[int, int]], grad_out: torch.Tensor,
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    mask: MaskBlock | None, scale: float | None, q_start: int, first: int, slots: tuple[int, int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV of the step's own keys `k`, `v`, from key `blocks` (counted
    from `first`) that never straddle the step's offset: with the output and
    log-sum-exp of the whole row each block's gradients are exact, so dQ is
    their sum; the earlier blocks' dK/dV go to d(state) (exact mode). One
    block's dQ, and dK/dV of one block over all the step's own keys, are
    returned as the kernel gave them (no buffer to add or copy them into:
    a few launches per layer and step, where the host paces short steps)."""
    k_slot, v_slot = slots
    o = step.offset - first
    keys, values = _visible_from(step, k_slot, first), _visible_from(step, v_slot, first)
    grad_out = grad_out.contiguous()
    whole = [(start, length) for start, length in blocks if start >= o] == [(o, k.shape[-2])]
    grad_q = grad_k = grad_v = None
    for start, length in blocks:
        own = start >= o
        kb = k.narrow(-2, start - o, length) if own else keys.narrow(-2, start, length)
        vb = v.narrow(-2, start - o, length) if own else values.narrow(-2, start, length)
        cols = None if mask is None else mask.columns(start, length)
        gq, gk, gv = kernel.backward(grad_out, q, kb, vb, out, lse, cols, scale, q_start, start)
        if grad_q is None:
            grad_q = gq if len(blocks) == 1 else gq.to(compute_dtype(q), copy=True)
        else:
            grad_q += gq
        if own and whole:
            grad_k, grad_v = gk.to(k.dtype), gv.to(v.dtype)
        elif own:
            grad_k = torch.zeros_like(k) if grad_k is None else grad_k
            grad_v = torch.zeros_like(v) if grad_v is None else grad_v
            grad_k.narrow(-2, start - o, length).copy_(gk)
            grad_v.narrow(-2, start - o, length).copy_(gv)
        else:
            # when k and v are one slot, both land in the same d(state) and sum there
            step.accumulate_grad(k_slot, gk, start + first)
            step.accumulate_grad(v_slot, gv, start + first)
    if grad_q is None:  # no key block: no gradient
        grad_q = torch.zeros_like(q)
    grad_k = torch.zeros_like(k) if grad_k is None else grad_k
    grad_v = torch.zeros_like(v) if grad_v is None else grad_v
    return grad_q.to(q.dtype), grad_k, grad_v


def _visible_from(step: StepContext, slot: int, first: int) -> torch.Tensor:
    """The state's positions `[first, o+n)`: `[1, H, o+n-first, D]`."""
    visible = step.visible(slot)
    return visible.narrow(-2, first, visible.shape[-2] - first)


def _causal_over_state(
    step: StepContext, slot: int, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float | None,
    q_start: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal forward (output, log-sum-exp), queries from `q_start` among
    `keys`; with `HostAttentionOutputs` the capture keeps it for each prompt
    chunk and the reverse pass, which recomputes the chunk from the same
    inputs, reads it back."""
    kept = step.state.attention_outputs
    prompt_chunk = kept is not None and step.offset + step.length <= step.state.prefix_len
    if prompt_chunk and step.grad_enabled:
        stored = kept.get(slot, step.offset)
        if stored is not None:
            if step.state.verify:
                recomputed = torch.ops.longstraw.causal_attention_forward(q, keys, values, scale, q_start)
                _verify_kept(step, slot, stored, recomputed)
            return stored
    out, lse = torch.ops.longstraw.causal_attention_forward(q, keys, values, scale, q_start)
    if prompt_chunk and not step.grad_enabled:
        kept.keep(slot, step.offset, out, lse)
    return out, lse


def _verify_kept(step: StepContext, slot: int, stored: tuple[torch.Tensor, ...], recomputed: tuple[torch.Tensor, ...]) -> None:
    """`Options.verify_state`: the reverse pass's attention equals what the capture kept."""
    if not all(torch.equal(a, b) for a, b in zip(stored, recomputed)):
        raise LongStrawError(
            f"verify_state: the reverse pass recomputed the attention of {step.state.slots[slot].label()} over positions "
            f"[{step.offset}, {step.offset + step.length}) with other values than the capture kept "
            "(attention_outputs_on_host): the step is not deterministic; turn the option off"
        )


def _causal_forward(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float | None, q_start: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal forward over all keys (output, log-sum-exp) as one
    operator, so that layer-wise recomputation keeps its outputs instead of
    running it again (`keep_through_recomputation`): over a long prompt it
    is most of an attention layer's forward."""
    return kernel_for(q, None).forward(q, keys, values, None, scale, q_start)


causal_attention_forward = torch.library.custom_op("longstraw::causal_attention_forward", mutates_args=())(_causal_forward)
# the same kernels run on fake tensors: the memory planner sees their temporaries
causal_attention_forward.register_fake(_causal_forward)


@register_flop_formula(torch.ops.longstraw.causal_attention_forward)
def _causal_forward_flops(q_shape, keys_shape, values_shape, scale, q_start, *, out_shape=None) -> int:
    """Scores and weighted values of the causal pairs: queries `[q_start, q_start + n)` over keys up to theirs,
    of the `m` keys there are (queries after them all, as `RowsOverState`'s over the prompt, see all `m`)."""
    *batch, heads, n, dim = q_shape
    m = keys_shape[-2]
    short = max(0, min(n, m - q_start - 1))  # the queries that see fewer than all m keys
    pairs = short * q_start + short * (short + 1) // 2 + (n - short) * m
    return 2 * math.prod(batch) * heads * (dim + values_shape[-1]) * pairs
