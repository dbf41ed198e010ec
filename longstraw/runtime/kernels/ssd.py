"""Mamba-2's state-space scan (SSD) in PyTorch, from a carried state.

Per head, with the step `dt` already folded into the inputs:

    h_t = exp(dA_t) * h_{t-1} + x_t (outer) B_t        h: [P, N]
    y_t = h_t @ C_t                                     y: [P]

`ssd_scan_reference` computes it a chunk of positions at a time: within a
chunk the outputs are a causal, decay-weighted product of the chunk's own
C and B (the "attention" form), plus the carried state's contribution,
and the state after the chunk is the decayed state plus the chunk's own
sum. Every chunk is exact, so any split of the positions gives the same
result from the state it hands over (what `CarryStep` needs). Computed in
float32, as transformers' own torch paths do, or in float64 when the
inputs are (`scan_dtype`).
"""

from __future__ import annotations

import torch

CHUNK = 64
"""Positions per chunk: the intra-chunk products are `[CHUNK, CHUNK]` per head."""


def scan_dtype(x: torch.Tensor) -> torch.dtype:
    """float32, or float64 for float64 inputs: what HF's scans compute in."""
    return torch.promote_types(x.dtype, torch.float32)


def ssd_flops(x: torch.Tensor, dA: torch.Tensor, B: torch.Tensor, C: torch.Tensor) -> float:
    """The scan's matrix products over these positions as if they filled
    whole chunks of `CHUNK`: per position and head `2 CHUNK (n + p) + 4 n p`
    (within a chunk, the weights from C and B and the output from them;
    against the state, the output from it and its update) (`CarryKernel.flops`)."""
    batch, length, heads, dim = x.shape
    state = B.shape[-1]
    return float(batch * length * heads * (2 * CHUNK * (state + dim) + 4 * state * dim))


def ssd_scan_reference(
    x: torch.Tensor, dA: torch.Tensor, B: torch.Tensor, C: torch.Tensor, initial_state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [b, L, h, p] (times dt); dA: [b, L, h] (A times dt, at most 0);
    B, C: [b, L, h, n] (per head); initial_state: [b, h, p, n] or None (zeros).
    Returns y [b, L, h, p] and the state after the last position, in `scan_dtype(x)`."""
    compute = scan_dtype(x)
    x, dA, B, C = (t.to(compute) for t in (x, dA, B, C))
    batch, length, heads, dim = x.shape
    state = x.new_zeros(batch, heads, dim, B.shape[-1]) if initial_state is None else initial_state.to(compute)
    outputs = []
    for start in range(0, length, CHUNK):
        xs, a, bs, cs = (t[:, start:start + CHUNK] for t in (x, dA, B, C))
        n = xs.shape[1]
        cum = a.cumsum(1)  # [b, n, h]: the decay from the chunk's start to each position
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        between = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal[None, :, :, None], float("-inf"))
        weights = torch.einsum("bihn,bjhn->bijh", cs, bs) * between.exp()  # [b, i, j, h], j <= i
        y = torch.einsum("bijh,bjhp->bihp", weights, xs)
        y = y + torch.einsum("bihn,bhpn->bihp", cs, state) * cum.exp()[..., None]
        to_end = (cum[:, -1:] - cum).exp()  # [b, n, h]: the decay from each position to the chunk's end
        state = state * cum[:, -1].exp()[..., None, None] + torch.einsum("bjhn,bjhp,bjh->bhpn", bs, xs, to_end)
        outputs.append(y)
    y = torch.cat(outputs, dim=1) if outputs else x.new_zeros(batch, 0, heads, dim)
    return y, state
