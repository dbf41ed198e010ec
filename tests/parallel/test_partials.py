"""Attention partials merged by log-sum-exp (`parallel/partials.py`): the
merge of attention over two runs of keys is attention over both, exactly
(float64), with a row that sees no key in one part or in both."""

from __future__ import annotations

import torch

from longstraw.parallel.partials import merge_with_own


def _attention(q, k, v, allowed):
    """Output and log-sum-exp of `q` over `k`, `v` where `allowed` ([n, m]); 0 and -inf where none is."""
    s = (q @ k.transpose(-1, -2)).masked_fill(~allowed, float("-inf"))
    lse = s.logsumexp(-1)
    p = torch.exp(s - torch.where(lse.isneginf(), 0.0, lse)[..., None])
    return p @ v, lse


def test_merging_two_runs_of_keys_is_attention_over_both():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    earlier = torch.ones(5, 3, dtype=torch.bool)  # the prompt's keys: every query sees them
    own = torch.arange(2)[None, :] <= torch.arange(5)[:, None]  # the step's own keys, causal
    out_a, lse_a = _attention(q, k[..., :3, :], v[..., :3, :], earlier)
    out_b, lse_b = _attention(q, k[..., 3:, :], v[..., 3:, :], own)
    out, lse = merge_with_own(out_a, lse_a, out_b, lse_b)
    want_out, want_lse = _attention(q, k, v, torch.cat([earlier, own], 1))
    assert torch.allclose(out, want_out, rtol=1e-12, atol=1e-14)
    assert torch.allclose(lse, want_lse, rtol=1e-12, atol=1e-14)


def test_a_row_that_sees_no_key_gives_zero():
    """Left padding: the first query sees nothing in either part (-inf,
    -inf), the second only its own key; no NaN either way."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 1, 2, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    none = torch.zeros(2, 2, dtype=torch.bool)
    own = torch.tensor([[False, False], [True, True]])
    out_a, lse_a = _attention(q, k, v, none)
    out_b, lse_b = _attention(q, k, v, own)
    out, lse = merge_with_own(out_a, lse_a, out_b, lse_b)
    assert not out.isnan().any()
    assert torch.equal(out[..., 0, :], torch.zeros(1, 1, 4, dtype=torch.float64)) and lse[..., 0].isneginf().all()
    assert torch.allclose(out[..., 1, :], out_b[..., 1, :], rtol=1e-14) and torch.equal(lse[..., 1], lse_b[..., 1])
