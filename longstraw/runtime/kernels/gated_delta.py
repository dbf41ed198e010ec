"""Gated DeltaNet in PyTorch: the chunked rule (the WY form of the DeltaNet
papers) over 64-position chunks, with a hand-written backward for the
sequential part. It runs everywhere (CPU, float64 parity tests, and on a
GPU where fla does not apply); `fla_gated_delta` is the fused alternative.

Shapes: q, k [B, L, Hk, Dk]; v [B, L, Hv, Dv]; g, beta [B, L, Hv];
state [B, Hv, Dk, Dv] (float32 or wider). Value heads share key heads in
groups of Hv // Hk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longstraw.runtime.prompt_state import has_values

CHUNK = 64


def gated_delta_rule_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule in PyTorch (the WY form of the DeltaNet papers).

    Per head, with state S [Dk, Dv], decay a_t = exp(g_t):
        S_t = a_t S_{t-1} + k_t (beta_t (v_t - a_t S_{t-1}^T k_t))^T,  o_t = S_t^T q_t
    computed 64 positions at a time: within a chunk the updates are solved
    as one unit-lower-triangular system. Computes in float32 or wider."""
    out_dtype = q.dtype
    work = torch.promote_types(q.dtype, torch.float32)
    batch, length, heads_k, dim_k = k.shape
    heads_v, dim_v = v.shape[-2:]
    if heads_v != heads_k:
        q = q.repeat_interleave(heads_v // heads_k, dim=2)
        k = k.repeat_interleave(heads_v // heads_k, dim=2)
    # [B, H, L, D] in the working dtype
    q, k, v = (x.transpose(1, 2).to(work) for x in (q, k, v))
    g, beta = (x.transpose(1, 2).to(work) for x in (g, beta))
    if use_qk_l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * dim_k**-0.5
    pad = (-length) % CHUNK
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    chunks = (length + pad) // CHUNK
    # [B, H, N, C, D]
    q, k, v = (x.reshape(batch, heads_v, chunks, CHUNK, -1) for x in (q, k, v))
    g, beta = (x.reshape(batch, heads_v, chunks, CHUNK) for x in (g, beta))
    decay = g.cumsum(-1)  # log of the decay from the chunk start to each position
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    # between[i, j] = exp(decay_i - decay_j) for j <= i, else 0
    between = (decay[..., :, None] - decay[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = ((k_beta @ k.transpose(-1, -2)) * between).tril(-1)  # I + system is unit lower triangular
    eye = torch.eye(CHUNK, dtype=work, device=q.device)
    values = torch.linalg.solve_triangular(eye + system, v * beta[..., None], upper=False, unitriangular=True)
    keys_in = torch.linalg.solve_triangular(eye + system, k_beta * decay.exp()[..., None], upper=False, unitriangular=True)
    inner = (q @ k.transpose(-1, -2)) * between
    q_decayed = q * decay.exp()[..., None]
    k_to_end = k * (decay[..., -1:] - decay).exp()[..., None]
    state = (
        torch.zeros(batch, heads_v, dim_k, dim_v, dtype=work, device=q.device)
        if initial_state is None
        else initial_state.to(work)
    )
    rows = batch * heads_v  # the scan works on [B*H, ...] matrices
    flat = lambda x: x.reshape(rows, chunks, *x.shape[3:])  # noqa: E731
    out, state = _ChunkScan.apply(
        flat(values), flat(keys_in), flat(q_decayed), flat(inner), flat(k_to_end),
        decay[..., -1].exp().reshape(rows, chunks), state.reshape(rows, dim_k, dim_v),
    )
    out = out.reshape(batch, heads_v, -1, dim_v)[:, :, :length]
    return out.transpose(1, 2).to(out_dtype).contiguous(), state.reshape(batch, heads_v, dim_k, dim_v)


def gated_delta_flops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> float:
    """The rule's matrix products over these positions as if they filled
    whole chunks of C = `CHUNK`: per position and value head `C (5 Dk + 3 Dv)
    + 6 Dk Dv`. Within a chunk, `k_beta k^T` and `q k^T` (2 C Dk each), the
    two triangular solves (C Dk, C Dv) and the output from the chunk's own
    values (2 C Dv); against the state, three products of 2 Dk Dv each. fla's
    kernels compute the same products (`CarryKernel.flops`)."""
    batch, length, _, dim_k = k.shape
    heads_v, dim_v = v.shape[-2:]
    return float(batch * length * heads_v * (CHUNK * (5 * dim_k + 3 * dim_v) + 6 * dim_k * dim_v))


class _ChunkScan(torch.autograd.Function):
    """The sequential part of the chunked rule: the state passed from one
    64-position chunk to the next, per row of `[B*H]`,

        fresh_n = values_n - keys_in_n @ S_n
        out_n   = q_decayed_n @ S_n + inner_n @ fresh_n
        S_n+1   = S_n * a_n + k_to_end_n^T @ fresh_n

    with a hand-written backward: autograd through this loop recorded about
    thirty operators per chunk (the selects, the matmuls' reshapes, their
    backward nodes), which made replays and the reverse pass launch-bound.
    Forward runs eight kernels per chunk (the same arithmetic as HF's loop),
    backward five (fused multiply-adds), writing into buffers laid out
    chunk-major, and every gradient but d(fresh) and d(S) is one batched
    product after the loop. Saves the state at every chunk start.

    Shape-only runs (the memory planner's fake tensors) skip the loops:
    the buffers are all they hold, and on fake tensors the loops were most
    of a simulated step's time."""

    @staticmethod
    def forward(ctx, values, keys_in, q_decayed, inner, k_to_end, decay_last, state):
        rows, chunks = values.shape[:2]
        fresh = values.new_empty(chunks, *values.shape[:1], *values.shape[2:])  # [N, rows, C, Dv]
        out = torch.empty_like(fresh)
        states = state.new_empty(chunks + 1, *state.shape)  # [N + 1, rows, Dk, Dv]
        states[0] = state
        if has_values(values):
            bmm = torch.bmm  # not `@`: matmul's reshapes around bmm were most of the operators per chunk
            # one unbind per tensor, not an index per chunk: every operator here costs a launch's worth of time
            per_chunk = zip(*(x.unbind(1) for x in (values, keys_in, q_decayed, inner, k_to_end.transpose(-1, -2),
                                                    decay_last[..., None, None])))
            fresh_n, out_n, state_n = fresh.unbind(0), out.unbind(0), states.unbind(0)
            for n, (v, kin, qd, inn, kte_t, last) in enumerate(per_chunk):
                f = torch.sub(v, bmm(kin, state_n[n]), out=fresh_n[n])  # the part the state does not already predict
                torch.add(bmm(qd, state_n[n]), bmm(inn, f), out=out_n[n])
                torch.add(state_n[n] * last, bmm(kte_t, f), out=state_n[n + 1])
        ctx.save_for_backward(keys_in, q_decayed, inner, k_to_end, decay_last, states, fresh)
        return out.transpose(0, 1), states[chunks].clone()

    @staticmethod
    def backward(ctx, grad_out, grad_state):
        keys_in, q_decayed, inner, k_to_end, decay_last, states, fresh = ctx.saved_tensors
        chunks = fresh.shape[0]
        grad_out = torch.zeros_like(fresh) if grad_out is None else grad_out.transpose(0, 1)  # [N, rows, C, Dv]
        d_fresh = torch.empty_like(fresh)
        d_states = torch.empty_like(states)  # the gradient of the state at every chunk boundary
        d_states[chunks] = 0 if grad_state is None else grad_state
        if has_values(fresh):
            bmm, t = torch.bmm, lambda x: x.transpose(-1, -2)  # noqa: E731
            per_chunk = zip(*(x.unbind(1) for x in (t(keys_in), t(q_decayed), t(inner), k_to_end,
                                                    decay_last[..., None, None])))
            d_fresh_n, d_state_n, dout_n = d_fresh.unbind(0), d_states.unbind(0), grad_out.unbind(0)
            for n, (kin_t, qd_t, inn_t, kte, last) in reversed(list(enumerate(per_chunk))):
                df = torch.baddbmm(bmm(inn_t, dout_n[n]), kte, d_state_n[n + 1], out=d_fresh_n[n])
                d_state = torch.baddbmm(d_state_n[n + 1] * last, qd_t, dout_n[n])
                torch.baddbmm(d_state, kin_t, df, alpha=-1, out=d_state_n[n])
        # back to [rows, N, ...]
        d_fresh, grad_out, fresh = (x.transpose(0, 1) for x in (d_fresh, grad_out, fresh))
        before, after = states[:chunks].transpose(0, 1), d_states[1:].transpose(0, 1)
        before_t = before.transpose(-1, -2)
        return (
            d_fresh,
            -(d_fresh @ before_t),
            grad_out @ before_t,
            grad_out @ fresh.transpose(-1, -2),
            fresh @ after.transpose(-1, -2),
            (after * before).sum((-1, -2)),
            d_states[0],
        )
