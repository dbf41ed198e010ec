"""Gated DeltaNet through flash-linear-attention (fla), forward and backward.

fla's chunked kernels compute the gated delta rule in a handful of fused
Triton kernels per call where the PyTorch reference launches several
hundred small ones (at full Qwen3.5-27B depth the reference's backward was
most of exact mode's reverse pass). fla's own backward cannot be called as
is: one of its kernels, `chunk_bwd_dqkwg`, is miscompiled by Triton 3.4 to
3.7.0 on Hopper and fla refuses to run it there. `gated_delta_grads` runs
fla's backward pipeline with that one step computed by batched PyTorch
products instead (`_dqkwg`): it is parallel over 64-position chunks, so
a few batched matmuls do it.

fla keeps the decay `g` as a log2 cumulative sum within each chunk
(`chunk_local_cumsum(..., scale=1/ln 2)`), hence the `exp2` below.
Inputs follow `longstraw::gated_delta_rule`: q, k [B, L, Hk, Dk];
v [B, L, Hv, Dv]; g, beta [B, L, Hv]; state [B, Hv, Dk, Dv] float32.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from longstraw.runtime.prompt_state import has_values
from longstraw.runtime.kernels.switch import KernelSwitch

CHUNK = 64  # fla's chunk size; the log2 decays below are cumulative within these


@functools.cache
def fla_ops() -> SimpleNamespace | None:
    """fla's entry points, or None when fla is not installed."""
    try:
        from fla.modules.norm.l2norm import l2norm_bwd, l2norm_fwd
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu, chunk_gated_delta_rule_fwd_h
        from fla.ops.common.chunk_o import chunk_bwd_dv_local
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
        from fla.ops.gated_delta_rule.wy_fast import prepare_wy_repr_bwd
        from fla.ops.utils import chunk_local_cumsum
        from fla.ops.utils.constant import RCP_LN2
    except ImportError:
        return None
    return SimpleNamespace(
        l2norm_fwd=l2norm_fwd, l2norm_bwd=l2norm_bwd, chunk_gated_delta_rule=chunk_gated_delta_rule,
        chunk_gated_delta_rule_fwd_intra=chunk_gated_delta_rule_fwd_intra,
        chunk_gated_delta_rule_fwd_h=chunk_gated_delta_rule_fwd_h, chunk_bwd_dv_local=chunk_bwd_dv_local,
        chunk_gated_delta_rule_bwd_dhu=chunk_gated_delta_rule_bwd_dhu, prepare_wy_repr_bwd=prepare_wy_repr_bwd,
        chunk_local_cumsum=chunk_local_cumsum, RCP_LN2=RCP_LN2,
    )


SWITCH = KernelSwitch("fla gated_delta")


def applies(q: torch.Tensor) -> bool:
    """fla runs on CUDA with 16-bit inputs (it would compute float32 inputs
    in TF32), unless switched off. Tensors without values (meta, fake) take
    it only in the planner's simulation of a CUDA target with fla
    (`SWITCH.simulating()`, with `FAKE_OPS`): Triton would launch on their
    made-up data pointers."""
    if not SWITCH.on or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    return q.is_cuda and fla_ops() is not None if has_values(q) else SWITCH.fakes


def _ops(q: torch.Tensor) -> SimpleNamespace:
    """fla's entry points, or in the planner's simulation (no values) `FAKE_OPS`."""
    return fla_ops() if has_values(q) else FAKE_OPS


def gated_delta_forward(q, k, v, g, beta, initial_state, use_qk_l2norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's fused forward: (out, final state)."""
    return _ops(q).chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=initial_state, output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm
    )


