"""Context parallelism (issue 18): the prompt's per-position state sharded
over ranks, and the work over its positions divided among them.

`sharded_attention` is the building block: attention of replicated
queries over keys and values sharded across ranks. Each rank computes the
attention over its own keys (output and log-sum-exp, the explicit softmax
kernel in at least float32), and the ranks merge those partials by their
log-sum-exp: two all-reduces, the largest log-sum-exp, then the weighted
outputs and weights in one tensor. The merged output and log-sum-exp are
those of the whole row, so each rank's backward over its own keys gives the
exact dK/dV of its shard (kept local) and its part of dQ (summed over the
ranks, since q is replicated).

The runtime (`Options.context_parallel`) keeps on rank r only its share of
the prompt positions in the sequence slots' buffers (`PromptShard`). The
capture and exact mode's reverse pass run in rounds where they can
(`GroupRunner._rounds`): W consecutive chunks, one per rank, at once,
each rank computing only its own (`round_attention`: partials over the
shares merged by log-sum-exp, the queries travelling in backward; carried
operators run over the whole round on every rank, so carries stay
replicated), and the rounds' parameter gradients, each rank's part, are
summed over the group once (`summed_over_ranks`). The branches run in
rounds too, each rank one row of W (`GroupRunner._branch_turns`: the same
`round_attention`, no branch reading another's keys). The chunks outside
rounds run on every rank on the same inputs (`sharded_causal_attention`
merges the partials over the shards of the positions before the step
with its own causal keys); their gradients are the same on every rank and
counted once. In exact mode d(state) is sharded like the state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from longstraw.errors import InputError, LongStrawError
from longstraw.runtime.kernels.attention import MATH, AttentionKernel, compute_dtype, kernel_for
from longstraw.parallel.ranks import Ranks, raised_on_every_rank
from longstraw.runtime.state import ChunkRound, PromptState, StepContext

if TYPE_CHECKING:  # options import the passes, whose steps import this module
    from longstraw.options import Options


def sharded_attention(
    q: torch.Tensor,
    local_k: torch.Tensor,
    local_v: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of `q` over the keys of every rank in `group`, on every rank.

    q: [B, Hq, n, D], the same on every rank; local_k, local_v: [B, Hkv, m_r, D],
    this rank's shard (m_r may differ between ranks and be 0; Hq a multiple
    of Hkv). Equals SDPA (non-causal, `enable_gqa`) over the shards
    concatenated in rank order. The gradient arriving at the output must be
    the same on every rank (what follows is replicated too): dQ is then the
    whole query gradient on every rank, dK/dV that of this rank's shard.
    A row with no key anywhere gives 0, as the kernels do for a row that
    sees nothing."""
    k, v = local_k, local_v
    grouped = k.dim() == 4 and q.shape[1] % k.shape[1] == 0
    if q.dim() != 4 or not grouped or k.shape[:-1] != v.shape[:-1] or (k.shape[0], k.shape[-1]) != (q.shape[0], q.shape[-1]):
        raise ValueError(
            "sharded_attention: q [B, Hq, n, D] with Hq a multiple of Hkv, k and v [B, Hkv, m, D]; "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    return _ShardedAttention.apply(q, k, v, Ranks(group), scale)


class _ShardedAttention(torch.autograd.Function):
    """Forward: local partial, merged across the ranks. Backward: the
    explicit-softmax kernel's block backward over the local keys with the
    merged output and log-sum-exp, dQ all-reduced."""

    @staticmethod
    def forward(ctx, q, k, v, ranks, scale):
        qc = q.to(compute_dtype(q))  # the partial output stays in the compute dtype until merged
        out, lse = MATH.forward(qc, k, v, None, scale, k.shape[-2])  # q_start past every key: no mask
        out, lse = merge_partials(out, lse, ranks)
        ctx.ranks, ctx.scale, ctx.dtype = ranks, scale, q.dtype
        ctx.save_for_backward(qc, k, v, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        qc, k, v, out, lse = ctx.saved_tensors
        m = k.shape[-2]
        grad_out = grad_out.contiguous()
        grad_q = torch.zeros_like(qc)
        grad_k, grad_v = torch.zeros_like(k), torch.zeros_like(v)
        for start, length in MATH.earlier_blocks(qc, m):
            gq, gk, gv = MATH.backward(
                grad_out, qc, k.narrow(-2, start, length), v.narrow(-2, start, length), out, lse, None, ctx.scale, m, start
            )
            grad_q += gq
            grad_k.narrow(-2, start, length).copy_(gk)
            grad_v.narrow(-2, start, length).copy_(gv)
        ctx.ranks.all_reduce(grad_q)
        return grad_q.to(ctx.dtype), grad_k, grad_v, None, None


def merge_partials(out: torch.Tensor, lse: torch.Tensor, ranks: Ranks) -> tuple[torch.Tensor, torch.Tensor]:
    """The ranks' partials (out [B, Hq, n, D], lse [B, Hq, n]) merged by
    log-sum-exp: weights exp(lse_r - max_r lse_r), shifted by the maximum so
    that none overflows; an empty shard's lse is -inf, weight 0."""
    top, sums = _weighted(out, lse, ranks)
    ranks.all_reduce(sums)
    return _normalised(sums, top)


def merge_scattered(out: torch.Tensor, lse: torch.Tensor, ranks: Ranks) -> tuple[torch.Tensor, torch.Tensor]:
    """`merge_partials` of a round's partials: out [W, ..., D] and lse
    [W, ...] hold this rank's partial for every rank's queries, in rank
    order, and each rank gets its own merged [1, ..., D] and [1, ...]. The
    largest log-sum-exp by an all-reduce (no D), the weighted sums by a
    reduce-scatter: over NCCL 1/W of an all-reduce's data."""
    top, sums = _weighted(out, lse, ranks)
    mine = sums.new_empty(1, *sums.shape[1:])
    ranks.reduce_scatter(mine, sums)
    return _normalised(mine, top[ranks.rank:ranks.rank + 1])


def _weighted(out: torch.Tensor, lse: torch.Tensor, ranks: Ranks) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest log-sum-exp over the ranks, and this rank's partial
    weighted by it: [out * w, w] as one tensor, so one collective sums both."""
    top = lse.clone()
    ranks.all_reduce(top, dist.ReduceOp.MAX)
    top = torch.where(top.isneginf(), 0.0, top)  # rows no rank has a key for
    weight = torch.exp(lse - top)
    return top, torch.cat([out * weight[..., None], weight[..., None]], dim=-1)


def _normalised(sums: torch.Tensor, top: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The merged output and log-sum-exp from the summed [out * w, w]."""
    total, norm = sums[..., :-1], sums[..., -1]
    return total / torch.where(norm > 0, norm, 1.0)[..., None], top + torch.log(norm)


def by_rank(per_chunk: Sequence[torch.Tensor], round_: ChunkRound) -> torch.Tensor:
    """A round's per-chunk tensors (position order) stacked in the order of
    their chunks' ranks, for `merge_scattered` and a reduce-scatter."""
    return torch.stack([per_chunk[round_.owners.index(rank)] for rank in range(len(round_.owners))])


@dataclasses.dataclass(frozen=True)
class PromptShard:
    """This rank's share of the prompt positions: whole prompt chunks,
    assigned by `ChunkSchedule.shares` so that every rank holds about as many
    positions and computes about as much attention. The sequence buffers
    hold the share's chunks back to back in position order, so a buffer
    index ("local") grows with the position and the share's positions in
    any interval `[a, b)` are one run of buffer indices."""

    ranks: Ranks
    chunks: tuple[tuple[tuple[int, int], ...], ...]  # per rank: its chunks (offset, length), in position order

    @property
    def rank(self) -> int:
        return self.ranks.rank

    @property
    def size(self) -> int:
        """Positions this rank holds (the sequence buffers' length)."""
        return sum(length for _, length in self.chunks[self.rank])

    def owner(self, position: int) -> int:
        """The rank whose share holds `position` (a prompt position)."""
        return next(r for r, held in enumerate(self.chunks) if any(o <= position < o + n for o, n in held))

    def held_before(self, position: int) -> int:
        """How many of this rank's positions are before `position`: the
        buffer index of its first position at or after `position`."""
        return sum(min(n, max(position - o, 0)) for o, n in self.chunks[self.rank])

    def local_range(self, first: int, last: int) -> tuple[int, int]:
        """The buffer indices `[begin, end)` of this rank's positions in `[first, last)` (empty: begin == end)."""
        begin = self.held_before(first)
        return begin, max(begin, self.held_before(last))

    def to_global(self, local: torch.Tensor) -> torch.Tensor:
        """The prompt positions of buffer indices `local` (an integer tensor)."""
        starts, offsets = self._runs(local.device)
        run = torch.searchsorted(starts, local, right=True) - 1
        return local - starts[run] + offsets[run]

    def to_local(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Buffer indices of prompt `positions` and whether this rank holds
        them (the index is 0 where it does not)."""
        starts, offsets = self._runs(positions.device)
        lengths = torch.tensor([n for _, n in self.chunks[self.rank]] or [0], device=positions.device)
        run = (torch.searchsorted(offsets, positions, right=True) - 1).clamp(min=0)
        inside = positions - offsets[run]
        held = (inside >= 0) & (inside < lengths[run])
        return torch.where(held, starts[run] + inside, 0), held

    def _runs(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Per chunk of this rank: its first buffer index and its first position."""
        held = self.chunks[self.rank] or ((0, 0),)
        starts = [sum(n for _, n in held[:i]) for i in range(len(held))]
        return torch.tensor(starts, device=device), torch.tensor([o for o, _ in held], device=device)

    def broadcast_chunk(self, local: torch.Tensor, token_dim: int, offset: int, length: int) -> torch.Tensor:
        """Positions `[offset, offset+length)` (a prompt chunk) of a sharded
        tensor (`local` holds this rank's share), from its owner to every rank."""
        owner = self.owner(offset)
        if owner == self.rank:
            chunk = local.narrow(token_dim, self.held_before(offset), length).contiguous()
        else:
            shape = list(local.shape)
            shape[token_dim] = length
            chunk = torch.empty(shape, dtype=local.dtype, device=local.device)
        self.ranks.broadcast(chunk, owner)
        return chunk


class ShardKeys(Protocol):
    """Where a sharded attention's earlier keys and values live in the state."""

    @property
    def slot(self) -> int:
        """The state slot that names this attention (`attention_outputs_on_host` keeps its outputs under it)."""

    def read(self, step: StepContext, begin: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [1, Hkv, end - begin, D] at buffer indices `[begin, end)` of this rank's share."""

    def accumulate(self, step: StepContext, grad_k: torch.Tensor, grad_v: torch.Tensor, local: int) -> None:
        """Add their gradients, from buffer index `local` on, to d(state)."""


@dataclasses.dataclass(frozen=True)
class SlotKeys:
    """Attention's keys and values: one sequence slot each."""

    k_slot: int
    v_slot: int

    @property
    def slot(self) -> int:
        return self.k_slot

    def read(self, step: StepContext, begin: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(shard_positions(step, slot, begin, end) for slot in (self.k_slot, self.v_slot))

    def accumulate(self, step: StepContext, grad_k: torch.Tensor, grad_v: torch.Tensor, local: int) -> None:
        step.accumulate_shard_grad(self.k_slot, grad_k, local)
        step.accumulate_shard_grad(self.v_slot, grad_v, local)


def shard_positions(step: StepContext, slot: int, begin: int, end: int) -> torch.Tensor:
    """A sequence slot's buffer indices `[begin, end)` of this rank's share."""
    return step.state.buffers[slot].narrow(step.state.slots[slot].token_dim, begin, end - begin)


def sharded_causal_attention(
    step: StepContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: ShardKeys, scale: float | None, first: int, last: int
) -> torch.Tensor:
    """Causal attention of a step's queries `q` [1, Hq, n, D] (positions
    `[o, o+n)`, its own keys and values `k`, `v` [1, Hkv, n, D]) over the
    keys `[first, last)` alone (`MaskBlock.key_interval`: left-padded
    prompts and right-padded completions; plain causal is `[0, o+n)`),
    whose earlier positions are sharded over the ranks (`step.state.shard`,
    read and differentiated through `keys`); the same on every rank."""
    return _ShardedCausalAttention.apply(step, q, k, v, keys, scale, first, last)


class _ShardedCausalAttention(torch.autograd.Function):
    """Forward: the partial over this rank's keys before the step (the
    kernels' non-causal call, `q_start` past them), merged across the ranks
    (`merge_partials`), then merged here with the partial over the step's own keys,
    which every rank holds: causal for the rows among them, all of them for
    the rows after them (right padding), none for rows before `first` (left
    padding: output 0). Backward: each block's gradients from the merged
    output and log-sum-exp; the shard's dK/dV go to this rank's d(state),
    the shard's dQ are summed over the ranks. With
    `attention_outputs_on_host` the reverse pass reads the capture's output
    and log-sum-exp instead (`_kept_or_merged`)."""

    @staticmethod
    def forward(ctx, step, q, k, v, keys, scale, first, last):
        kernel = kernel_for(q, None)
        out, total = _kept_or_merged(step, keys.slot, q, v, lambda: _merged(step, kernel, q, k, v, keys, scale, first, last))
        ctx.step, ctx.keys, ctx.scale, ctx.kernel, ctx.span = step, keys, scale, kernel, (first, last)
        ctx.save_for_backward(q, k, v, out, total)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        step, kernel, scale = ctx.step, ctx.kernel, ctx.scale
        q, k, v, out, lse = ctx.saved_tensors
        first, last = ctx.span
        begin, end = _shard_range(step, first, last)
        grad_out = grad_out.contiguous()
        grad_q = torch.zeros(q.shape, dtype=compute_dtype(q), device=q.device)
        if begin < end:  # the rows that see no shard key (before `first`) exist only when this range is empty
            shard_k, shard_v = ctx.keys.read(step, begin, end)
            for start, length in kernel.earlier_blocks(q, end - begin):
                gq, gk, gv = kernel.backward(grad_out, q, shard_k.narrow(-2, start, length),
                                             shard_v.narrow(-2, start, length), out, lse, None, scale, end - begin, start)
                grad_q += gq
                ctx.keys.accumulate(step, gk, gv, begin + start)
        step.state.shard.ranks.all_reduce(grad_q)
        grad_k, grad_v = torch.zeros_like(k), torch.zeros_like(v)
        _own_backward(step, kernel, grad_out, q, k, v, out, lse, scale, first, last, grad_q, grad_k, grad_v)
        return None, grad_q.to(q.dtype), grad_k, grad_v, None, None, None, None


def padded_to(t: torch.Tensor, dim: int, length: int, fill: float = 0.0) -> torch.Tensor:
    """`t` padded with `fill` along `dim` to `length` (a round's shorter
    chunk for its gathers and merges, a short list of candidates)."""
    missing = length - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t, t.new_full(shape, fill)], dim)


def gather_round(t: torch.Tensor, dim: int, round_: ChunkRound, ranks: Ranks) -> list[torch.Tensor]:
    """Every rank's `t` (its chunk of the round along `dim`), in position order."""
    t = padded_to(t, dim, round_.longest).contiguous()
    gathered = [torch.empty_like(t) for _ in round_.chunks]
    ranks.all_gather(gathered, t)
    return [gathered[rank].narrow(dim, 0, n) for rank, (_, n) in zip(round_.owners, round_.chunks)]


def round_attention(step: StepContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: ShardKeys,
                    scale: float | None, first: int, last: int) -> torch.Tensor:
    """Causal attention of this rank's chunk of a round (the capture's, or
    the reverse pass's under autograd) over the keys `[first, last)` alone
    (`sharded_causal_attention`'s). The round's queries, keys, values and
    key intervals are gathered; each rank attends every chunk's queries
    over its own share of the positions before the round, and those
    partials are merged across the ranks by log-sum-exp; each rank then
    adds its own queries' partial over the round's keys before them and
    over its own (causal). Backward (`_RoundAttention`): the keys stay,
    the queries travel."""
    return _RoundAttention.apply(step, q, k, v, keys, scale, first, last)


class _RoundAttention(torch.autograd.Function):
    """Forward: `_round_merged`. Backward: the round's queries, output
    gradients, outputs and log-sum-exps are gathered, and each rank
    differentiates every chunk's queries against the keys it holds: its
    share before the round (dK/dV into its d(state)) and its own chunk
    (those of the later chunks of the round, and its own queries causally;
    dK/dV to its chunk's keys). The partial dQs of every chunk are summed
    over the ranks, and each keeps its own chunk's."""

    @staticmethod
    def forward(ctx, step, q, k, v, keys, scale, first, last):
        kernel = kernel_for(q, None)
        spans = step.state.shard.ranks.ints([first, last], q.device)
        spans = [(spans[rank][0], spans[rank][1]) for rank in step.round.owners]  # per chunk, in position order
        out, lse = _kept_in_round(step, keys.slot, lambda: _round_merged(step, kernel, q, k, v, keys, scale, spans))
        ctx.step, ctx.keys, ctx.scale, ctx.kernel, ctx.spans = step, keys, scale, kernel, spans
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        step, kernel, scale, keys = ctx.step, ctx.kernel, ctx.scale, ctx.keys
        q, k, v, out, lse = ctx.saved_tensors
        shard, round_ = step.state.shard, step.round
        mine, (offset, _) = round_.index, round_.chunks[round_.index]
        grad_out = grad_out.contiguous()
        d = q.shape[-1]
        lses = gather_round(lse, -1, round_, shard.ranks)
        # the partial dQs of every chunk's queries, in the order of their ranks (a reduce-scatter's)
        grad_qs = torch.zeros(len(round_.chunks), *q.shape[:-2], round_.longest, d, dtype=compute_dtype(q), device=q.device)
        grad_k, grad_v = torch.zeros_like(k), torch.zeros_like(v)
        rows = gathered_rows(q, grad_out, out, round_, shard.ranks)
        for i, ((first, last), (qi, gi, oi), row_lse) in enumerate(zip(ctx.spans, rows, lses)):
            grad_qi = grad_qs[round_.owners[i]].narrow(-2, 0, qi.shape[-2])
            begin, end = shard.local_range(first, min(last, round_.start))
            if begin < end:  # this rank's share before the round
                share_k, share_v = keys.read(step, begin, end)
                for start, length in kernel.earlier_blocks(qi, end - begin):
                    gq, gk, gv = kernel.backward(gi, qi, share_k.narrow(-2, start, length), share_v.narrow(-2, start, length),
                                                 oi, row_lse, None, scale, end - begin, start)
                    grad_qi += gq
                    keys.accumulate(step, gk, gv, begin + start)
            skip = min(max(first - offset, 0), k.shape[-2])  # this rank's keys a left padding leaves out
            if i != mine and round_.sees(i) and skip < k.shape[-2]:  # a later chunk: all this rank's keys are before it
                seen_k, seen_v = k[..., skip:, :], v[..., skip:, :]
                for start, length in kernel.earlier_blocks(qi, seen_k.shape[-2]):
                    gq, gk, gv = kernel.backward(gi, qi, seen_k.narrow(-2, start, length), seen_v.narrow(-2, start, length),
                                                 oi, row_lse, None, scale, seen_k.shape[-2], start)
                    grad_qi += gq
                    grad_k.narrow(-2, skip + start, length).add_(gk)
                    grad_v.narrow(-2, skip + start, length).add_(gv)
        _own_backward(step, kernel, grad_out, q, k, v, out, lse, scale, *ctx.spans[mine],
                      grad_qs[shard.rank].narrow(-2, 0, q.shape[-2]), grad_k, grad_v)
        grad_q = grad_qs.new_empty(1, *grad_qs.shape[1:])
        shard.ranks.reduce_scatter(grad_q, grad_qs)
        return None, grad_q[0].narrow(-2, 0, q.shape[-2]).to(q.dtype), grad_k, grad_v, None, None, None, None


def gathered_rows(
    q: torch.Tensor, grad_out: torch.Tensor, out: torch.Tensor, round_: ChunkRound, ranks: Ranks
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Every chunk's queries, output gradients and outputs ([..., n, D],
    positions at -2) of a round, in one all-gather: what a round's backward
    needs where the keys are. Each chunk's are made contiguous as it is
    reached."""
    d, dv = q.shape[-1], out.shape[-1]
    for row in gather_round(torch.cat([q, grad_out.to(q.dtype), out], -1), -2, round_, ranks):
        yield tuple(row[..., a:b].contiguous() for a, b in ((0, d), (d, d + dv), (d + dv, d + 2 * dv)))


def _round_merged(
    step: StepContext, kernel: AttentionKernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: ShardKeys,
    scale: float | None, spans: Sequence[tuple[int, int]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_RoundAttention`'s output (q's dtype) and log-sum-exp (compute
    dtype), `spans` the key interval of each chunk of the round."""
    shard, round_ = step.state.shard, step.round
    compute = compute_dtype(q)
    queries = gather_round(q, -2, round_, shard.ranks)
    outs, lses = [], []
    for query, (first, last) in zip(queries, spans):
        begin, end = shard.local_range(first, min(last, round_.start))
        out, lse = _partial_over_share(step, kernel, query, v, keys, scale, begin, end)
        outs.append(padded_to(out[0], -2, round_.longest))
        lses.append(padded_to(lse[0], -1, round_.longest, float("-inf")))
    out, lse = merge_scattered(by_rank(outs, round_), by_rank(lses, round_), shard.ranks)
    n, mine = q.shape[-2], round_.index
    out, lse = out[..., :n, :], lse[..., :n]
    first, last = spans[mine]
    skip = max(first - round_.start, 0)  # the round's keys before this chunk that the interval leaves out
    if not round_.branches:  # the round's chunks before this one (gathered on every rank: a collective)
        round_k, round_v = (gather_round(t, -2, round_, shard.ranks) for t in (k, v))
        if step.offset - round_.start > skip:
            before_k, before_v = (torch.cat(t[:round_.before], -2)[..., skip:, :] for t in (round_k, round_v))
            part, part_lse = kernel.forward(q, before_k, before_v, None, scale, before_k.shape[-2])
            out, lse = merge_with_own(out, lse, part.to(compute), part_lse.to(compute))
    out, total = merge_with_own(out, lse, *_own_partial(step, kernel, q, k, v, scale, first, last))
    return out.to(q.dtype), total


def _merged(
    step: StepContext, kernel: AttentionKernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: ShardKeys,
    scale: float | None, first: int, last: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_ShardedCausalAttention`'s output and log-sum-exp: the shards'
    partials merged across the ranks, then with the step's own keys."""
    out, lse = _partial_over_share(step, kernel, q, v, keys, scale, *_shard_range(step, first, last))
    out, lse = merge_partials(out, lse, step.state.shard.ranks)
    out, total = merge_with_own(out, lse, *_own_partial(step, kernel, q, k, v, scale, first, last))
    return out.to(q.dtype), total


def _partial_over_share(
    step: StepContext, kernel: AttentionKernel, q: torch.Tensor, v: torch.Tensor, keys: ShardKeys,
    scale: float | None, begin: int, end: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and log-sum-exp (compute dtype) of `q` over this rank's
    buffer indices `[begin, end)`, all before the queries; an empty range
    gives 0 and -inf, weight 0 in a merge."""
    compute = compute_dtype(q)
    if begin >= end:
        return (torch.zeros(*q.shape[:-1], v.shape[-1], dtype=compute, device=q.device),
                torch.full(q.shape[:-1], float("-inf"), dtype=compute, device=q.device))
    shard_k, shard_v = keys.read(step, begin, end)
    return tuple(t.to(compute) for t in kernel.forward(q, shard_k, shard_v, None, scale, end - begin))


def _own_partial(
    step: StepContext, kernel: AttentionKernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    scale: float | None, first: int, last: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and log-sum-exp (compute dtype) of the step's queries over its
    own keys in `[first, last)` (`_own_parts`); rows that see none give 0 and -inf."""
    compute = compute_dtype(q)
    own = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=compute, device=q.device)
    own_lse = torch.full(q.shape[:-1], float("-inf"), dtype=compute, device=q.device)
    for rows, q_start, (start, stop) in _own_parts(step, first, last):
        o, s = kernel.forward(q[..., rows, :], k[..., start:stop, :], v[..., start:stop, :], None, scale, q_start)
        own[..., rows, :], own_lse[..., rows] = o.to(compute), s.to(compute)
    return own, own_lse


def _own_backward(
    step: StepContext, kernel: AttentionKernel, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
    v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, scale: float | None, first: int, last: int,
    grad_q: torch.Tensor, grad_k: torch.Tensor, grad_v: torch.Tensor,
) -> None:
    """Add the gradients of the step's queries over its own keys in
    `[first, last)` (`_own_parts`) into `grad_q`, `grad_k`, `grad_v`, from
    the whole row's output and log-sum-exp."""
    for rows, q_start, (own_start, own_end) in _own_parts(step, first, last):
        part = [t[..., rows, :].contiguous() for t in (q, grad_out, out)]
        part_lse = lse[..., rows].contiguous()
        own_k, own_v = k[..., own_start:own_end, :], v[..., own_start:own_end, :]
        blocks = kernel.blocks(part[0], 0) if q_start == 0 else kernel.earlier_blocks(part[0], q_start)
        for start, length in blocks:
            gq, gk, gv = kernel.backward(part[1], part[0], own_k.narrow(-2, start, length),
                                         own_v.narrow(-2, start, length), part[2], part_lse, None, scale, q_start, start)
            grad_q[..., rows, :] += gq
            grad_k[..., own_start + start:own_start + start + length, :] += gk
            grad_v[..., own_start + start:own_start + start + length, :] += gv


def merge_with_own(
    out: torch.Tensor, lse: torch.Tensor, own: torch.Tensor, own_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The partial over the shards (merged across the ranks) merged here
    with the partial over the step's own keys, which every rank computed:
    output and log-sum-exp of the whole row (output [..., D], lse [...]).
    A row that sees no key at all (before a left padding's first key) gives 0."""
    total = torch.logaddexp(lse, own_lse)
    finite = torch.where(total.isneginf(), 0.0, total)
    return out * torch.exp(lse - finite)[..., None] + own * torch.exp(own_lse - finite)[..., None], total


def _kept_or_merged(
    step: StepContext, slot: int, q: torch.Tensor, v: torch.Tensor, merged: Callable[[], tuple[torch.Tensor, torch.Tensor]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """`Options.attention_outputs_on_host`: the capture keeps each prompt
    chunk's merged output and log-sum-exp on the host of the chunk's rank,
    and the reverse pass (which recomputes the chunk from the same inputs)
    broadcasts them from there instead of attending over every earlier key
    again. Every rank knows which entries were kept (`HostAttentionOutputs.keep`),
    so every rank skips the same collectives. With `verify_state` the
    reverse pass attends anyway and compares."""
    kept, shard = step.state.attention_outputs, step.state.shard
    prompt_chunk = kept is not None and step.offset + step.length <= step.state.prefix_len
    if prompt_chunk and step.grad_enabled and kept.has(slot, step.offset):
        owner = shard.owner(step.offset)
        stored = kept.get(slot, step.offset) if owner == shard.rank else None
        stored = _broadcast_pair(stored, q, v, owner, shard.ranks)
        _verify_kept(step, slot, stored, merged)
        return stored
    out, lse = merged()
    if prompt_chunk and not step.grad_enabled:
        kept.keep(slot, step.offset, out, lse, owner=shard.owner(step.offset))
    return out, lse


def _kept_in_round(
    step: StepContext, slot: int, merged: Callable[[], tuple[torch.Tensor, torch.Tensor]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_kept_or_merged` for a round: each rank keeps its own chunk's
    entry on its host, where the whole round's fit
    (`HostAttentionOutputs.keep_round`), and reads it back in the reverse
    pass, which then skips the attention's forward and its collectives on
    every rank of the round alike. The round recomputes a chunk's partials
    in the capture's order, so `verify_state` compares bit for bit."""
    kept = step.state.attention_outputs
    if kept is None or step.round.branches:  # only prompt chunks keep theirs
        return merged()
    if step.grad_enabled and kept.has(slot, step.offset):
        stored = kept.get(slot, step.offset)
        _verify_kept(step, slot, stored, merged)
        return stored
    out, lse = merged()
    if not step.grad_enabled:
        kept.keep_round(slot, step.offset, out, lse)
    return out, lse


def _verify_kept(
    step: StepContext, slot: int, stored: tuple[torch.Tensor, torch.Tensor],
    merged: Callable[[], tuple[torch.Tensor, torch.Tensor]],
) -> None:
    """`Options.verify_state`: attend anyway and compare with the kept entry;
    a difference is kept on the state and raised on every rank together."""
    if step.state.verify and not all(torch.equal(a, b) for a, b in zip(stored, merged())):
        step.state.failure = step.state.failure or LongStrawError(
            f"verify_state: the reverse pass recomputed the attention of {step.state.slots[slot].label()} over "
            f"positions [{step.offset}, {step.offset + step.length}) with other values than the capture kept "
            "(attention_outputs_on_host): the step is not deterministic; turn the option off")


def _broadcast_pair(
    pair: tuple[torch.Tensor, torch.Tensor] | None, q: torch.Tensor, v: torch.Tensor, owner: int, ranks: Ranks
) -> tuple[torch.Tensor, torch.Tensor]:
    """A kept entry (output, log-sum-exp, as `_merged` gives them for `q`
    and `v`) from `owner` to every rank; the others receive it into new tensors."""
    if pair is None:
        pair = (q.new_empty(*q.shape[:-1], v.shape[-1]),
                torch.empty(q.shape[:-1], dtype=compute_dtype(q), device=q.device))
    for t in pair:
        ranks.broadcast(t, owner)
    return pair


def _shard_range(step: StepContext, first: int, last: int) -> tuple[int, int]:
    """The buffer indices of this rank's positions before the step and in
    `[first, last)` (empty: begin == end)."""
    return step.state.shard.local_range(first, min(last, step.offset))


def _own_parts(step: StepContext, first: int, last: int) -> list[tuple[slice, int, tuple[int, int]]]:
    """The step's rows that see some of its own keys: (rows, the kernels'
    `q_start`, the own keys' local range). The keys `[a, b)` of the step
    (local, from `[first, last)`) are causal for the rows among them
    (`q_start` 0) and all seen by the rows after them (`q_start` b - a);
    rows before them see none."""
    n = step.length
    a, b = min(max(first - step.offset, 0), n), min(max(last - step.offset, 0), n)
    if b <= a:
        return []
    parts = [(slice(a, b), 0, (a, b))]
    if b < n:
        parts.append((slice(b, n), b - a, (a, b)))
    return parts


def raise_together(error: Exception | None, ranks: Ranks, device: torch.device) -> None:
    """Raise the error of the lowest rank that has one, on every rank.

    A check that reads this rank's share (`verify_state`, `check_finite`)
    can fail on one rank alone; raised there alone, it would leave the other
    ranks waiting in the step's next collective until the group's timeout.
    Every rank calls this at the same point of the step: a gather of one
    flag per rank finds the first failing rank, which sends its error to
    the others."""
    failing = [rank for rank, (failed,) in enumerate(ranks.ints([error is not None], device)) if failed]
    if not failing:
        return
    source = failing[0]
    error = ranks.object_from(error, source, device)
    if ranks.rank != source:
        error.add_note(f"longstraw: raised on rank {source} of the context-parallel group, and so on every rank")
    raise raised_on_every_rank(error)


@contextlib.contextmanager
def summed_over_ranks(leaves: Sequence[torch.Tensor], ranks: Ranks) -> Iterator[None]:
    """Gradients that each rank computes a part of inside this block (the
    reverse pass's rounds: each rank differentiates its own chunk) are
    summed over the group at its end; what the leaves' `.grad` held before
    it (the branches, every chunk every rank replays: the same on every
    rank) is counted once, the first rank's. The other ranks drop it on
    entry rather than keep a second copy of every gradient: each parameter
    gradient is reduced exactly once."""
    if not leaves:
        yield
        return
    if ranks.rank != 0:
        for leaf in leaves:
            leaf.grad = None
    yield
    for leaf, grad in zip(leaves, _summed([leaf.grad for leaf in leaves], leaves, ranks)):
        leaf.grad = grad


def summed_carry_grads(state: PromptState, position: int) -> None:
    """The gradients of the carries at `position` (the prompt's end), where
    each rank's branches added their part (branch rounds), summed over the
    ranks; the reverse pass starts from them on every rank."""
    grads = state.carry_grads
    slots = sorted(grads)
    summed = _summed([grads[i].get(position) for i in slots], [state.carry_at(i, position) for i in slots],
                     state.shard.ranks)
    for i, grad in zip(slots, summed):
        if grad is not None:
            grads[i][position] = grad


def _summed(
    tensors: Sequence[torch.Tensor | None], likes: Sequence[torch.Tensor], ranks: Ranks
) -> list[torch.Tensor | None]:
    """Each of `tensors` summed over the ranks (one all-reduce each), zeros
    for a rank that has none (None where no rank has one), so every rank
    calls the same collectives."""
    if not likes:
        return []
    held = [any(column) for column in zip(*ranks.ints([t is not None for t in tensors], likes[0].device))]
    out: list[torch.Tensor | None] = []
    for t, like, some in zip(tensors, likes, held):
        if not some:
            out.append(None)
            continue
        sent = torch.zeros_like(like) if t is None else t if t.is_contiguous() else t.contiguous()
        ranks.all_reduce(sent)
        out.append(sent)
    return out


def all_gathered(tensors: Sequence[torch.Tensor], ranks: Ranks) -> list[list[torch.Tensor]]:
    """Every rank's `tensors` (the same shapes on every rank), per rank in rank order."""
    per_rank: list[list[torch.Tensor]] = [[] for _ in range(ranks.size)]
    for t in tensors:
        gathered = [torch.empty_like(t, memory_format=torch.contiguous_format) for _ in per_rank]
        ranks.all_gather(gathered, t.contiguous())
        for mine, got in zip(per_rank, gathered):
            mine.append(got)
    return per_rank


def replicate_from_first(tensors: Sequence[torch.Tensor | None], group: dist.ProcessGroup | None) -> None:
    """Give every rank the group's first rank's `tensors` (in place).

    Every rank computes the whole gradient, but on a GPU not bit for bit
    the same one: kernels that accumulate with atomics (attention's dQ,
    embedding backward) round in another order on each rank. Weights
    stepped with such gradients drift apart, and the next call would find
    them different (`check_replicated`); so the ranks take the first
    rank's gradient."""
    for t in tensors:
        if t is None:
            continue
        sent = t if t.is_contiguous() else t.contiguous()
        Ranks(group).broadcast(sent, 0)
        if sent is not t:
            t.copy_(sent)


def graph_fingerprint(graph: torch.fx.Graph) -> float:
    """CRC-32 of the graph's text, which holds the Python values Dynamo folded into it (exact in float64)."""
    return float(zlib.crc32(str(graph).encode()))


# what a rank is doing when it calls `agree`: the collectives of the two differ after it
PLANNING, CALLING = 1.0, 2.0
_UNCOMPARED = ("progress", "memory_budget_gb", "context_parallel")  # display; per rank, agreed as a minimum; the group


def _option_fingerprints(options: Options) -> list[tuple[str, float]]:
    """(name, CRC-32 of the value) per option that decides a rank's
    collectives or values."""
    out = []
    for field in dataclasses.fields(options):
        if field.name in _UNCOMPARED:
            continue
        value = getattr(options, field.name)
        if field.name == "passes":  # a pass's own repr (a dataclass's fields), else its class: not its address
            value = [f"{type(p).__module__}.{type(p).__qualname__}" if type(p).__repr__ is object.__repr__ else repr(p)
                     for p in value]
        out.append((field.name, float(zlib.crc32(repr(value).encode()))))
    return out


def agree(
    phase: float, fingerprint: float, options: Options, value: float, group: dist.ProcessGroup | None,
    device: torch.device,
) -> list[float]:
    """Every rank's `value`, after checking that every rank of `group` is at
    the same point (`PLANNING` a step or `CALLING` one), with the same graph
    (`graph_fingerprint`) and the same options: a rank with another chunk
    size or mode would run other collectives than the rest, which hangs
    them or, collectives of equal sizes matched, mixes the wrong tensors.
    One all-gather of a header of the same size at both points, so a rank
    planning while another calls is caught too; every rank gathers the same
    headers and raises the same error."""
    ranks = Ranks(group)
    ranks.raise_posted()
    named = _option_fingerprints(options)
    header = torch.tensor([phase, fingerprint, *(v for _, v in named), value], dtype=torch.float64, device=device)
    gathered = [torch.empty_like(header) for _ in range(ranks.size)]
    ranks.all_gather(gathered, header)
    rows = torch.stack(gathered).cpu()
    for rank in range(1, len(rows)):
        differs = (rows[rank, :-1] != rows[0, :-1]).nonzero()
        if len(differs) == 0:
            continue
        where, fix = int(differs[0, 0]), "every rank must call the compiled loss the same way"
        if where == 0:
            doing = {PLANNING: "planning a step", CALLING: "calling a planned step"}
            what = f"rank 0 is {doing[float(rows[0, 0])]} while rank {rank} is {doing[float(rows[rank, 0])]}"
            fix = "every rank must call the compiled loss with the same inputs, as often (the same plan cache)"
        elif where == 1:
            what = f"the compiled graph differs between rank 0 and rank {rank}"
            fix = "every rank must compile the same loss, with the same Python values"
        else:
            what = f"the option `{named[where - 2][0]}` differs between rank 0 and rank {rank}"
            fix = "give every rank the same options (`memory_budget_gb` may differ: the smallest is planned for)"
        raise raised_on_every_rank(InputError(
            f"context parallelism: {what}: {fix} (each runs every step and keeps its share of the prompt state)"
        ))
    return rows[:, -1].tolist()


def check_replicated(
    values: Sequence[object], names: Sequence[str], data: Sequence[bool], fingerprint: float, options: Options,
    group: dist.ProcessGroup | None, generators: Sequence[torch.Tensor] = (),
) -> None:
    """Every rank of `group` must call with the same inputs, the same graph
    and the same options: each runs the whole step, and a rank with another
    prompt, other weights or another Python value folded into its graph (a
    scalar argument) would mix them into the others' attention. After
    `agree`, compared by a checksum per tensor (`_checksum`; `data`: which
    inputs are data, whose order is checked too) and the value of each
    number, in one all-gather per call. `generators`: the random number
    generators' states, when the loss draws random numbers (dropout): ranks
    that draw other masks compute other values where they must compute the
    same."""
    tensors = [(name, v, ordered) for name, v, ordered in zip(names, values, data) if isinstance(v, torch.Tensor)]
    checked = [(f"input `{name}`", _checksum(v.detach(), ordered)) for name, v, ordered in tensors]
    checked += [(f"input `{name}`", torch.tensor([float(v), 0.0, 0.0], dtype=torch.float64)) for name, v in zip(names, values)
                if isinstance(v, (int, float, torch.SymInt, torch.SymFloat))]
    checked += [(_GENERATOR, _checksum(g, ordered=True)) for g in generators]
    device = next((v.device for v in values if isinstance(v, torch.Tensor)), torch.device("cpu"))
    if len(set(agree(CALLING, fingerprint, options, float(len(checked)), group, device))) > 1:
        raise raised_on_every_rank(
            InputError("context parallelism: the ranks pass different numbers of inputs to the compiled loss")
        )
    sums = torch.stack([c.to(device) for _, c in checked])
    gathered = [torch.empty_like(sums) for _ in range(dist.get_world_size(group))]
    Ranks(group).all_gather(gathered, sums)
    for rank, other in enumerate(gathered):
        differs = ~((other == sums) | (other.isnan() & sums.isnan())).all(-1)
        if bool(differs.any()):
            what = checked[int(differs.nonzero()[0, 0])][0]
            fix = ("every rank must call the compiled loss with the same inputs, weights and Python values" if what != _GENERATOR
                   else "the loss draws random numbers (dropout), and every rank must draw the same: seed the group's "
                   "ranks alike, e.g. `torch.manual_seed(seed + data_parallel_rank)`, and draw nothing on one rank alone")
            raise raised_on_every_rank(InputError(
                f"context parallelism: {what} differs between rank {dist.get_rank(group)} and rank {rank} of the "
                f"group: {fix} (each runs the whole step and keeps its share of the prompt state)"
            ))


_GENERATOR = "the random number generators' state"


def _checksum(t: torch.Tensor, ordered: bool) -> torch.Tensor:
    """[sum, norm, weighted sum] of `t`, accumulated in float64. Sum and
    norm do not see order: rows of the completions shuffled on one rank,
    or a prompt's tokens, keep both. So data (`ordered`: small beside the
    weights) is also summed with a weight per element, the fractional
    parts of multiples of the golden ratio, which no reordering of unequal
    elements keeps but by coincidence; weights are loaded, not shuffled.
    `CHECKSUM_BLOCK` elements are upcast at a time: a reduction asked for
    float64 copies its whole input to float64 first, 10 GB for
    Qwen3.5-27B's embedding, which the planner does not count."""
    flat = t.reshape(-1)
    total, squares, weighted = (torch.zeros((), dtype=torch.float64, device=t.device) for _ in range(3))
    for start in range(0, flat.numel(), CHECKSUM_BLOCK):
        block = flat[start:start + CHECKSUM_BLOCK].double()
        total += block.sum()
        squares += torch.dot(block, block)
        if ordered:
            weights = torch.arange(start, start + block.numel(), dtype=torch.float64, device=t.device)
            weighted += torch.dot(block, weights.mul_(_GOLDEN).frac_().add_(0.5))
    return torch.stack([total, squares.sqrt(), weighted])


CHECKSUM_BLOCK = 1 << 24
"""Elements `_checksum` upcasts to float64 at once (128 MB)."""

_GOLDEN = (5**0.5 - 1) / 2
