"""The attention kernels (`longstraw/runtime/kernels/attention.py`): the explicit softmax
is softmax(QK^T * scale + mask)V of queries at `[o, o+n)` over keys `[0, o+n)` (float64,
output, log-sum-exp, and the block backward's dQ, dK, dV summed over key blocks that never
straddle `o`), causal or under a mask block, with grouped heads, queries past every key and
a left-padded query that sees no key; `kernel_for` picks fused kernels only where they apply."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend, sdpa_kernel

from longstraw.runtime import mask_block
from longstraw.runtime.kernels import attention
from longstraw.runtime.kernels.attention import CUDNN, FLASH, MATH

Positions = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _inputs(n: int, keys: int, dtype: torch.dtype = torch.float64, device: str = "cpu", vdim: int = 6):
    """q [1, 4, n, 8], keys [1, 2, T, 8], values [1, 2, T, vdim], grad_out [1, 4, n, vdim]."""
    gen = torch.Generator().manual_seed(n * 100 + keys)
    shapes = [(1, 4, n, 8), (1, 2, keys, 8), (1, 2, keys, vdim), (1, 4, n, vdim)]
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype=dtype, device=device) for s in shapes]


def _reference(q, keys, values, scale, allowed, bias=None):
    """softmax(q k^T * scale + bias) v over the keys `allowed` [n, T] lets each query see
    (query head j reads key head j // (Hq / Hkv)); a row that sees no key: output 0, lse -inf."""
    group = q.shape[1] // keys.shape[1]
    k, v = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    s = (q @ k.transpose(-1, -2)) * scale + (0.0 if bias is None else bias)
    s = s.masked_fill(~allowed, float("-inf"))
    lse = s.logsumexp(-1)
    empty = ~allowed.any(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(empty, 0.0), -1).masked_fill(empty, 0.0)
    return p @ v, lse


def _causal(n: int, o: int, keys: int) -> torch.Tensor:
    return torch.arange(keys)[None, :] <= torch.arange(o, o + n)[:, None]


def _block_grads(kernel, q, keys, values, grad_out, mask, scale, q_start, blocks):
    """dQ, dK, dV the way the attention step assembles them: the kernel's forward over
    all keys, its backward block by block with the whole row's output and log-sum-exp."""
    out, lse = kernel.forward(q, keys, values, mask, scale, q_start)
    grad_q = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    grad_k = torch.zeros(keys.shape, dtype=torch.float64, device=q.device)
    grad_v = torch.zeros(values.shape, dtype=torch.float64, device=q.device)
    for start, length in blocks:
        cols = None if mask is None else mask.columns(start, length)
        gq, gk, gv = kernel.backward(grad_out, q, keys.narrow(-2, start, length), values.narrow(-2, start, length),
                                     out, lse, cols, scale, q_start, start)
        grad_q += gq.double()
        grad_k.narrow(-2, start, length).add_(gk.double())
        grad_v.narrow(-2, start, length).add_(gv.double())
    return out, lse, (grad_q, grad_k, grad_v)


def _assert_partition(blocks: list[tuple[int, int]], end: int, offset: int) -> None:
    """The blocks cover `[0, end)` once each, none straddling `offset`."""
    ordered = sorted(blocks)
    assert [start for start, _ in ordered] == [0] + [start + length for start, length in ordered[:-1]]
    assert ordered[-1][0] + ordered[-1][1] == end
    assert all(start + length <= offset or start >= offset for start, length in blocks)


def _mask(positions: Positions, offset: int, n: int, bias: bool = False) -> mask_block.MaskBlock:
    """The mask block of query rows `[offset, offset+n)`, computed tile by tile from `positions(rows, cols)`;
    `bias`: a float mask adding 0.1 * (row - col) where allowed."""

    def tile(row_start, rows, col_start, cols):
        r = torch.arange(row_start, row_start + rows)[:, None]
        c = torch.arange(col_start, col_start + cols)[None, :]
        if not bias:
            return positions(r, c)[None, None]
        return torch.where(positions(r, c), 0.1 * (r - c).double(), torch.finfo(torch.float64).min)[None, None]

    return mask_block.MaskTiles(fx.symbolic_trace(tile))(offset, n)


@pytest.mark.parametrize("earlier", [0, 5])
@pytest.mark.parametrize("block_scores", [1, 4 * 3 * 2, 1 << 24], ids=["one-key", "two-keys", "one-block"])
def test_the_explicit_softmax_is_causal_attention_from_an_offset(earlier, block_scores, monkeypatch):
    """GQA (4 query heads over 2), scale 0.3: output, log-sum-exp and every
    gradient equal softmax attention's under autograd, the step's own keys causal."""
    monkeypatch.setattr(attention, "MATH_BLOCK_SCORES", block_scores)
    n, scale = 3, 0.3
    q, keys, values, grad_out = _inputs(n, earlier + n)
    blocks = MATH.blocks(q, earlier)
    _assert_partition(blocks, earlier + n, earlier)
    out, lse, grads = _block_grads(MATH, q, keys, values, grad_out, None, scale, earlier, blocks)
    leaves = [t.clone().requires_grad_() for t in (q, keys, values)]
    want_out, want_lse = _reference(*leaves, scale, _causal(n, earlier, earlier + n))
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    for name, got, want in zip("qkv", grads, torch.autograd.grad(want_out, leaves, grad_out)):
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-12, msg=f"d{name}")


