"""Context parallelism (issue 18), its first block: attention of replicated
queries over a prompt state sharded across ranks.

Each rank holds a contiguous share of the prompt's keys and values; a
branch's queries are the same on every rank and come after every prompt
key, so no causal mask applies inside a shard. Each rank computes the
attention over its own keys (output and log-sum-exp, the explicit softmax
kernel in at least float32), and the ranks merge those partials by their
log-sum-exp: two all-reduces, the largest log-sum-exp, then the weighted
outputs and weights in one tensor. The merged output and log-sum-exp are
those of the whole row, so each rank's backward over its own keys gives the
exact dK/dV of its shard (kept local) and its part of dQ (summed over the
ranks, since q is replicated).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from longstraw.kernels.attention import MATH, compute_dtype


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
    return _ShardedAttention.apply(q, k, v, group, scale)


class _ShardedAttention(torch.autograd.Function):
    """Forward: local partial, merged across the ranks. Backward: the
    explicit-softmax kernel's block backward over the local keys with the
    merged output and log-sum-exp, dQ all-reduced."""

    @staticmethod
    def forward(ctx, q, k, v, group, scale):
        qc = q.to(compute_dtype(q))  # the partial output stays in the compute dtype until merged
        out, lse = MATH.forward(qc, k, v, None, scale, k.shape[-2])  # q_start past every key: no mask
        out, lse = _merge(out, lse, group)
        ctx.group, ctx.scale, ctx.dtype = group, scale, q.dtype
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
        dist.all_reduce(grad_q, group=ctx.group)
        return grad_q.to(ctx.dtype), grad_k, grad_v, None, None


def _merge(out: torch.Tensor, lse: torch.Tensor, group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ranks' partials (out [B, Hq, n, D], lse [B, Hq, n]) merged by
    log-sum-exp: weights exp(lse_r - max_r lse_r), shifted by the maximum so
    that none overflows; an empty shard's lse is -inf, weight 0."""
    top = lse.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    top = torch.where(top.isneginf(), 0.0, top)  # rows no rank has a key for
    weight = torch.exp(lse - top)
    sums = torch.cat([out * weight[..., None], weight[..., None]], dim=-1)  # one all-reduce for both sums
    dist.all_reduce(sums, group=group)
    total, norm = sums[..., :-1], sums[..., -1]
    merged = total / torch.where(norm > 0, norm, 1.0)[..., None]
    return merged, top + torch.log(norm)
