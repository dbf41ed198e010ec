"""The attention step's block-wise kernel (passes/attention.py).

Backward runs per key block with the whole row's log-sum-exp; these tests
force blocks of a single key so every block boundary is exercised, on the
kernel alone against SDPA's autograd and end to end against eager.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import longstraw
from longstraw.runtime.kernels import attention as attention_kernels

from helpers.parity import check_parity


class _Materialised:
    """A mask block held as one tensor, standing in for `longstraw.analysis.mask.MaskBlock`."""

    def __init__(self, block: torch.Tensor) -> None:
        self.block = block

    def columns(self, start: int, count: int) -> torch.Tensor:
        return self.block.narrow(-1, start, count)


def _blocked_grads(q, keys, values, grad_out, mask, kernel=attention_kernels.MATH, after=False):
    """dQ, dK, dV the way `AttentionOverState.backward` assembles them;
    `after`: every query after every key, as `AttentionOverSpan` runs them."""
    o = keys.shape[-2] if after else keys.shape[-2] - q.shape[-2]
    out, lse = kernel.forward(q, keys, values, None if mask is None else _Materialised(mask), None, o)
    grad_q = torch.zeros_like(q)
    grad_k, grad_v = torch.zeros_like(keys), torch.zeros_like(values)
    blocks = kernel.earlier_blocks(q, o) if after else kernel.blocks(q, o)
    assert all(start + length <= o or start >= o for start, length in blocks)
    ends = [0] + [start + length for start, length in sorted(blocks)]
    assert [start for start, _ in sorted(blocks)] == ends[:-1] and ends[-1] == keys.shape[-2]  # a partition
    for start, length in blocks:
        cols = None if mask is None else mask.narrow(-1, start, length)
        kb, vb = keys.narrow(-2, start, length), values.narrow(-2, start, length)
        gq, gk, gv = kernel.backward(grad_out, q, kb, vb, out, lse, cols, None, o, start)
        grad_q += gq
        grad_k.narrow(-2, start, length).add_(gk)
        grad_v.narrow(-2, start, length).add_(gv)
    return out, grad_q, grad_k, grad_v


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("explicit_mask", [False, True, "after"])
@pytest.mark.parametrize("block_scores", [1, 3 * 5 * 6, 1 << 24])
def test_math_kernel_blocks_match_sdpa(heads, kv_heads, explicit_mask, block_scores, monkeypatch):
    """`explicit_mask="after"`: the queries after every key (no mask, all keys seen)."""
    monkeypatch.setattr(attention_kernels, "MATH_BLOCK_SCORES", block_scores)
    gen = torch.Generator().manual_seed(0)
    n, total, d = 5, 12, 8
    q = torch.randn(1, heads, n, d, generator=gen, dtype=torch.float64, requires_grad=True)
    keys = torch.randn(1, kv_heads, total, d, generator=gen, dtype=torch.float64, requires_grad=True)
    values = torch.randn(1, kv_heads, total, d + 2, generator=gen, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(1, heads, n, d + 2, generator=gen, dtype=torch.float64)
    causal = torch.ones(n, total, dtype=torch.bool).tril(total - n)
    # an explicit mask that also hides some earlier keys (a sliding window)
    after = explicit_mask == "after"
    mask = causal & ~torch.ones(n, total, dtype=torch.bool).tril(total - n - 4) if explicit_mask is True else None
    want = F.scaled_dot_product_attention(q, keys, values, attn_mask=None if after else causal if mask is None else mask,
                                          enable_gqa=True)
    want_grads = torch.autograd.grad(want, (q, keys, values), grad_out)
    with torch.no_grad():
        out, *grads = _blocked_grads(q, keys, values, grad_out, mask, after=after)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["flash", "cudnn"])
@pytest.mark.parametrize("earlier", [0, 384])
@pytest.mark.parametrize("after", [False, True])
def test_fused_kernel_blocks_match_float64(name, earlier, after, monkeypatch):
    """Flash's and cuDNN's block backward, with the merged output and
    log-sum-exp, at Qwen3.5-27B's head shapes (24 query heads over 4 key
    heads of 256), against float64 autograd on the same bf16 inputs: within
    four times the error of the bf16 forward. Earlier keys in blocks of 128.
    `after`: every query after every key (right-padded queries)."""
    monkeypatch.setattr(attention_kernels, "FLASH_KEY_BLOCK", 128)
    kernel = attention_kernels.KERNELS[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    n, d = 256, 256
    rand = lambda *shape: torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q, grad_out = rand(1, 24, n, d), rand(1, 24, n, d)
    keys, values = rand(1, 4, earlier + n, d), rand(1, 4, earlier + n, d)
    exact = [t.double().requires_grad_() for t in (q, keys, values)]
    causal = torch.ones(n, earlier + n, dtype=torch.bool, device="cuda").tril(earlier)
    want = F.scaled_dot_product_attention(*exact, attn_mask=None if after else causal, enable_gqa=True)
    want_grads = torch.autograd.grad(want, exact, grad_out.double())
    with torch.no_grad():
        out, *grads = _blocked_grads(q, keys, values, grad_out, None, kernel, after=after)
    forward_error = (out.double() - want).abs().max() / want.abs().max()
    assert forward_error < 1e-2
    for got, expected in zip(grads, want_grads):
        error = (got.double() - expected).abs().max() / expected.abs().max()
        assert error < 4 * max(forward_error, 4e-3), (name, error, forward_error)


@pytest.mark.parametrize("mode,kind", [  # in CI every kind exact, detached on Qwen3; `-m slow` the rest
    pytest.param(mode, kind, marks=[pytest.mark.slow] if mode == "detached" and kind != "qwen3" else [])
    for mode in ("exact", "detached")
    for kind in ("plain", "plain_repeat", "plain_explicit_mask", "plain_window_mask", "qwen3")
])
def test_single_key_blocks_end_to_end(kind, mode, monkeypatch):
    """Every state position is its own backward block (d(state) is assembled
    from one-position pieces) and the gradients still match eager."""
    monkeypatch.setattr(attention_kernels, "MATH_BLOCK_SCORES", 1)
    check_parity(kind, mode, G=2, P=11, R=5, chunk=4)


def test_flash_is_chosen_only_where_it_applies():
    q = torch.empty(1, 4, 3, 64, dtype=torch.bfloat16, device="meta")
    assert attention_kernels.kernel_for(q, None) is attention_kernels.MATH  # not CUDA
    assert attention_kernels.kernel_for(q.to(torch.float64), None) is attention_kernels.MATH


def test_kernel_follows_pytorchs_sdpa_switches():
    """On CUDA half precision: the first backend in PyTorch's SDPA priority
    order that its switches leave on (flash, cuDNN, or the explicit softmax
    for math); the explicit softmax with a mask or in float32. Fake CUDA
    tensors need no GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with FakeTensorMode():
        q = torch.empty(1, 4, 3, 64, dtype=torch.bfloat16, device="cuda")
        mask = torch.ones(3, 3, dtype=torch.bool, device="cuda")
        q32 = q.float()
    assert attention_kernels.kernel_for(q, None) is attention_kernels.FLASH
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        assert attention_kernels.kernel_for(q, None) is attention_kernels.CUDNN
        assert attention_kernels.kernel_for(q, mask) is attention_kernels.MATH
        assert attention_kernels.kernel_for(q32, None) is attention_kernels.MATH
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
        assert attention_kernels.kernel_for(q, None) is attention_kernels.FLASH  # PyTorch's order: flash first
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION], set_priority=True):
        assert attention_kernels.kernel_for(q, None) is attention_kernels.CUDNN
    with sdpa_kernel([SDPBackend.MATH, SDPBackend.CUDNN_ATTENTION]):
        assert attention_kernels.kernel_for(q, None) is attention_kernels.MATH  # math comes before cuDNN
    with sdpa_kernel(SDPBackend.MATH):
        assert attention_kernels.kernel_for(q, None) is attention_kernels.MATH


