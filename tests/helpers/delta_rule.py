"""The delta rule written out position by position: the reference the
chunked kernels (Gated DeltaNet's, Kimi Delta Attention's) are tested against."""

from __future__ import annotations

import torch


def delta_rule_recurrence(q, k, v, g, beta, state, use_qk_l2norm: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Per value head: S_t = diag(a_t) S_{t-1} + k_t (beta_t (v_t - (diag(a_t) S_{t-1})^T k_t))^T,
    o_t = S_t^T q_t, q scaled by Dk^-1/2 after the norm; a_t = exp(g_t), one decay per head (g [B, L, Hv],
    Gated DeltaNet) or per key channel (g [B, L, Hv, Dk], Kimi); value head j reads key head j // (Hv / Hk).
    Returns (o [B, L, Hv, Dv], S [B, Hv, Dk, Dv])."""
    group = v.shape[2] // k.shape[2]
    q, k = q.repeat_interleave(group, 2), k.repeat_interleave(group, 2)
    if use_qk_l2norm:
        q = q / (q.square().sum(-1, keepdim=True) + 1e-6).sqrt()
        k = k / (k.square().sum(-1, keepdim=True) + 1e-6).sqrt()
    q = q * q.shape[-1] ** -0.5
    decay = g.exp()[..., None] if g.dim() == 4 else g.exp()[..., None, None]  # [B, L, Hv, Dk or 1, 1]
    outs = []
    for t in range(q.shape[1]):
        decayed = state * decay[:, t]  # [B, Hv, Dk, Dv]
        predicted = torch.einsum("bhkv,bhk->bhv", decayed, k[:, t])
        update = beta[:, t, :, None] * (v[:, t] - predicted)
        state = decayed + k[:, t, :, :, None] * update[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(outs, 1), state
