"""Kimi Delta Attention (Kimi Linear) in PyTorch: the gated delta rule with a
decay per key channel, chunked, from a carried state.

Per head, with state S [Dk, Dv] and decay a_t = exp(g_t) per key channel:

    S_t = diag(a_t) S_{t-1} + k_t (beta_t (v_t - (diag(a_t) S_{t-1})^T k_t))^T,   o_t = S_t^T q_t

64 positions at a time: with G_i the cumulative log-decay from the chunk's
start to position i (per channel), the chunk's updates u solve the unit
lower-triangular system

    u_i + beta_i sum_{j<i} (k_i . exp(G_i - G_j) k_j) u_j = beta_i (v_i - S_0^T (exp(G_i) k_i))

and o_i = S_0^T (exp(G_i) q_i) + sum_{j<=i} (q_i . exp(G_i - G_j) k_j) u_j,
S_C = diag(exp(G_C)) S_0 + sum_j (exp(G_C - G_j) k_j) u_j^T. The pairwise
decays are formed explicitly ([C, C, Dk] per head, every exponent at most
0), as transformers' own PyTorch path does: no factor can overflow. Every
chunk is exact, so any split of the positions gives the same result from
the state it hands over (what `CarryStep` needs). Computes in float32, or
float64 for float64 inputs; autograd differentiates it.

Shapes: q, k, g [B, L, H, Dk]; v [B, L, H, Dv]; beta [B, L, H];
state [B, H, Dk, Dv].
"""

from __future__ import annotations

import torch

CHUNK = 64


def kimi_delta_flops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> float:
    """The rule's matrix products over these positions as if they filled
    whole chunks of C = `CHUNK`: per position and head `C (4 Dk + 3 Dv) + 6
    Dk Dv`. Within a chunk, the system and the output's pairwise products
    over the decayed keys (2 C Dk each), the triangular solve (C Dv) and the
    output from the chunk's own updates (2 C Dv); against the state, three
    products of 2 Dk Dv each (`CarryKernel.flops`)."""
    batch, length, heads, dim_k = k.shape
    dim_v = v.shape[-1]
    return float(batch * length * heads * (CHUNK * (4 * dim_k + 3 * dim_v) + 6 * dim_k * dim_v))


def kimi_delta_rule_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    out_dtype = q.dtype
    work = torch.promote_types(q.dtype, torch.float32)
    batch, length, heads, dim_k = k.shape
    dim_v = v.shape[-1]
    q, k, v, g = (x.transpose(1, 2).to(work) for x in (q, k, v, g))  # [B, H, L, D]
    beta = beta.transpose(1, 2).to(work)  # [B, H, L]
    if use_qk_l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * dim_k**-0.5
    state = (q.new_zeros(batch, heads, dim_k, dim_v) if initial_state is None else initial_state.to(work))
    outs = []
    for start in range(0, length, CHUNK):
        qc, kc, vc, gc = (x[:, :, start:start + CHUNK] for x in (q, k, v, g))
        bc = beta[:, :, start:start + CHUNK, None]
        n = qc.shape[2]
        decay = gc.cumsum(2)  # [B, H, n, Dk]
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        # between[i, j] = exp(G_i - G_j) per channel for j <= i, else 0
        between = (decay[:, :, :, None] - decay[:, :, None]).masked_fill(~causal[:, :, None], float("-inf")).exp()
        k_beta = kc * bc
        system = torch.einsum("bhid,bhjd,bhijd->bhij", k_beta, kc, between).tril(-1)
        rhs = vc * bc - (k_beta * decay.exp()) @ state
        eye = torch.eye(n, dtype=work, device=q.device)
        fresh = torch.linalg.solve_triangular(eye + system, rhs, upper=False, unitriangular=True)
        inner = torch.einsum("bhid,bhjd,bhijd->bhij", qc, kc, between)
        outs.append((qc * decay.exp()) @ state + inner @ fresh)
        to_end = (decay[:, :, -1:] - decay).exp()  # [B, H, n, Dk]
        state = state * decay[:, :, -1, :, None].exp() + (kc * to_end).transpose(-1, -2) @ fresh
    out = torch.cat(outs, dim=2) if outs else v.new_zeros(batch, heads, 0, dim_v)
    return out.transpose(1, 2).to(out_dtype).contiguous(), state
