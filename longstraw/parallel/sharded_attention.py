"""Context parallelism: the prompt's per-position state sharded
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
rounds too, each rank one row of W (`runtime/branch_turns.branch_turns`: the same
`round_attention`, no branch reading another's keys). The chunks outside
rounds run on every rank on the same inputs (`sharded_causal_attention`
merges the partials over the shards of the positions before the step
with its own causal keys); their gradients are the same on every rank and
counted once. In exact mode d(state) is sharded like the state.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from longstraw.parallel.partials import (
    kept_in_round,
    kept_or_merged,
    merge_partials,
    merge_scattered,
    merge_with_own,
    own_backward,
    own_partial,
    partial_over_share,
)
from longstraw.parallel.ranks import Ranks
from longstraw.parallel.shards import ShardKeys, by_rank, gather_round, gathered_rows, padded_to, shard_range
from longstraw.runtime.kernels.attention import MATH, AttentionKernel, compute_dtype, kernel_for
from longstraw.runtime.prompt_state import StepContext


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
    and log-sum-exp instead (`kept_or_merged`)."""

    @staticmethod
    def forward(ctx, step, q, k, v, keys, scale, first, last):
        kernel = kernel_for(q, None)
        out, total = kept_or_merged(step, keys.slot, q, v, lambda: _merged(step, kernel, q, k, v, keys, scale, first, last))
        ctx.step, ctx.keys, ctx.scale, ctx.kernel, ctx.span = step, keys, scale, kernel, (first, last)
        ctx.save_for_backward(q, k, v, out, total)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        step, kernel, scale = ctx.step, ctx.kernel, ctx.scale
        q, k, v, out, lse = ctx.saved_tensors
        first, last = ctx.span
        begin, end = shard_range(step, first, last)
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
        own_backward(step, kernel, grad_out, q, k, v, out, lse, scale, first, last, grad_q, grad_k, grad_v)
        return None, grad_q.to(q.dtype), grad_k, grad_v, None, None, None, None


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
        out, lse = kept_in_round(step, keys.slot, lambda: _round_merged(step, kernel, q, k, v, keys, scale, spans))
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
        own_backward(step, kernel, grad_out, q, k, v, out, lse, scale, *ctx.spans[mine],
                      grad_qs[shard.rank].narrow(-2, 0, q.shape[-2]), grad_k, grad_v)
        grad_q = grad_qs.new_empty(1, *grad_qs.shape[1:])
        shard.ranks.reduce_scatter(grad_q, grad_qs)
        return None, grad_q[0].narrow(-2, 0, q.shape[-2]).to(q.dtype), grad_k, grad_v, None, None, None, None


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
        out, lse = partial_over_share(step, kernel, query, v, keys, scale, begin, end)
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
    out, total = merge_with_own(out, lse, *own_partial(step, kernel, q, k, v, scale, first, last))
    return out.to(q.dtype), total


def _merged(
    step: StepContext, kernel: AttentionKernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: ShardKeys,
    scale: float | None, first: int, last: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_ShardedCausalAttention`'s output and log-sum-exp: the shards'
    partials merged across the ranks, then with the step's own keys."""
    out, lse = partial_over_share(step, kernel, q, v, keys, scale, *shard_range(step, first, last))
    out, lse = merge_partials(out, lse, step.state.shard.ranks)
    out, total = merge_with_own(out, lse, *own_partial(step, kernel, q, k, v, scale, first, last))
    return out.to(q.dtype), total