def gated_delta_grads(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    grad_out: torch.Tensor | None,
    grad_state: torch.Tensor | None,
    use_qk_l2norm: bool,
) -> tuple[torch.Tensor, ...]:
    """Gradients of `gated_delta_forward` for (state, q, k, v, g, beta),
    recomputing what the backward needs from the inputs (fla's
    `chunk_gated_delta_rule_bwd` after its forward, with `_dqkwg`)."""
    ops = _ops(q)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    state = state.contiguous()
    do = torch.zeros_like(v) if grad_out is None else grad_out.contiguous().to(v.dtype)
    dht = None if grad_state is None else grad_state.contiguous().to(torch.float32)
    q_in, k_in = q, k
    if use_qk_l2norm:
        q, q_rstd = ops.l2norm_fwd(q)
        k, k_rstd = ops.l2norm_fwd(k)
    scale = k.shape[-1] ** -0.5
    g_log2 = ops.chunk_local_cumsum(g, chunk_size=CHUNK, scale=ops.RCP_LN2)
    w, u, A = ops.chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=g_log2, beta=beta, chunk_size=CHUNK)
    h, v_new, _ = ops.chunk_gated_delta_rule_fwd_h(
        k=k, w=w, u=u, g=g_log2, initial_state=state, output_final_state=False, chunk_size=CHUNK
    )
    dv = ops.chunk_bwd_dv_local(q=q, k=k, do=do, g=g_log2, scale=scale, chunk_size=CHUNK)
    dh, dh0, dv = ops.chunk_gated_delta_rule_bwd_dhu(
        q=q, k=k, w=w, do=do, dv=dv, g=g_log2, h0=state, dht=dht, scale=scale, chunk_size=CHUNK
    )
    dq, dk, dw, dg = _dqkwg(q, k, v_new, w, g_log2, h, dv, do, dh, scale)
    dk2, dv, db, dg2 = ops.prepare_wy_repr_bwd(k=k, v=v, beta=beta, A=A, dw=dw, du=dv, g=g_log2)
    dk = dk + dk2
    dg = ops.chunk_local_cumsum(dg + dg2, chunk_size=CHUNK, reverse=True)
    if use_qk_l2norm:
        dq = ops.l2norm_bwd(q, q_rstd, dq)
        dk = ops.l2norm_bwd(k, k_rstd, dk)
    return (
        dh0.to(state.dtype), dq.to(q_in.dtype), dk.to(k_in.dtype), dv.to(v.dtype), dg.to(g.dtype), db.to(beta.dtype)
    )


