"""Full causal attention: SDPA with `is_causal=True` or an explicit mask
computed from positions, with or without GQA.

State per layer: K and V at prompt positions, captured after RoPE and before
any head repetition (`repeat_kv`), which the step folds into SDPA's
`enable_gqa`. A step with queries at positions `[o, o+n)` attends to the
buffer view `[0, o+n)` (lower-right causal) without copying it. On CUDA in
fp16/bf16 this is PyTorch's flash attention with native GQA; elsewhere, and
with an explicit mask that is not plain causal (a `longstraw.analysis.mask.MaskBlock`
the step computes one key block at a time), an explicit softmax over key
blocks. Both keep the log-sum-exp, so backward runs block by block.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
from torch import fx

from longstraw.parallel.shards import SlotKeys
from longstraw.parallel.collectives import raise_together
from longstraw.parallel.sharded_attention import round_attention, sharded_causal_attention
from longstraw.errors import LongStrawError, argument_name
from longstraw.runtime.kernels.attention_over_state import AttentionOverSpan, AttentionOverState, RowsOverState
from longstraw.runtime.mask_block import MaskBlock
from longstraw.analysis.mask_bands import key_padding_of, reads_input, selected_by_topk
from longstraw.nodes import ancestors, arg, is_sdpa, op_name, tensor_of
from longstraw.codegen.recompute import keep_through_recomputation
from longstraw.runtime.prompt_state import StepContext

from .base import ArchitecturePass, Candidate, SiteState, StepEmitter


class CausalAttentionPass(ArchitecturePass):
    name = "causal_attention"
    runs_rounds = True
    branch_graphs_kept = True  # the backward reads the state before the step only (`attention_over_state`)
    branches_batched = True  # `attention_step` runs a batched step's rows one by one over the state

    def claims(self, node: fx.Node) -> bool:
        # every SDPA; the passes that prove a narrower state (a sliding window, latent attention,
        # a top-k selection) override this one where they claim (`ArchitecturePass.overrides`)
        return is_sdpa(node)

    def position_dims(self, node: fx.Node) -> tuple[tuple[fx.Node, int], tuple[fx.Node, int]]:
        q = node.args[0]
        return (q, tensor_of(q).dim() - 2), (q, 0)

    def state_inputs(self, node: fx.Node) -> list[fx.Node]:
        return [node.args[1], node.args[2]]

    def positional_inputs(self, node: fx.Node) -> list[fx.Node]:
        mask = arg(node, 3, "attn_mask")
        return [mask] if isinstance(mask, fx.Node) else []

    def unsupported_reason(self, node: fx.Node) -> str | None:
        mask = arg(node, 3, "attn_mask")
        if selected_by_topk(node):
            return ("its attn_mask is built with a top-k: a selection of keys (DSA's indexer), which only the "
                    "`sparse_latent_attention` pass may run once it proves it; it is not among the backend's passes "
                    "(drop it from options['disable_passes'])")
        if mask is not None:
            reason = mask_reason(mask)
            if reason is not None:
                return reason
        elif not arg(node, 5, "is_causal", False):
            return "non-causal SDPA lets earlier positions see later ones, so the prompt cannot be captured once"
        dropout = arg(node, 4, "dropout_p", 0.0)
        if dropout != 0.0:
            return f"attention dropout (dropout_p={dropout}) is not replayed yet; put the model in eval mode or set attention_dropout=0"
        if tensor_of(node.args[0]).dim() != 4:
            return "SDPA query must be [batch, heads, positions, head_dim]"
        return None

    def candidates(self, node: fx.Node, state_input: fx.Node) -> list[Candidate]:
        """Walk up from the key/value input through ops the step can absorb:
        identities (contiguous, clone, `cat([empty, k])`) and head repetition."""
        return [Candidate(n, repeat) for n, repeat in _absorbed_chain(state_input)]

    def emit_step(self, emitter: StepEmitter, node: fx.Node, sites: list[SiteState]) -> fx.Node:
        k_site, v_site = sites
        q = node.args[0]
        mask = arg(node, 3, "attn_mask")
        kwargs = {
            "mask": emitter.query_key_block(mask) if mask is not None else None,
            "k_slot": k_site.slot,
            "v_slot": v_site.slot,
            "scale": arg(node, 6, "scale"),
            "enable_gqa": bool(arg(node, 7, "enable_gqa", False)) or k_site.transform > 1 or v_site.transform > 1,
        }
        args = (emitter.ctx, *emitter.mapped((q, k_site.cut, v_site.cut)))
        return emitter.graph.call_function(attention_step, args, kwargs)


def mask_reason(mask: object) -> str | None:
    """Why an attention mask cannot be run step by step, or None: it must be
    computed from positions (with at most one key padding mask read from an
    input) and let no position see a later one."""
    if not isinstance(mask, fx.Node) or tensor_of(mask).dim() < 2:
        return "attn_mask must be a tensor of at least [queries, keys]"
    padding = key_padding_of(mask)
    if reads_input(mask) and padding is None:
        sources = ancestors([mask])
        read = ", ".join(f"`{argument_name(n)}`" for n in mask.graph.find_nodes(op="placeholder") if n in sources)
        return (
            f"the attn_mask depends on inputs ({read}) other than through a key padding mask: LongStraw supports "
            "masks computed from positions, and-ed with one boolean mask over keys read from an input (HF's mask "
            "from a 2-D attention_mask, 1 = real token, 0 = padding); pass the 2-D padding mask to the model "
            "instead of a 4-D mask. If the input is position ids that restart inside a row (packed, padding-free "
            "sequences: HF then masks each sequence from the others), LongStraw does not take packed rows yet: "
            "pass one sequence per row, [prompt; completion] padded, with a 2-D attention_mask (in verl, "
            "use_remove_padding=False)"
        )
    if _sees_the_future(mask, padding):
        return (
            "the attn_mask lets a position attend to later positions (e.g. a prefix-LM mask), "
            "so earlier positions cannot be computed before later ones"
        )
    return None


def before_head_repetition(node: fx.Node) -> tuple[fx.Node, int]:
    """The earliest node `node` is computed from by ops the attention step
    absorbs (identities, `repeat_kv`'s head repetition), and the head
    repeat factor between the two: K or V as a layer computed them."""
    return _absorbed_chain(node)[-1]


def _absorbed_chain(node: fx.Node) -> list[tuple[fx.Node, int]]:
    """`node` and each input it is computed from by ops the attention step
    absorbs, walking up, with the head repeat factor from each to `node`."""
    chain = [(node, 1)]
    while True:
        parent, factor = _absorbable(chain[-1][0])
        if parent is None:
            return chain
        chain.append((parent, chain[-1][1] * factor))


def _absorbable(node: fx.Node) -> tuple[fx.Node | None, int]:
    """(input, head repeat factor) if `node` is an op the attention step absorbs."""
    name = op_name(node)
    if name in ("contiguous", "clone"):
        return node.args[0], 1
    if name == "cat":
        parts = [p for p in arg(node, 0, "tensors") if tensor_of(p).numel() > 0 or tensor_of(p).dim() > 1]
        if len(parts) == 1 and tensor_of(parts[0]).shape == tensor_of(node).shape:
            return parts[0], 1
        return None, 1
    if name == "repeat_interleave":
        repeats, dim = arg(node, 1, "repeats"), arg(node, 2, "dim")
        if isinstance(repeats, int) and dim in (1, -3) and tensor_of(node).dim() == 4:
            return node.args[0], repeats
        return None, 1
    if name in ("reshape", "view"):
        # repeat_kv: x[:, :, None].expand(b, h, r, l, d).reshape(b, h * r, l, d)
        src = node.args[0]
        if op_name(src) != "expand" or tensor_of(node).dim() != 4 or tensor_of(src).dim() != 5:
            return None, 1
        inner = src.args[0]
        b, h, r, l, d = tensor_of(src).shape
        if tuple(tensor_of(inner).shape) != (b, h, 1, l, d) or tuple(tensor_of(node).shape) != (b, h * r, l, d):
            return None, 1
        base = _unsqueezed_from(inner)
        if base is None:
            return None, 1
        return base, r
    return None, 1


MASK_CHECK_MAX_POSITIONS = 4096


def _sees_the_future(mask: fx.Node, padding: fx.Node | None) -> bool:
    """Evaluate the positions-only part of a mask (with the key padding
    mask `padding`, which only removes keys, taken as all true) and check
    that no query attends to a later key. Masks over more positions than
    MASK_CHECK_MAX_POSITIONS are not evaluated (the check would cost L^2)."""
    value = tensor_of(mask)
    rows, cols = value.shape[-2], value.shape[-1]
    if max(rows, cols) > MASK_CHECK_MAX_POSITIONS or value.device.type == "meta":
        return False
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    needed = ancestors([mask], stop={padding})
    for node in mask.graph.nodes:
        if node is padding:
            keys = tensor_of(padding)
            kwargs = {"dtype": torch.bool, "device": keys.device}
            env[node] = graph.call_function(torch.ones, (tuple(keys.shape),), kwargs)
        elif node in needed:
            env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(env[mask])
    with torch.no_grad():
        block = fx.GraphModule(torch.nn.Module(), graph)()
    later = torch.ones(rows, cols, dtype=torch.bool, device=block.device).triu(cols - rows + 1)
    allowed = block if block.dtype == torch.bool else block > float("-inf")
    return bool((allowed & later).any())


def _unsqueezed_from(node: fx.Node) -> fx.Node | None:
    """The 4-D tensor `x` if `node` is `x.unsqueeze(2)` or `x[:, :, None]`."""
    name = op_name(node)
    if name == "unsqueeze" and arg(node, 1, "dim") in (2, -3):
        return node.args[0]
    if node.target is operator.getitem and isinstance(node.args[1], tuple):
        index = node.args[1]
        full = slice(None, None, None)
        if index[:3] == (full, full, None) and all(i == full or i is Ellipsis for i in index[3:]):
            return node.args[0]
    return None


def attention_step(
    ctx: StepContext,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: MaskBlock | None,
    k_slot: int,
    v_slot: int,
    scale: float | None,
    enable_gqa: bool,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of the step's queries over all positions so far.

    q: [1, Hq, n, D]; k, v: [1, Hkv, n, D] (the step's own positions, already
    written to the state buffers by `write_state`); mask: None (causal) or
    the mask's block over rows [o, o+n) and columns [0, o+n), computed a
    key block at a time. Hq is a multiple of Hkv whether or not the
    graph asked for `enable_gqa` (without it the two are equal). `sinks`:
    one more logit per query head `[Hq]` with no value (`passes.sinks`),
    taken into each row's output and log-sum-exp once all its keys are in."""
    if ctx.rows > 1:
        return _row_by_row(ctx, q, k, v, mask, k_slot, v_slot, scale, sinks)
    del enable_gqa
    first, masked = 0, mask is not None
    if mask is not None and mask.is_causal():
        mask = None  # e.g. HF's explicit causal mask: the fused kernels need none
    if sinks is not None and (ctx.round is not None or ctx.state.shard is not None):
        raise LongStrawError(
            f"context parallelism: the attention over {ctx.state.slots[k_slot].label()} has learned sinks, and "
            "context parallelism merges each rank's partial attention without them. Run this model without "
            "context_parallel."
        )
    if ctx.round is not None:
        # a capture round: every rank attends its own chunk, and a mask can be one run of keys over one
        # rank's chunk and not over another's, so the ranks decide together
        keys = (0, ctx.offset + ctx.length) if mask is None else mask.key_interval()
        if masked:
            raise_together(None if keys is not None else _not_one_run(ctx, k_slot), ctx.state.shard.ranks, q.device)
        return round_attention(ctx, q, k, v, SlotKeys(k_slot, v_slot), scale, *keys)
    if ctx.state.shard is not None:
        keys = (0, ctx.offset + ctx.length) if mask is None else mask.key_interval()
        if keys is None:
            raise _not_one_run(ctx, k_slot)
        return sharded_causal_attention(ctx, q, k, v, SlotKeys(k_slot, v_slot), scale, *keys)
    elif mask is not None and (left := mask.first_key()) is not None:
        mask, first = None, left  # a left-padded prompt: causal over the keys after the padding
    elif mask is not None and (left := mask.padding_end()) is not None:
        return _attention_after_padding(ctx, q, k, v, k_slot, v_slot, scale, left, sinks)
    elif mask is not None and ctx.offset >= ctx.state.prefix_len and (span := mask.key_span()) is not None:
        if not _unread(ctx, 0, span[1]):
            return _attention_over_span(ctx, q, k, v, k_slot, v_slot, scale, *span, sinks)
        mask, first = None, span[0]  # its padded queries reach nothing the loss reads: causal over [first, row]
    return AttentionOverState.apply(ctx, q, k, v, mask, k_slot, v_slot, scale, first, sinks)


def _row_by_row(
    ctx: StepContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: MaskBlock | None, k_slot: int,
    v_slot: int, scale: float | None, sinks: torch.Tensor | None,
) -> torch.Tensor:
    """A step of several branch rows (`StepContext.rows`). Where every
    row's mask is causal attention over one run of keys from a first key
    the rows share (left padding) to the row's own last (a right-padded
    completion; `_row_spans`) and there are no sinks: `RowsOverState`, the
    rows at once, then each padded completion's padded queries again over
    its keys (`AttentionOverSpan`; what the fused call gave them gets no
    gradient), unless the loss reads none of them (`_unread`). Otherwise
    each row's own keys and values go to the state's scratch room and its
    attention runs as a one-row step's, with its own
    row of the mask, so every form above holds per row. The layer's other
    operators ran on all rows at once. The backward of a row reads the
    state before the step only, so the next row may overwrite the scratch
    room."""
    one = dataclasses.replace(ctx, rows=1)
    k_rows, v_rows = ctx.state.slots[k_slot].batch_dim, ctx.state.slots[v_slot].batch_dim

    def stored(j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row `j`'s own keys and values, written to the scratch room its one-row attention reads."""
        k_j, v_j = k.narrow(k_rows, j, 1), v.narrow(v_rows, j, 1)
        one.write(k_slot, k_j)
        one.write(v_slot, v_j)
        return k_j, v_j

    spans = None if sinks is not None or ctx.round is not None or ctx.state.shard is not None else _row_spans(ctx, mask)
    if spans is not None:
        first, lasts = spans
        out = RowsOverState.apply(ctx, q, k, v, k_slot, v_slot, scale, first)
        rows = list(out.split(1))
        for j, last in enumerate(lasts):
            real = last - ctx.offset
            if real == ctx.length or _unread(ctx, j, last):
                continue
            # a right-padded completion: its padded queries see the keys [first, last) (eager's causal & key
            # mask), not their causal own keys; the queries before `last` are causal, as computed
            k_j, v_j = stored(j)
            real_rows = dataclasses.replace(one, length=real)
            tail = _padded_queries(real_rows, q.narrow(0, j, 1), k_j.narrow(-2, 0, real), v_j.narrow(-2, 0, real),
                                   k_slot, v_slot, scale, first, None)
            rows[j] = torch.cat([rows[j].narrow(-2, 0, real), tail], dim=-2)
        return torch.cat(rows, dim=0)
    outs = []
    for j in range(ctx.rows):
        k_j, v_j = stored(j)
        outs.append(attention_step(one, q.narrow(0, j, 1), k_j, v_j, mask=None if mask is None else mask.row(j),
                                   k_slot=k_slot, v_slot=v_slot, scale=scale, enable_gqa=True, sinks=sinks))
    return torch.cat(outs, dim=0)


def _not_one_run(ctx: StepContext, k_slot: int) -> LongStrawError:
    return LongStrawError(
        f"context parallelism: the attention over {ctx.state.slots[k_slot].label()} has a mask that is not causal "
        "attention over one run of keys (a window, a padding mask with holes); a sharded prompt runs that form "
        "only. Run this batch without context_parallel."
    )


def _attention_over_span(
    ctx: StepContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_slot: int, v_slot: int,
    scale: float | None, first: int, last: int, sinks: torch.Tensor | None,
) -> torch.Tensor:
    """A branch whose completion is right-padded from `last` on
    (`MaskBlock.key_span`), with fused kernels instead of the mask: its real
    rows are causal over the keys `[first, row]` (a step of `last - offset`
    positions), its padded rows see every key of `[first, last)`
    (`AttentionOverSpan`), as eager's `causal & key mask` gives them. The
    padded positions' own keys are seen by no query: no gradient."""
    real = last - ctx.offset
    own_k, own_v = k.narrow(-2, 0, real), v.narrow(-2, 0, real)
    real_rows = dataclasses.replace(ctx, length=real)  # its keys are the span's: [0, last)
    head = AttentionOverState.apply(real_rows, q.narrow(-2, 0, real), own_k, own_v, None, k_slot, v_slot, scale, first,
                                     sinks)
    tail = _padded_queries(real_rows, q, own_k, own_v, k_slot, v_slot, scale, first, sinks)
    return torch.cat([head, tail], dim=-2)


def _padded_queries(
    real_rows: StepContext, q: torch.Tensor, own_k: torch.Tensor, own_v: torch.Tensor, k_slot: int, v_slot: int,
    scale: float | None, first: int, sinks: torch.Tensor | None,
) -> torch.Tensor:
    """The attention of a right-padded completion's queries from its last
    real position on (`q`: the whole step's; `real_rows`: the step cut to
    its real positions, whose own keys are `own_k`, `own_v`): every key of
    `[first, last)` (`AttentionOverSpan`)."""
    real = real_rows.length
    return AttentionOverSpan.apply(real_rows, q.narrow(-2, real, q.shape[-2] - real), own_k, own_v, k_slot, v_slot,
                                   scale, first, sinks)


def _attention_after_padding(
    ctx: StepContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_slot: int, v_slot: int,
    scale: float | None, first: int, sinks: torch.Tensor | None,
) -> torch.Tensor:
    """A step whose rows hold the end of the left padding (`MaskBlock.padding_end`),
    with fused kernels instead of the mask: the padding rows before `first`
    see no key, so their output is zero (SDPA's for a row with every key
    masked; with a sink, which then takes all the weight, too) and nothing
    flows back to them; the rows from `first` on are causal over the keys
    `[first, o+n)`, a step of their own. The padding positions' keys are
    seen by no query: no gradient."""
    pad = first - ctx.offset
    zeros = q.new_zeros(*q.shape[:-2], pad, v.shape[-1])
    if pad == q.shape[-2]:
        return zeros
    real = q.shape[-2] - pad
    real_rows = dataclasses.replace(ctx, offset=first, length=real)
    out = AttentionOverState.apply(real_rows, q.narrow(-2, pad, real), k.narrow(-2, pad, real),
                                    v.narrow(-2, pad, real), None, k_slot, v_slot, scale, first, sinks)
    return torch.cat([zeros, out], dim=-2)


def _unread(ctx: StepContext, row: int, last: int) -> bool:
    """Whether the loss reads nothing of `row` from its padded queries on
    (`last`: its key mask's end; `StepContext.unread_from`): what they
    attend to then changes nothing read, and eager's form of them (every
    key of the span) need not run again."""
    return ctx.unread_from is not None and ctx.unread_from[row] <= last


def _row_spans(ctx: StepContext, mask: MaskBlock | None) -> tuple[int, list[int]] | None:
    """`(first, [last of each row])` when every row of the step is causal
    attention over the keys `[first, last)` with `first` shared, at or
    before the step, and each `last` inside the step or at its end; None
    otherwise (a mask with holes, rows with other left paddings, a row
    with no position of its own)."""
    end = ctx.offset + ctx.length
    if mask is None or mask.is_causal():
        return 0, [end] * ctx.rows
    intervals = [mask.row(j).key_interval() for j in range(ctx.rows)]
    if any(i is None for i in intervals) or len({a for a, _ in intervals}) != 1:
        return None
    first = intervals[0][0]
    if first > ctx.offset or any(not ctx.offset < b <= end for _, b in intervals):
        return None
    return first, [b for _, b in intervals]


keep_through_recomputation(attention_step, torch.ops.longstraw.causal_attention_forward.default)