def test_cudnn_forward_merges_its_calls(monkeypatch):
    """cuDNN runs the step's own causal square and the blocks of keys before it
    as separate calls; their log-sum-exp merge must equal attention over all keys. The
    cuDNN call is stood in for by the explicit-softmax kernel on the CPU."""

    def call(q, keys, values, causal, scale):  # top-left causal, as cuDNN aligns it
        group = q.shape[1] // keys.shape[1]
        k, v = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
        if causal:
            s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
        return s.softmax(-1) @ v, s.logsumexp(-1)

    monkeypatch.setattr(attention_kernels.CudnnKernel, "_call", staticmethod(call))
    monkeypatch.setattr(attention_kernels, "FLASH_KEY_BLOCK", 4)  # earlier keys in three blocks
    gen = torch.Generator().manual_seed(0)
    n, o = 5, 9
    q = torch.randn(1, 4, n, 8, generator=gen, dtype=torch.float64)
    keys, values = (torch.randn(1, 2, o + n, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    for start in (0, o):
        k, v = keys[..., : start + n, :], values[..., : start + n, :]
        out, lse = attention_kernels.CUDNN.forward(q, k, v, None, None, start)
        want_out, want_lse = attention_kernels.MATH.forward(q, k, v, None, None, start)
        torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)


class _AttentionForwards:
    """Counts the causal attention forwards run over prompt chunks (queries
    before the prompt's end) and over branches, at the kernel."""

    def __init__(self, prompt_len: int, monkeypatch) -> None:
        from longstraw.runtime.kernels import attention_over_state as attention

        self.prompt_len, self.prompt, self.branch = prompt_len, 0, 0
        kernel_for = attention.kernel_for

        def counting(q, mask):
            kernel = kernel_for(q, mask)
            forward = kernel.forward

            class Counted:
                def __getattr__(_, name):
                    return getattr(kernel, name)

                def forward(_, q, keys, values, mask, scale, q_start):
                    if q_start + q.shape[-2] <= self.prompt_len:
                        self.prompt += 1
                    else:
                        self.branch += 1
                    return forward(q, keys, values, mask, scale, q_start)

            return Counted()

        monkeypatch.setattr(attention, "kernel_for", counting)


def _attention_run(monkeypatch, kind: str, recompute: bool, device: str = "cpu", dtype=torch.float64, **options):
    """(loss, grads, forwards) of an exact step of a 4-chunk prompt."""
    from longstraw.models import qwen3_5

    from helpers.harness import compile_loss, compiled_loss_and_grads
    from helpers.losses import grpo_loss_f64
    from helpers.tiny_models import make_group, make_model, make_qwen3_5

    torch.manual_seed(0)
    model = (make_qwen3_5() if kind == "qwen3_5" else make_model(kind)).to(device, dtype)
    group = [t.to(device) for t in make_group(2, 32, 5)]
    backend = longstraw.Backend(prefix_chunk_size=8, recompute_layers=recompute, **options)
    with monkeypatch.context() as patch:
        counted = _AttentionForwards(31, patch)
        with qwen3_5.bound():
            loss, grads = compiled_loss_and_grads(compile_loss(grpo_loss_f64, backend), model, *group)
    return loss, grads, counted


@pytest.mark.parametrize("kind, recompute", [("qwen3", False), ("qwen3", True), ("qwen3_5", True)])
def test_attention_outputs_on_host_skip_the_reverse_forward(kind, recompute, monkeypatch):
    """`attention_outputs_on_host`: the reverse pass reads each prompt
    chunk's attention output and log-sum-exp kept by the capture instead
    of running the forward again, and the gradients are bit for bit the same."""
    loss, grads, without = _attention_run(monkeypatch, kind, recompute)
    kept_loss, kept_grads, kept = _attention_run(monkeypatch, kind, recompute, attention_outputs_on_host=True)
    assert torch.equal(loss, kept_loss)
    assert grads.keys() == kept_grads.keys() and all(torch.equal(grads[n], kept_grads[n]) for n in grads)
    layers = kept.prompt // 4  # four prompt chunks, each captured once
    assert layers > 0 and kept.prompt == 4 * layers
    assert without.prompt == 2 * kept.prompt  # the reverse pass ran every chunk's forward again
    assert kept.branch == without.branch


def test_attention_outputs_arrive_before_they_are_read(monkeypatch):
    """After the first reverse chunk (which teaches the order of reads),
    every read finds its entry on the way, and the device holds one entry
    besides the one being read."""
    from longstraw.runtime import host_offload

    reads: list[tuple[int, bool]] = []
    get = host_offload.HostAttentionOutputs.get

    def recorded(self, slot, offset):
        assert len(self.arriving) <= 1
        reads.append((offset, (slot, offset) in self.arriving))
        return get(self, slot, offset)

    monkeypatch.setattr(host_offload.HostAttentionOutputs, "get", recorded)
    _, _, kept = _attention_run(monkeypatch, "qwen3", True, attention_outputs_on_host=True)
    assert len(reads) == 2 * kept.prompt  # each chunk and layer: the forward, then its recomputation
    first = max(offset for offset, _ in reads)  # the reverse pass starts at the last chunk
    assert not any(hit for offset, hit in reads if offset == first)
    assert all(hit for offset, hit in reads if offset != first)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_outputs_on_host_on_cuda(dtype, monkeypatch):
    """On CUDA (host copies and back, flash or cuDNN in bf16, selective
    checkpointing): no reverse forward, the same loss, and gradients equal
    (float32, the math kernel) or as close as two bf16 runs are."""
    loss, grads, without = _attention_run(monkeypatch, "qwen3", True, "cuda", dtype)
    kept_loss, kept_grads, kept = _attention_run(monkeypatch, "qwen3", True, "cuda", dtype, attention_outputs_on_host=True)
    assert without.prompt == 2 * kept.prompt > 0
    assert torch.equal(loss, kept_loss)
    for name in grads:
        if dtype == torch.float32:
            assert torch.equal(grads[name], kept_grads[name]), name
        else:
            scale = grads[name].float().abs().max().clamp_min(1e-30)
            assert (grads[name].float() - kept_grads[name].float()).abs().max() / scale < 2e-2, name


def test_attention_outputs_are_not_kept_past_the_host_reserve(monkeypatch, caplog):
    """Short of host memory, nothing is kept: the reverse pass recomputes, with a warning."""
    from longstraw.runtime import host_offload

    monkeypatch.setattr(host_offload, "host_memory", lambda: (1 << 20, 1 << 30))
    loss, grads, without = _attention_run(monkeypatch, "qwen3", False)
    with caplog.at_level("WARNING", logger="longstraw.runtime.host_offload"):
        kept_loss, kept_grads, kept = _attention_run(monkeypatch, "qwen3", False, attention_outputs_on_host=True)
    assert kept.prompt == without.prompt
    assert torch.equal(loss, kept_loss) and all(torch.equal(grads[n], kept_grads[n]) for n in grads)
    assert "attention outputs from position 0 on are recomputed" in caplog.text


def test_verify_state_checks_the_kept_attention_outputs(monkeypatch):
    """With `verify_state`, a kept output that differs from the recomputed
    one (a step that is not deterministic) raises, and no .grad changes."""
    from longstraw.runtime import host_offload

    keep = host_offload.HostAttentionOutputs.keep
    monkeypatch.setattr(host_offload.HostAttentionOutputs, "keep",
                        lambda self, slot, offset, out, lse: keep(self, slot, offset, out + 1e-9, lse))
    with pytest.raises(longstraw.LongStrawError, match="with other values than the capture kept"):
        _attention_run(monkeypatch, "qwen3", False, attention_outputs_on_host=True, verify_state=True)


def test_attention_outputs_on_host_is_validated():
    with pytest.raises(longstraw.LongStrawError, match="attention_outputs_on_host must be a bool"):
        longstraw.Backend(attention_outputs_on_host="yes")