def test_no_scale_means_one_over_the_square_root_of_the_head_dim():
    q, keys, values, _ = _inputs(2, 4)
    out, lse = MATH.forward(q, keys, values, None, None, 2)
    want_out, want_lse = _reference(q, keys, values, 8 ** -0.5, _causal(2, 2, 4))
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("q_start", [6, 9])
def test_queries_at_or_past_the_last_key_see_every_key(q_start, monkeypatch):
    """Right-padded queries: every query after every key, no causal mask at all."""
    monkeypatch.setattr(attention, "MATH_BLOCK_SCORES", 4 * 3 * 4)
    q, keys, values, grad_out = _inputs(3, 6)
    blocks = MATH.earlier_blocks(q, 6)
    _assert_partition(blocks, 6, 6)
    out, lse, grads = _block_grads(MATH, q, keys, values, grad_out, None, 0.5, q_start, blocks)
    leaves = [t.clone().requires_grad_() for t in (q, keys, values)]
    want_out, want_lse = _reference(*leaves, 0.5, torch.ones(3, 6, dtype=torch.bool))
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, torch.autograd.grad(want_out, leaves, grad_out)):
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-12)


def test_a_mask_block_replaces_the_causal_mask(monkeypatch):
    """A window of 3 over keys left-padded before position 2, queries at `[1, 6)`:
    the query at 1 sees no key (output 0, log-sum-exp -inf, no gradient, no NaN).
    Key blocks of two."""
    monkeypatch.setattr(attention, "MATH_BLOCK_SCORES", 4 * 5 * 2)
    positions = lambda r, c: (c <= r) & (c > r - 3) & (c >= 2)  # noqa: E731
    o, n = 1, 5
    q, keys, values, grad_out = _inputs(n, o + n)
    mask = _mask(positions, o, n)
    out, lse, grads = _block_grads(MATH, q, keys, values, grad_out, mask, 0.4, o, MATH.blocks(q, o))
    leaves = [t.clone().requires_grad_() for t in (q, keys, values)]
    allowed = positions(torch.arange(o, o + n)[:, None], torch.arange(o + n)[None, :])
    want_out, want_lse = _reference(*leaves, 0.4, allowed)
    assert torch.equal(out[..., 0, :], torch.zeros_like(out[..., 0, :])) and lse[..., 0].isneginf().all()
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, torch.autograd.grad(want_out, leaves, grad_out)):
        assert got.isfinite().all()
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-12)
    assert torch.equal(grads[0][..., 0, :], torch.zeros_like(grads[0][..., 0, :]))


