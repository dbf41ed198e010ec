"""Latent attention kernels: MLA's absorbed queries over the state's
`[latent | rope key]` keys, values the latent.

The MLA pass (`passes/mla.py`) and the DSA pass (`passes/sparse_index.py`)
both emit `absorbed_attention`; this module is what they share. Causal
attention walks the keys a block at a time with the attention kernels'
explicit softmax (`_LatentOverState`); under a DSA selection each query reads
only its picks, gathered a block of queries at a time (`_LatentOverSelection`
and its context-parallel forms). `LatentKeys` is how context parallelism
reads a rank's share of the two slots and routes their gradients.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch

from longstraw.errors import LongStrawError
from longstraw.parallel.partials import merge_partials, merge_scattered, merge_with_own
from longstraw.parallel.sharded_attention import round_attention, sharded_causal_attention
from longstraw.parallel.shards import by_rank, gather_round, gathered_rows, padded_to, shard_positions
from longstraw.runtime.kernels.attention import MATH, compute_dtype
from longstraw.runtime.prompt_state import StepContext


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
