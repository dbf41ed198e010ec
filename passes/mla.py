"""Multi-head latent attention (DeepSeek-V3, GLM-5's `glm_moe_dsa`): the
state per position is the normed KV latent and the rope key, not K and V.

HF computes, per layer, a latent `c = kv_a_layernorm(...)` [B, 1, L, r] and a
rope key `k_pe` [B, 1, L, dr] shared over heads, decompresses
`kv_b_proj(c)` into per-head `k_nope` [B, H, L, dn] and `v` [B, H, L, dv],
and calls SDPA on `K = [k_nope | k_pe]`, `V = v`. `mla_of` proves that
structure from the graph (causal SDPA, its K and V, the split, the view and the
`kv_b_proj` linear of one latent, the head expansion of one rope key);
anything else is left to the general attention pass.

The step attends in latent space (absorbed attention): with
`W = kv_b_proj.weight` viewed [H, dn + dv, r], `W_uk = W[:, :dn]`,
`W_uv = W[:, dn:]`,

    scores = scale * ((q_nope W_uk) . c + q_pe . k_pe)
    out    = softmax(scores) c W_uv^T

so earlier positions are never decompressed: r + dr values per position
(512 + 64 at DeepSeek-V3 shapes) instead of H x (dn + dr + dv). That is
multi-query attention of head dim r + dr over one key head, run by the
attention pass's explicit-softmax kernel one key block at a time (under a
DSA selection, over each query's selected positions only, gathered a block
of queries at a time: `_LatentOverSelection`). Gradients
of earlier positions' latent and rope key go to d(state) (exact mode);
`kv_b_proj` gets its gradient from both the query and the output side.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator

import torch
import torch.fx as fx

from longstraw.parallel.shards import by_rank, gather_round, gathered_rows, padded_to, shard_positions
from longstraw.parallel.partials import merge_partials, merge_scattered, merge_with_own
from longstraw.parallel.sharded_attention import round_attention, sharded_causal_attention
from longstraw.errors import LongStrawError
from longstraw.trace.functionalize import is_updated
from longstraw.runtime.kernels.attention import MATH, compute_dtype
from longstraw.analysis.mask_bands import band_of
from longstraw.nodes import arg, is_sdpa, op_name, tensor_of
from longstraw.runtime.prompt_state import StepContext

from .base import ArchitecturePass, SiteState, StepEmitter


@dataclasses.dataclass(frozen=True)
class LatentAttention:
    """A proved MLA attention: `latent` [B, 1, L, r] and `rope_key`
    [B, 1, L, dr] (any layout of B x L x features with size-1 dims between)
    are the state; `weight` is `kv_b_proj.weight` [H * (dn + dv), r]."""

    latent: fx.Node
    rope_key: fx.Node
    weight: fx.Node
    heads: int
    nope_dim: int
    value_dim: int
    scale: float


def _identity_source(node: fx.Node) -> fx.Node:
    """Walk up `contiguous`, `clone` and `cat([empty, x])` (HF's cache concatenation)."""
    while True:
        name = op_name(node)
        if name in ("contiguous", "clone"):
            node = node.args[0]
            continue
        if name == "cat":
            parts = [p for p in arg(node, 0, "tensors") if tensor_of(p).numel() > 0 or tensor_of(p).dim() > 1]
            if len(parts) == 1 and tuple(tensor_of(parts[0]).shape) == tuple(tensor_of(node).shape):
                node = parts[0]
                continue
        return node


def _last_dim(node: fx.Node, dim: object) -> bool:
    return dim in (-1, tensor_of(node).dim() - 1)


def _split_part(node: fx.Node) -> tuple[fx.Node, int] | None:
    """(split node, index) if `node` is `split(x, [a, b], dim=-1)[index]`."""
    if op_name(node) != "getitem" or not isinstance(node.args[1], int):
        return None
    split = node.args[0]
    if not isinstance(split, fx.Node) or op_name(split) not in ("split", "split_with_sizes"):
        return None
    sizes, dim = arg(split, 1, "split_size_or_sections", arg(split, 1, "split_sizes")), arg(split, 2, "dim", 0)
    if not isinstance(sizes, (list, tuple)) or len(sizes) != 2 or not _last_dim(split.args[0], dim):
        return None
    return split, node.args[1]


def _key_parts(key: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(nope, rope) when `key` is provably `[nope | rope]` along the last dim:
    `cat((nope, rope), -1)`, or HF's `new_empty` filled by two slice copies
    that together cover it (functionalized to `updated` nodes)."""
    if op_name(key) == "cat":
        parts = arg(key, 0, "tensors")
        if len(parts) == 2 and _last_dim(key, arg(key, 1, "dim", 0)):
            return parts[0], parts[1]
        return None
    width = tensor_of(key).shape[-1]
    writes: dict[tuple[int, int], fx.Node] = {}
    node = key
    while is_updated(node) and node.args[1] == "setitem" and len(writes) < 2:
        index, value = node.args[2], node.args[3]
        span = _last_dim_slice(index, width)
        source = _copied_source(value, node.args[0], index)
        if span is None or source is None or span in writes:
            return None
        writes[span] = source
        node = node.args[0]
    cut = [s for s in writes if s[0] == 0]
    if len(writes) != 2 or not cut or (cut[0][1], width) not in writes:
        return None
    return writes[cut[0]], writes[(cut[0][1], width)]


def _last_dim_slice(index: object, width: int) -> tuple[int, int] | None:
    """[start, stop) if `index` is `(..., slice(start, stop))` with step 1."""
    if not isinstance(index, tuple) or len(index) != 2 or index[0] is not Ellipsis or not isinstance(index[1], slice):
        return None
    s = index[1]
    if s.step not in (None, 1) or not all(v is None or isinstance(v, int) for v in (s.start, s.stop)):
        return None
    start, stop, _ = s.indices(width)
    return (start, stop) if start < stop else None


def _copied_source(value: fx.Node, target: fx.Node, index: object) -> fx.Node | None:
    """`src` if `value` is `target[index].copy_(src)` with `src` of the slice's
    exact shape and dtype (no broadcast, no cast)."""
    if not isinstance(value, fx.Node) or not is_updated(value) or value.args[1] != "copy_" or len(value.args) != 3:
        return None
    view, src = value.args[0], value.args[2]
    if op_name(view) != "getitem" or view.args[0] is not target or view.args[1] != index:
        return None
    if not isinstance(src, fx.Node):
        return None
    a, b = tensor_of(view), tensor_of(src)
    return src if a.shape == b.shape and a.dtype == b.dtype else None


def _causal(node: fx.Node) -> bool:
    """SDPA with `is_causal=True`, or with a positions-only mask proved causal
    (`band_of`: true exactly where the key is not after the query)."""
    mask, is_causal = arg(node, 3, "attn_mask"), arg(node, 5, "is_causal", False)
    if mask is None:
        return bool(is_causal)
    if is_causal or not isinstance(mask, fx.Node):
        return False  # band_of proves nothing of a mask that reads an input
    length = tensor_of(node.args[0]).shape[-2]
    return tuple(tensor_of(mask).shape[-2:]) == (length, length) and band_of(mask) == (0, math.inf)


def mla_of(node: fx.Node) -> LatentAttention | None:
    """The causal latent attention `node` computes, if the graph proves it (module docstring)."""
    found = latent_of(node)
    return found if found is not None and _causal(node) else None  # last: the mask proof walks its construction


def latent_of(node: fx.Node) -> LatentAttention | None:
    """The latent attention structure of `node` whatever its mask (`passes/sparse_index.py`
    proves a top-k selection mask, `mla_of` a causal one)."""
    if not is_sdpa(node):
        return None
    if arg(node, 4, "dropout_p", 0.0) != 0.0 or arg(node, 7, "enable_gqa", False):
        return None
    q, key, value = (tensor_of(a) for a in node.args[:3])
    if q.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return None
    batch, heads, length, qk_dim = q.shape
    if batch == length:  # the latent's batch and position order could not be told apart by shape
        return None
    value_part = _split_part(_identity_source(node.args[2]))
    parts = _key_parts(_identity_source(node.args[1]))
    if value_part is None or value_part[1] != 1 or parts is None:
        return None
    nope_part = _split_part(parts[0])
    split = value_part[0]
    if nope_part is None or nope_part != (split, 0):
        return None
    nope_dim, value_dim = arg(split, 1, "split_size_or_sections", arg(split, 1, "split_sizes"))
    rope_dim = qk_dim - nope_dim
    if rope_dim <= 0 or tuple(key.shape) != (batch, heads, length, qk_dim):
        return None
    if tuple(value.shape) != (batch, heads, length, value_dim):
        return None
    expanded = parts[1]
    if op_name(expanded) != "expand" or tuple(tensor_of(expanded).shape) != (batch, heads, length, rope_dim):
        return None
    rope_key = expanded.args[0]
    if tuple(tensor_of(rope_key).shape) != (batch, 1, length, rope_dim):
        return None
    transposed = split.args[0]
    if op_name(transposed) != "transpose" or {d % 4 for d in transposed.args[1:3]} != {1, 2}:
        return None
    viewed = transposed.args[0]
    viewed_shape = (batch, length, heads, nope_dim + value_dim)
    if op_name(viewed) not in ("view", "reshape") or tuple(tensor_of(viewed).shape) != viewed_shape:
        return None
    linear = viewed.args[0]
    if op_name(linear) != "linear" or arg(linear, 2, "bias") is not None:
        return None
    latent, weight = linear.args[0], linear.args[1]
    c, w = tensor_of(latent), tensor_of(weight)
    rank = c.shape[-1]
    if tuple(w.shape) != (heads * (nope_dim + value_dim), rank):
        return None
    # [B, (1,) L, r] in this order: the view to [B, L, H, dn + dv] reads rows batch-major
    if [d for d in c.shape[:-1] if d != 1] != [d for d in (batch, length) if d != 1]:
        return None
    scale = arg(node, 6, "scale")
    return LatentAttention(
        latent=latent, rope_key=rope_key, weight=weight, heads=heads, nope_dim=nope_dim, value_dim=value_dim,
        scale=1.0 / math.sqrt(qk_dim) if scale is None else float(scale),
    )


class LatentAttentionPass(ArchitecturePass):
    """SDPA proved to be MLA; the latent and the rope key are the state."""

    name = "latent_attention"
    overrides = ("causal_attention",)
    runs_rounds = True  # `round_attention` over `LatentKeys`, the own keys `[latent | rope key]`

    def claims(self, node: fx.Node) -> bool:
        return mla_of(node) is not None

    def position_dims(self, node: fx.Node) -> tuple[tuple[fx.Node, int], tuple[fx.Node, int]]:
        q = node.args[0]
        return (q, 2), (q, 0)

    def positional_inputs(self, node: fx.Node) -> list[fx.Node]:
        mask = arg(node, 3, "attn_mask")
        return [mask] if isinstance(mask, fx.Node) else []  # proved causal: the step builds its own

    def state_inputs(self, node: fx.Node) -> list[fx.Node]:
        found = mla_of(node)
        return [found.latent, found.rope_key]

    def emit_step(self, emitter: StepEmitter, node: fx.Node, sites: list[SiteState]) -> fx.Node:
        found = mla_of(node)
        latent_site, rope_site = sites
        kwargs = {
            "latent_slot": latent_site.slot,
            "rope_slot": rope_site.slot,
            "nope_dim": found.nope_dim,
            "scale": found.scale,
        }
        args = (emitter.ctx, *emitter.mapped((node.args[0], latent_site.cut, rope_site.cut, found.weight)))
        return emitter.graph.call_function(latent_attention_step, args, kwargs)


class _LatentOverState(torch.autograd.Function):
    """Causal multi-query attention of the absorbed queries over `[latent |
    rope key]` at positions `[0, o + n)`, values the latent: earlier
    positions are read from the state buffers, the step's own from
    `latent`, `rope_key`.

    The keys `[T, r + dr]` (one layer's state, no head axis) are assembled
    in forward and again in backward, never kept between them; the
    explicit-softmax kernel of the attention pass walks them in blocks, so
    no step holds all its scores. Backward: d(latent) = dK[:r] + dV, d(rope key) = dK[r:]; earlier
    positions' go to d(state) (exact mode)."""

    @staticmethod
    def forward(ctx, step: StepContext, query, latent, rope_key, latent_slot: int, rope_slot: int, scale: float):
        keys = _keys(step, latent_slot, rope_slot, latent, rope_key)
        rank = latent.shape[-1]
        out, lse = MATH.forward(query, keys, keys[..., :rank], None, scale, step.offset)
        ctx.step, ctx.slots, ctx.scale = step, (latent_slot, rope_slot), scale
        ctx.save_for_backward(query, latent, rope_key, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        step: StepContext = ctx.step
        query, latent, rope_key, out, lse = ctx.saved_tensors
        keys = _keys(step, *ctx.slots, latent, rope_key)  # rebuilt: a saved copy is a layer's state
        rank, o = latent.shape[-1], step.offset
        grad_out = grad_out.contiguous()
        grad_q = torch.zeros(query.shape, dtype=compute_dtype(query), device=query.device)
        grad_keys = torch.zeros(keys.shape[-2:], dtype=compute_dtype(query), device=query.device)  # [T, r + dr]
        for start, length in MATH.blocks(query, o):
            block = keys.narrow(-2, start, length)
            gq, gk, gv = MATH.backward(grad_out, query, block, block[..., :rank], out, lse, None, ctx.scale, o, start)
            grad_q += gq
            grad_keys.narrow(0, start, length).copy_(gk[0, 0])
            grad_keys.narrow(0, start, length)[:, :rank] += gv[0, 0]
        grad_latent, grad_rope = _route_key_grads(step, ctx.slots, grad_keys.to(keys.dtype), latent, rope_key)
        return None, grad_q.to(query.dtype), grad_latent, grad_rope, None, None, None


SELECTED_BLOCK_ELEMENTS = 1 << 27  # selected keys gathered at once: query rows x k x (r + dr)


class _LatentOverSelection(torch.autograd.Function):
    """`_LatentOverState` where each query reads only the positions listed
    for it (`positions` [n, k], `valid` [n, k]; DSA's top-k selection):
    the work is n x k pairs, not n x (o + n). A block of query rows gathers
    its selected keys [rows, k, r + dr] from the layer's keys, so every
    product is one batched matmul over the block (`SELECTED_BLOCK_ELEMENTS`
    bounds the gathered keys); backward gathers them again and scatters
    their gradients back with `index_add_` (`_selected_forward`,
    `_selected_backward`)."""

    @staticmethod
    def forward(ctx, step: StepContext, query, latent, rope_key, latent_slot: int, rope_slot: int, scale: float,
                positions, valid):
        keys = _keys(step, latent_slot, rope_slot, latent, rope_key)[0, 0]
        out, lse = _selected_forward(query, keys, positions, valid, latent.shape[-1], scale)
        out = out.transpose(0, 1)[None].to(query.dtype)  # [1, H, n, r]
        ctx.step, ctx.slots, ctx.scale = step, (latent_slot, rope_slot), scale
        ctx.save_for_backward(query, latent, rope_key, out, lse, positions, valid)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        step: StepContext = ctx.step
        query, latent, rope_key, out, lse, positions, valid = ctx.saved_tensors
        keys = _keys(step, *ctx.slots, latent, rope_key)[0, 0]
        grad_keys = torch.zeros(keys.shape, dtype=compute_dtype(query), device=query.device)  # [T, r + dr]
        grad_q = _selected_backward(query, keys, positions, valid, ctx.scale, grad_out, out, lse, grad_keys)
        grad_latent, grad_rope = _route_key_grads(step, ctx.slots, grad_keys.to(keys.dtype), latent, rope_key)
        return None, grad_q.transpose(0, 1)[None].to(query.dtype), grad_latent, grad_rope, None, None, None, None, None


class _ShardedLatentOverSelection(torch.autograd.Function):
    """`_LatentOverSelection` under context parallelism: each rank attends
    over the picks in its share of the earlier positions, the partials are
    merged across the ranks (`context_parallel.merge_partials`), then with
    the partial over the picks among the step's own positions, which every
    rank holds. Backward: the share's key gradients go to this rank's
    d(state), its dQ are summed over the ranks."""

    @staticmethod
    def forward(ctx, step: StepContext, query, latent, rope_key, latent_slot: int, rope_slot: int, scale: float,
                positions, valid):
        rank, n = latent.shape[-1], query.shape[-2]
        shard_keys, shard_index, shard_valid = _shard_picks(step, (latent_slot, rope_slot), rank, positions, valid)
        out, lse = _selected_forward(query, shard_keys, shard_index, shard_valid, rank, scale)
        out, lse = merge_partials(out.transpose(0, 1), lse.transpose(0, 1), step.state.shard.ranks)  # [H, n, ...]
        own_keys = torch.cat([latent.reshape(n, rank), rope_key.reshape(n, -1)], -1)
        own_index, own_valid = (positions - step.offset).clamp(min=0), valid & (positions >= step.offset)
        own, own_lse = _selected_forward(query, own_keys, own_index, own_valid, rank, scale)
        out, total = merge_with_own(out, lse, own.transpose(0, 1), own_lse.transpose(0, 1))
        out = out[None].to(query.dtype)  # [1, H, n, r]
        ctx.step, ctx.slots, ctx.scale = step, (latent_slot, rope_slot), scale
        ctx.save_for_backward(query, latent, rope_key, out, total.transpose(0, 1), positions, valid)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        step: StepContext = ctx.step
        query, latent, rope_key, out, lse, positions, valid = ctx.saved_tensors
        rank, n, compute = latent.shape[-1], query.shape[-2], compute_dtype(query)
        shard_keys, shard_index, shard_valid = _shard_picks(step, ctx.slots, rank, positions, valid)
        grad_shard = torch.zeros(shard_keys.shape, dtype=compute, device=query.device)
        grad_q = _selected_backward(query, shard_keys, shard_index, shard_valid, ctx.scale, grad_out, out, lse, grad_shard)
        step.state.shard.ranks.all_reduce(grad_q)
        if step.state.shard.held_before(step.offset) > 0:  # the share holds earlier positions: their d(state)
            LatentKeys(*ctx.slots, rank).accumulate(step, grad_shard.to(shard_keys.dtype)[None, None], None, 0)
        own_keys = torch.cat([latent.reshape(n, rank), rope_key.reshape(n, -1)], -1)
        own_index, own_valid = (positions - step.offset).clamp(min=0), valid & (positions >= step.offset)
        grad_own = torch.zeros(own_keys.shape, dtype=compute, device=query.device)
        grad_q += _selected_backward(query, own_keys, own_index, own_valid, ctx.scale, grad_out, out, lse, grad_own)
        grad_own = grad_own.to(latent.dtype)
        grad_latent, grad_rope = grad_own[:, :rank].reshape(latent.shape), grad_own[:, rank:].reshape(rope_key.shape)
        return None, grad_q.transpose(0, 1)[None].to(query.dtype), grad_latent, grad_rope, None, None, None, None, None


class _RoundLatentOverSelection(torch.autograd.Function):
    """`_ShardedLatentOverSelection` for this rank's chunk of a round. The
    keys a rank holds are its share before the round and its own chunk
    (`_held_keys`), and every pick of the round's queries is in exactly one
    rank's: the round's queries and picks are gathered, each rank attends
    every chunk's queries over the picks it holds, and the W partials are
    merged across the ranks, each keeping its chunk's. Backward the same way
    round: the queries, output gradients, outputs and log-sum-exps are
    gathered, each rank differentiates every chunk's picks among its keys
    (the share's into d(state), its chunk's to its latent and rope key)
    and the partial dQs are summed, each keeping its chunk's."""

    @staticmethod
    def forward(ctx, step: StepContext, query, latent, rope_key, latent_slot: int, rope_slot: int, scale: float,
                positions, valid):
        rank, n, round_ = latent.shape[-1], query.shape[-2], step.round
        ranks = step.state.shard.ranks
        keys = _held_keys(step, (latent_slot, rope_slot), rank, latent, rope_key)
        picks = gather_round(torch.where(valid, positions, -1), 0, round_, ranks)
        outs, lses = [], []
        for j, (q, chosen) in enumerate(zip(gather_round(query, -2, round_, ranks), picks)):
            out, lse = _selected_forward(q, keys, *_held_picks(step, j, chosen, keys.shape[0] - n), rank, scale)
            outs.append(padded_to(out.transpose(0, 1), 1, round_.longest))  # [H, longest, r]
            lses.append(padded_to(lse.transpose(0, 1), 1, round_.longest, float("-inf")))
        out, lse = merge_scattered(by_rank(outs, round_), by_rank(lses, round_), ranks)
        out, lse = out[:, :, :n].to(query.dtype), lse[0, :, :n].transpose(0, 1)  # [1, H, n, r], [n, H]
        ctx.step, ctx.slots, ctx.scale = step, (latent_slot, rope_slot), scale
        ctx.save_for_backward(query, latent, rope_key, out, lse, positions, valid)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        step: StepContext = ctx.step
        query, latent, rope_key, out, lse, positions, valid = ctx.saved_tensors
        rank, n, round_, compute = latent.shape[-1], query.shape[-2], step.round, compute_dtype(query)
        ranks = step.state.shard.ranks
        keys = _held_keys(step, ctx.slots, rank, latent, rope_key)
        picks = gather_round(torch.where(valid, positions, -1), 0, round_, ranks)
        lses = gather_round(lse, 0, round_, ranks)
        grad_keys = torch.zeros(keys.shape, dtype=compute, device=query.device)
        # the partial dQs of every chunk's queries, in the order of their ranks (a reduce-scatter's)
        grad_qs = torch.zeros(len(round_.chunks), round_.longest, query.shape[1], query.shape[-1], dtype=compute,
                              device=query.device)
        rows = gathered_rows(query, grad_out, out, round_, ranks)
        for j, ((q, g, o), row_lse, chosen) in enumerate(zip(rows, lses, picks)):
            index, held = _held_picks(step, j, chosen, keys.shape[0] - n)
            grad_qs[round_.owners[j], :q.shape[-2]] = _selected_backward(q, keys, index, held, ctx.scale, g, o, row_lse,
                                                                           grad_keys)
        grad_q = grad_qs.new_empty(1, *grad_qs.shape[1:])
        ranks.reduce_scatter(grad_q, grad_qs)
        share = keys.shape[0] - n
        if share > 0:  # this rank's positions before the round: their d(state)
            LatentKeys(*ctx.slots, rank).accumulate(step, grad_keys[:share].to(keys.dtype)[None, None], None, 0)
        grad_own = grad_keys[share:].to(latent.dtype)
        grad_latent, grad_rope = grad_own[:, :rank].reshape(latent.shape), grad_own[:, rank:].reshape(rope_key.shape)
        grad_q = grad_q[0, :n].transpose(0, 1)[None].to(query.dtype)
        return None, grad_q, grad_latent, grad_rope, None, None, None, None, None


def _held_keys(
    step: StepContext, slots: tuple[int, int], rank: int, latent: torch.Tensor, rope_key: torch.Tensor
) -> torch.Tensor:
    """[m + n, r + dr]: this rank's keys `[latent | rope key]` in its share
    before the round (m), then its own chunk's (n, under autograd)."""
    share = LatentKeys(*slots, rank).read(step, 0, step.state.shard.held_before(step.round.start))[0][0, 0]
    n = latent.reshape(-1, rank).shape[0]
    return torch.cat([share, torch.cat([latent.reshape(n, rank), rope_key.reshape(n, -1)], -1).to(share.dtype)])


def _held_picks(step: StepContext, j: int, picks: torch.Tensor, share: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices into `_held_keys` of the picks (positions [n, k], -1: none)
    of the round's chunk `j` that this rank holds, and which those are (a
    branch's picks among its own positions are its own rank's)."""
    shard, round_ = step.state.shard, step.round
    offset, length = round_.chunks[round_.index]
    local, in_share = shard.to_local(picks.clamp(min=0))
    in_share = in_share & (picks >= 0) & (picks < round_.start)
    in_own = (picks >= offset) & (picks < offset + length) & round_.sees(j)
    return torch.where(in_share, local, torch.where(in_own, share + picks - offset, 0)), in_share | in_own


def _shard_picks(
    step: StepContext, slots: tuple[int, int], rank: int, positions: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's keys `[latent | rope key]` before the step ([m, r + dr];
    one row of zeros that no pick reads when there are none), and the
    picks among them: indices into them and which picks they are."""
    shard = step.state.shard
    keys = LatentKeys(*slots, rank).read(step, 0, shard.held_before(step.offset))[0][0, 0]
    if keys.shape[0] == 0:
        keys = keys.new_zeros(1, keys.shape[-1])
    local, held = shard.to_local(positions)
    inside = valid & held & (positions < step.offset)
    return keys, torch.where(inside, local, 0), inside


def _selected_forward(
    query: torch.Tensor, keys: torch.Tensor, index: torch.Tensor, valid: torch.Tensor, rank: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of `query` [1, H, n, r + dr] over the rows `index` [n, k]
    of `keys` [T, r + dr] where `valid`, values the first `rank` features:
    out [n, H, r] and lse [n, H] in the compute dtype (a row with no valid
    pick: 0 and -inf)."""
    out = torch.empty(query.shape[2], query.shape[1], rank, dtype=compute_dtype(query), device=query.device)
    lse = torch.empty(out.shape[:2], dtype=out.dtype, device=query.device)
    with _products_exact_for(query.dtype):
        for rows in _row_blocks(index.shape, keys.shape[-1]):
            q, selected, s = _selected_scores(query, keys, index, valid, rows, scale)
            lse[rows] = s.logsumexp(-1)
            p = torch.exp(s - torch.where(lse[rows].isneginf(), 0.0, lse[rows])[..., None])
            out[rows] = torch.bmm(p, selected[..., :rank])
    return out, lse


def _selected_backward(
    query: torch.Tensor, keys: torch.Tensor, index: torch.Tensor, valid: torch.Tensor, scale: float,
    grad_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, grad_keys: torch.Tensor,
) -> torch.Tensor:
    """dQ [n, H, r + dr] of `_selected_forward`'s picks, given the whole
    row's output `out` [1, H, n, r] and `lse` [n, H] (a block's gradients
    are exact with them); the picked keys' gradients are added into
    `grad_keys` [T, r + dr] (d(latent) in its first r features: dK + dV)."""
    rank, compute = out.shape[-1], compute_dtype(query)
    grad_q = torch.empty(query.shape[2], query.shape[1], query.shape[3], dtype=compute, device=query.device)
    with _products_exact_for(query.dtype):
        for rows in _row_blocks(index.shape, keys.shape[-1]):
            q, selected, s = _selected_scores(query, keys, index, valid, rows, scale)
            p = torch.exp(s - lse[rows, :, None])  # [b, H, k]
            do = grad_out[0, :, rows].transpose(0, 1).to(compute)  # [b, H, r]
            o = out[0, :, rows].transpose(0, 1).to(compute)
            ds = p * (torch.bmm(do, selected[..., :rank].transpose(1, 2)) - (do * o).sum(-1, keepdim=True))
            grad_q[rows] = torch.bmm(ds, selected) * scale
            grad_selected = torch.bmm(ds.transpose(1, 2), q) * scale  # [b, k, r + dr]
            grad_selected[..., :rank] += torch.bmm(p.transpose(1, 2), do)
            grad_keys.index_add_(0, index[rows].flatten(), grad_selected.flatten(0, 1))
    return grad_q


def _row_blocks(selected: torch.Size, width: int) -> list[slice]:
    """Blocks of query rows whose gathered keys [rows, k, width] stay within `SELECTED_BLOCK_ELEMENTS`."""
    n, k = selected
    rows = max(1, SELECTED_BLOCK_ELEMENTS // max(1, k * width))
    return [slice(r, min(n, r + rows)) for r in range(0, n, rows)]


@contextlib.contextmanager
def _products_exact_for(dtype: torch.dtype) -> Iterator[None]:
    """The block's float32 matrix products on CUDA's TF32 units when the
    model runs in 16 bits: its queries, keys and output gradients come from
    fp16/bf16 values, which TF32's 10-bit mantissa holds exactly, so their
    products are the ones 16-bit matrix units would form, accumulated in
    float32 (as SDPA's kernels do for eager); the softmax probabilities and
    score gradients round to 10 bits (flash attention rounds them to 16-bit
    operands). A float32 or float64 model keeps full-precision products."""
    if dtype not in (torch.float16, torch.bfloat16):
        yield
        return
    matmul = torch.backends.cuda.matmul
    before, matmul.allow_tf32 = matmul.allow_tf32, True
    try:
        yield
    finally:
        matmul.allow_tf32 = before


def _selected_scores(
    query: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, rows: slice, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For the query rows `rows`: their queries [b, H, r + dr] and selected
    keys [b, k, r + dr] in the compute dtype, and the scaled scores
    [b, H, k], -inf where a pick is not a key."""
    compute = compute_dtype(query)
    q = query[0, :, rows].transpose(0, 1).to(compute)
    picked = positions[rows]
    selected = keys.index_select(0, picked.flatten()).view(*picked.shape, keys.shape[-1]).to(compute)
    s = torch.bmm(q, selected.transpose(1, 2)) * scale
    return q, selected, s.masked_fill(~valid[rows, None, :], float("-inf"))


def _route_key_grads(
    step: StepContext, slots: tuple[int, int], grad_keys: torch.Tensor, latent: torch.Tensor, rope_key: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split d[latent | rope key] over `[0, o + n)`: earlier positions' into
    d(state) (exact mode), the step's own returned as (d latent, d rope key)."""
    latent_slot, rope_slot = slots
    rank, o = latent.shape[-1], step.offset
    if o > 0:
        step.accumulate_grad(latent_slot, slot_layout(step, latent_slot, grad_keys[:o, :rank]), 0)
        step.accumulate_grad(rope_slot, slot_layout(step, rope_slot, grad_keys[:o, rank:]), 0)
    own = grad_keys[o:]
    return own[:, :rank].reshape(latent.shape), own[:, rank:].reshape(rope_key.shape)


@dataclasses.dataclass(frozen=True)
class LatentKeys:
    """Context parallelism's `ShardKeys` for MLA: keys `[latent | rope key]`
    of one head, values the latent, read from the rank's share of the two
    slots; d(latent) = dK[:r] + dV, d(rope key) = dK[r:]."""

    latent_slot: int
    rope_slot: int
    rank: int

    @property
    def slot(self) -> int:
        return self.latent_slot

    def read(self, step: StepContext, begin: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [flat_positions(step, slot, shard_positions(step, slot, begin, end))
                 for slot in (self.latent_slot, self.rope_slot)]
        keys = torch.cat(parts, -1)[None, None]
        return keys, keys[..., :self.rank]

    def accumulate(self, step: StepContext, grad_k: torch.Tensor, grad_v: torch.Tensor | None, local: int) -> None:
        """`grad_v` None: `grad_k`'s latent part holds dK + dV already."""
        grad = grad_k[0, 0]
        latent = grad[:, :self.rank] if grad_v is None else grad[:, :self.rank] + grad_v[0, 0]
        step.accumulate_shard_grad(self.latent_slot, slot_layout(step, self.latent_slot, latent), local)
        step.accumulate_shard_grad(self.rope_slot, slot_layout(step, self.rope_slot, grad[:, self.rank:]), local)


def _keys(
    step: StepContext, latent_slot: int, rope_slot: int, latent: torch.Tensor, rope_key: torch.Tensor
) -> torch.Tensor:
    """[1, 1, o + n, r + dr]: the state's earlier positions, then the step's own
    (never read back from the buffers, which other branches overwrite)."""
    o, n = step.offset, step.length
    earlier_c = flat_positions(step, latent_slot, step.visible(latent_slot)).narrow(0, 0, o)
    earlier_pe = flat_positions(step, rope_slot, step.visible(rope_slot)).narrow(0, 0, o)
    c = torch.cat([earlier_c, latent.reshape(n, -1)])
    k_pe = torch.cat([earlier_pe, rope_key.reshape(n, -1)])
    return torch.cat([c, k_pe], -1)[None, None]


def flat_positions(step: StepContext, slot: int, value: torch.Tensor) -> torch.Tensor:
    """[positions, features] of a slot-layout tensor whose other dims are all 1."""
    token_dim = step.state.slots[slot].token_dim
    positions = value.shape[token_dim]
    if value.numel() != positions * value.shape[-1] or token_dim == value.dim() - 1:
        raise LongStrawError(f"latent attention: state {tuple(value.shape)} is not one row of positions x features")
    return value.reshape(positions, value.shape[-1])


def slot_layout(step: StepContext, slot: int, flat: torch.Tensor) -> torch.Tensor:
    """`flat` [m, features] in the slot's layout (the inverse of `flat_positions`)."""
    shape = list(step.state.slots[slot].shape)
    shape[step.state.slots[slot].token_dim] = flat.shape[0]
    return flat.reshape(shape)


def latent_attention_step(
    ctx: StepContext,
    q: torch.Tensor,
    latent: torch.Tensor,
    rope_key: torch.Tensor,
    weight: torch.Tensor,
    *,
    latent_slot: int,
    rope_slot: int,
    nope_dim: int,
    scale: float,
) -> torch.Tensor:
    """Absorbed causal attention of the step's queries `q` [1, H, n, dn + dr]
    over positions `[0, o + n)` of the latent and the rope key; returns
    [1, H, n, dv] like the SDPA it replaces."""
    return absorbed_attention(ctx, q, latent, rope_key, weight, latent_slot, rope_slot, nope_dim, scale)


def absorbed_attention(
    ctx: StepContext, q: torch.Tensor, latent: torch.Tensor, rope_key: torch.Tensor, weight: torch.Tensor,
    latent_slot: int, rope_slot: int, nope_dim: int, scale: float,
    selected: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Latent-space attention over `[0, o + n)`: causal, or where `selected`
    is given (positions [n, k], valid [n, k]), over those positions only."""
    heads, rank = q.shape[1], latent.shape[-1]
    w = weight.view(heads, -1, rank)  # [H, dn + dv, r]
    q_latent = torch.einsum("bhnd,hdr->bhnr", q[..., :nope_dim], w[:, :nope_dim])
    query = torch.cat([q_latent, q[..., nope_dim:]], -1)  # [1, H, n, r + dr]
    if selected is None and ctx.state.shard is not None:  # context parallelism: the state is sharded
        n = query.shape[-2]
        own = torch.cat([latent.reshape(1, 1, n, rank), rope_key.reshape(1, 1, n, -1)], -1)
        keys = LatentKeys(latent_slot, rope_slot, rank)
        sharded = round_attention if ctx.round is not None else sharded_causal_attention  # a round: this rank's chunk
        out = sharded(ctx, query, own, own[..., :rank], keys, scale, 0, ctx.offset + n)
    elif selected is None:
        out = _LatentOverState.apply(ctx, query, latent, rope_key, latent_slot, rope_slot, scale)
    elif ctx.round is not None:
        out = _RoundLatentOverSelection.apply(ctx, query, latent, rope_key, latent_slot, rope_slot, scale, *selected)
    elif ctx.state.shard is not None:
        out = _ShardedLatentOverSelection.apply(ctx, query, latent, rope_key, latent_slot, rope_slot, scale, *selected)
    else:
        out = _LatentOverSelection.apply(ctx, query, latent, rope_key, latent_slot, rope_slot, scale, *selected)
    return torch.einsum("bhnr,hvr->bhnv", out, w[:, nope_dim:])