def test_a_float_mask_block_is_added_to_the_scores(monkeypatch):
    """HF's float masks: a bias where allowed, the dtype's minimum elsewhere. Key blocks of two."""
    monkeypatch.setattr(attention, "MATH_BLOCK_SCORES", 4 * 4 * 2)
    positions = lambda r, c: (c <= r) & (c > r - 3)  # noqa: E731
    o, n = 3, 4
    q, keys, values, grad_out = _inputs(n, o + n)
    mask = _mask(positions, o, n, bias=True)
    out, lse, grads = _block_grads(MATH, q, keys, values, grad_out, mask, 0.4, o, MATH.blocks(q, o))
    rows, cols = torch.arange(o, o + n)[:, None], torch.arange(o + n)[None, :]
    leaves = [t.clone().requires_grad_() for t in (q, keys, values)]
    want_out, want_lse = _reference(*leaves, 0.4, positions(rows, cols), 0.1 * (rows - cols).double())
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, torch.autograd.grad(want_out, leaves, grad_out)):
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("dtype, compute", [(torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                                            (torch.float64, torch.float64)])
def test_the_explicit_softmax_computes_in_float32_or_wider(dtype, compute):
    """The output, dK and dV in the inputs' dtype, the log-sum-exp and the partial dQ (summed
    over blocks by the caller) in the compute dtype; 16-bit inputs within their rounding of
    the float64 attention of the same values."""
    q, keys, values, grad_out = _inputs(3, 5, dtype)
    out, lse = MATH.forward(q, keys, values, None, None, 2)
    gq, gk, gv = MATH.backward(grad_out, q, keys, values, out, lse, None, None, 2, 0)
    assert attention.compute_dtype(q) == compute and lse.dtype == compute
    assert out.dtype == gk.dtype == gv.dtype == dtype and gq.dtype == compute
    want_out, _ = _reference(q.double(), keys.double(), values.double(), 8 ** -0.5, _causal(3, 2, 5))
    torch.testing.assert_close(out.double(), want_out, rtol=1e-2, atol=1e-2)


def test_fused_blocks_keep_the_own_positions_as_one_causal_square(monkeypatch):
    """Flash and cuDNN (one key block being `FLASH_KEY_BLOCK` positions): the step's own
    positions whole, the earlier ones in fixed blocks; the explicit softmax splits both."""
    monkeypatch.setattr(attention, "FLASH_KEY_BLOCK", 4)
    monkeypatch.setattr(attention, "MATH_BLOCK_SCORES", 2 * 3 * 4)
    q = torch.empty(1, 2, 3, 8)
    assert FLASH.blocks(q, 10) == CUDNN.blocks(q, 10) == [(10, 3), (0, 4), (4, 4), (8, 2)]
    assert FLASH.blocks(q, 0) == [(0, 3)]
    assert MATH.blocks(q, 10) == [(10, 3), (0, 4), (4, 4), (8, 2)]
    monkeypatch.setattr(attention, "MATH_BLOCK_SCORES", 2 * 3 * 2)
    assert MATH.blocks(q, 3) == [(3, 2), (5, 1), (0, 2), (2, 1)]


def _fake_cuda(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    with FakeTensorMode():
        return torch.empty(*shape, dtype=dtype, device="cuda")


def test_fused_kernels_apply_only_to_unmasked_16_bit_cuda_queries_with_small_head_dims():
    mask = _mask(lambda r, c: c <= r, 0, 3)
    assert attention.fused_applies(_fake_cuda(1, 2, 3, 256), None)
    assert attention.fused_applies(_fake_cuda(1, 2, 3, 64, dtype=torch.float16), None)
    assert not attention.fused_applies(_fake_cuda(1, 2, 3, 64), mask)
    assert not attention.fused_applies(_fake_cuda(1, 2, 3, 264), None)
    assert not attention.fused_applies(_fake_cuda(1, 2, 3, 60), None)
    assert not attention.fused_applies(_fake_cuda(1, 2, 3, 64, dtype=torch.float32), None)
    assert not attention.fused_applies(torch.empty(1, 2, 3, 64, dtype=torch.bfloat16), None)


def test_a_chooser_overrides_sdpas_rules_while_it_is_active():
    """The innermost chooser decides; a preferred fused kernel only where it applies."""
    q, cpu = _fake_cuda(1, 2, 3, 64), torch.empty(1, 2, 3, 64, dtype=torch.bfloat16)
    assert attention.kernel_for(q, None) is FLASH
    with attention.choosing(attention.preferring("cudnn")):
        assert attention.kernel_for(q, None) is CUDNN and attention.kernel_for(cpu, None) is MATH
        with attention.choosing(attention.preferring("math")):
            assert attention.kernel_for(q, None) is MATH
        assert attention.kernel_for(q, None) is CUDNN
    with pytest.raises(RuntimeError, match="inside"), attention.choosing(lambda q, mask: MATH):
        raise RuntimeError("inside")
    assert attention.kernel_for(q, None) is FLASH and not attention._CHOOSERS


def test_memory_efficient_attention_in_sdpas_order_runs_the_explicit_softmax():
    q = _fake_cuda(1, 2, 3, 64)
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        assert attention.choose(q, None) is MATH
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION], set_priority=True):
        assert attention.choose(q, None) is CUDNN
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION], set_priority=True):
        assert attention.choose(q, None) is MATH


