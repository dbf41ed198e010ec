"""Attention partials over this rank's share of the keys and their exact merges by log-sum-exp across ranks
and with a step's own keys; exact mode's attention outputs kept for the reverse pass.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from longstraw.errors import LongStrawError
from longstraw.parallel.ranks import Ranks
from longstraw.parallel.shards import ShardKeys, own_parts
from longstraw.runtime.kernels.attention import AttentionKernel, compute_dtype
from longstraw.runtime.prompt_state import StepContext


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


def partial_over_share(
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


def own_partial(
    step: StepContext, kernel: AttentionKernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    scale: float | None, first: int, last: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and log-sum-exp (compute dtype) of the step's queries over its
    own keys in `[first, last)` (`own_parts`); rows that see none give 0 and -inf."""
    compute = compute_dtype(q)
    own = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=compute, device=q.device)
    own_lse = torch.full(q.shape[:-1], float("-inf"), dtype=compute, device=q.device)
    for rows, q_start, (start, stop) in own_parts(step, first, last):
        o, s = kernel.forward(q[..., rows, :], k[..., start:stop, :], v[..., start:stop, :], None, scale, q_start)
        own[..., rows, :], own_lse[..., rows] = o.to(compute), s.to(compute)
    return own, own_lse


def own_backward(
    step: StepContext, kernel: AttentionKernel, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
    v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, scale: float | None, first: int, last: int,
    grad_q: torch.Tensor, grad_k: torch.Tensor, grad_v: torch.Tensor,
) -> None:
    """Add the gradients of the step's queries over its own keys in
    `[first, last)` (`own_parts`) into `grad_q`, `grad_k`, `grad_v`, from
    the whole row's output and log-sum-exp."""
    for rows, q_start, (own_start, own_end) in own_parts(step, first, last):
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


def kept_or_merged(
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


def kept_in_round(
    step: StepContext, slot: int, merged: Callable[[], tuple[torch.Tensor, torch.Tensor]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kept_or_merged` for a round: each rank keeps its own chunk's
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