def _dqkwg(q, k, v_new, w, g_log2, h, dv, do, dh, scale: float):
    """What fla's `chunk_bwd_kernel_dqkwg` computes, per 64-position chunk n
    and value head (state layout [Dk, Dv]; positions past the end are zero):

        dq = (do h^T) * 2^g * scale + tril(do v^T * 2^(g_i - g_j)) * scale @ k
        dk = (v dh^T) * 2^(g_last - g) + (the same tril)^T @ q
        dw = -dv h^T
        dg = rowsum(dq * q) - rowsum(dk * k), plus at the chunk's last position
             sum(h * dh) 2^g_last + sum((v dh^T) 2^(g_last - g) * k)

    in float32 (the kernel rounds the tril to the inputs' dtype before its
    last two products; this does not). Returns dq, dk per key head, dw, dg."""
    batch, length, heads_k, dim_k = k.shape
    heads_v, dim_v = v_new.shape[2:]
    chunks = -(-length // CHUNK)
    pad = chunks * CHUNK - length
    f32 = torch.float32

    def per_chunk(x: torch.Tensor, replicate: bool = False) -> torch.Tensor:
        """[B, L, H, ...] -> [B, N, H, C, ...] in float32, padded to whole chunks."""
        x = x.to(f32)
        if pad:
            tail = x[:, -1:].expand(batch, pad, *x.shape[2:]) if replicate else x.new_zeros(batch, pad, *x.shape[2:])
            x = torch.cat([x, tail], 1)
        return x.reshape(batch, chunks, CHUNK, *x.shape[2:]).transpose(2, 3)

    group = heads_v // heads_k
    q_c, k_c = (per_chunk(x.repeat_interleave(group, dim=2) if group > 1 else x) for x in (q, k))  # [B, N, Hv, C, Dk]
    v_c, do_c, dv_c = (per_chunk(x) for x in (v_new, do, dv))  # [B, N, Hv, C, Dv]
    g_c = per_chunk(g_log2, replicate=True)  # [B, N, Hv, C]; past the end: the last position's value
    g_last = g_c[..., -1]  # [B, N, Hv]: the decay at the chunk's last real position
    h32, dh32 = h.to(f32), dh.to(f32)  # [B, N, Hv, Dk, Dv]
    h_t = h32.transpose(-1, -2)

    dq = (do_c @ h_t) * (torch.exp2(g_c)[..., None] * scale)
    dk = (v_c @ dh32.transpose(-1, -2)) * torch.exp2(g_last[..., None] - g_c)[..., None]
    dw = -(dv_c @ h_t)
    dg_last = (h32 * dh32).sum((-1, -2)) * torch.exp2(g_last) + (dk * k_c).sum((-1, -2))
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    decay = (g_c[..., :, None] - g_c[..., None, :]).masked_fill(~causal, float("-inf"))
    ds = (do_c @ v_c.transpose(-1, -2)) * torch.exp2(decay) * scale
    dq = dq + ds @ k_c
    dk = dk + ds.transpose(-1, -2) @ q_c
    dg = (dq * q_c).sum(-1) - (dk * k_c).sum(-1)  # [B, N, Hv, C]

    def back(x: torch.Tensor) -> torch.Tensor:
        """[B, N, H, C, ...] -> [B, L, H, ...]."""
        return x.transpose(2, 3).reshape(batch, chunks * CHUNK, *x.shape[2:3], *x.shape[4:])[:, :length].contiguous()

    dq, dk, dw, dg = back(dq), back(dk), back(dw), back(dg)
    last = (torch.arange(1, chunks + 1, device=q.device) * CHUNK).clamp(max=length) - 1
    dg = dg.index_add(1, last, dg_last)
    if group > 1:
        dq = dq.reshape(batch, length, heads_k, group, dim_k).sum(3)
        dk = dk.reshape(batch, length, heads_k, group, dim_k).sum(3)
    return dq, dk, dw.to(w.dtype), dg


# fla 0.6's entry points as the planner's simulation runs them: each allocates the outputs fla
# allocates (shapes, dtypes, order) and computes nothing. `FAKE_OPS` has `fla_ops()`'s names.


def _chunks(length: int, chunk_size: int) -> int:
    return -(-length // chunk_size)


def _fake_l2norm_fwd(x: torch.Tensor, eps: float = 1e-6, output_dtype: torch.dtype | None = None):
    """(normalised x, float32 rstd per row)."""
    y = torch.empty(x.shape, dtype=output_dtype or x.dtype, device=x.device)
    return y, x.new_empty(x.shape[:-1], dtype=torch.float32)


def _fake_l2norm_bwd(y: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """dx in the normalised input's dtype (a float32 dy is rounded to it)."""
    return torch.empty(y.shape, dtype=y.dtype, device=y.device)


def _fake_chunk_local_cumsum(g: torch.Tensor, chunk_size: int, reverse: bool = False, scale: float | None = None,
                             output_dtype: torch.dtype | None = torch.float32, **kwargs) -> torch.Tensor:
    """The per-chunk cumulative sum, float32 by default."""
    return torch.empty(g.shape, dtype=output_dtype or g.dtype, device=g.device)


def _fake_fwd_intra(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None = None, beta: torch.Tensor | None = None,
                    chunk_size: int = CHUNK, **kwargs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w [B, T, Hv, Dk], u like v, A [B, T, Hv, chunk]), in k's dtype."""
    batch, length, _, dim_k = k.shape
    heads_v = v.shape[2]
    A = k.new_zeros(batch, length, heads_v, chunk_size)
    return k.new_empty(batch, length, heads_v, dim_k), torch.empty_like(v), A


def _fake_fwd_h(k: torch.Tensor, w: torch.Tensor, u: torch.Tensor, g: torch.Tensor | None = None,
                gk: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
                output_final_state: bool = False, chunk_size: int = CHUNK, **kwargs):
    """(h [B, chunks, Hv, Dk, Dv] in k's dtype: the state at every chunk's
    start; v_new like u; the float32 final state, if asked for)."""
    batch, length, _, dim_k = k.shape
    heads_v, dim_v = u.shape[2:]
    h = k.new_empty(batch, _chunks(length, chunk_size), heads_v, dim_k, dim_v)
    final = k.new_zeros(batch, heads_v, dim_k, dim_v, dtype=torch.float32) if output_final_state else None
    return h, torch.empty_like(u), final


def _fake_bwd_dv_local(q: torch.Tensor, k: torch.Tensor, do: torch.Tensor, g: torch.Tensor | None = None,
                       scale: float | None = None, chunk_size: int = CHUNK, **kwargs) -> torch.Tensor:
    """dv within each chunk, like do."""
    return torch.empty_like(do)


def _fake_bwd_dhu(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, do: torch.Tensor, dv: torch.Tensor,
                  g: torch.Tensor | None = None, gk: torch.Tensor | None = None, h0: torch.Tensor | None = None,
                  dht: torch.Tensor | None = None, scale: float | None = None, chunk_size: int = CHUNK, **kwargs):
    """(dh like h in q's dtype, float32 dh0 like h0, the new dv like dv)."""
    batch, length, _, dim_k = q.shape
    heads_v, dim_v = do.shape[2:]
    dh = q.new_empty(batch, _chunks(length, chunk_size), heads_v, dim_k, dim_v)
    dh0 = None if h0 is None else torch.empty_like(h0, dtype=torch.float32)
    return dh, dh0, torch.empty_like(dv)


def _fake_prepare_wy_repr_bwd(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, A: torch.Tensor, dw: torch.Tensor,
                              du: torch.Tensor, g: torch.Tensor | None = None, **kwargs):
    """(dk, dv, dbeta, dg): dk is computed per value head and summed over
    each key head's group (the per-value-head one is a temporary)."""
    batch, length, heads_k, dim_k = k.shape
    heads_v = v.shape[2]
    dk = k.new_empty(batch, length, heads_v, dim_k)
    dv, dg, db = torch.empty_like(v), None if g is None else torch.empty_like(g), torch.empty_like(beta)
    if heads_k != heads_v:
        dk = dk.view(batch, length, heads_k, heads_v // heads_k, dim_k).sum(3)
    return dk, dv, db, dg


def _fake_chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                 beta: torch.Tensor, scale: float | None = None,
                                 initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                                 use_qk_l2norm_in_kernel: bool = False, **kwargs):
    """(out like v, final state): fla's forward without autograd, whose
    intermediates (contiguous inputs, normalised q and k, w, u, A, the chunk
    states h, v_new) live until the output is computed."""
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, _ = _fake_l2norm_fwd(q)
        k, _ = _fake_l2norm_fwd(k)
    g = _fake_chunk_local_cumsum(g, CHUNK)
    w, u, A = _fake_fwd_intra(k, v, g, beta)
    h, v_new, final = _fake_fwd_h(k, w, u, g, initial_state=initial_state, output_final_state=output_final_state)
    return torch.empty_like(v_new), final


FAKE_OPS = SimpleNamespace(
    l2norm_fwd=_fake_l2norm_fwd, l2norm_bwd=_fake_l2norm_bwd, chunk_gated_delta_rule=_fake_chunk_gated_delta_rule,
    chunk_gated_delta_rule_fwd_intra=_fake_fwd_intra,
    chunk_gated_delta_rule_fwd_h=_fake_fwd_h, chunk_bwd_dv_local=_fake_bwd_dv_local,
    chunk_gated_delta_rule_bwd_dhu=_fake_bwd_dhu, prepare_wy_repr_bwd=_fake_prepare_wy_repr_bwd,
    chunk_local_cumsum=_fake_chunk_local_cumsum, RCP_LN2=1.4426950216,
)