def test_each_choice_is_logged_at_debug_level(caplog):
    q = torch.empty(1, 2, 3, 8, dtype=torch.float64)
    with caplog.at_level(logging.DEBUG, logger="longstraw.attention"):
        attention.kernel_for(q, None)
        attention.kernel_for(_fake_cuda(1, 2, 5, 64), None)
        attention.kernel_for(q, _mask(lambda r, c: c <= r, 0, 3))
    assert [r.getMessage() for r in caplog.records if r.name == "longstraw.attention"] == [
        "MathKernel causal torch.float64 n=3", "FlashKernel causal torch.bfloat16 n=5",
        "MathKernel masked torch.float64 n=3"]


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", [FLASH, CUDNN], ids=["flash", "cudnn"])
@pytest.mark.parametrize("earlier, q_start", [(0, 0), (128, 128), (128, 192)], ids=["own", "earlier", "after"])
def test_fused_kernels_are_the_attention_within_bf16_rounding(kernel, earlier, q_start, monkeypatch):
    """bf16 on CUDA, keys in blocks of 64, GQA (4 query heads over 2): output and the block
    backward's gradients within bf16's rounding of float64 attention of the same values."""
    monkeypatch.setattr(attention, "FLASH_KEY_BLOCK", 64)
    n, keys_n = 64, earlier + 64
    q, keys, values, grad_out = _inputs(n, keys_n, torch.bfloat16, "cuda", vdim=8)
    after = q_start >= keys_n
    blocks = kernel.earlier_blocks(q, keys_n) if after else kernel.blocks(q, q_start)
    out, _, grads = _block_grads(kernel, q, keys, values, grad_out, None, None, q_start, blocks)
    leaves = [t.double().requires_grad_() for t in (q, keys, values)]
    allowed = torch.ones(n, keys_n, dtype=torch.bool) if after else _causal(n, earlier, keys_n)
    want_out, _ = _reference(*leaves, 8 ** -0.5, allowed.cuda())
    torch.testing.assert_close(out.double(), want_out, rtol=2e-2, atol=2e-2)
    for got, want in zip(grads, torch.autograd.grad(want_out, leaves, grad_out.double())):
        torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-2)
