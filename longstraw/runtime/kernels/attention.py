"""Attention kernels for the attention pass's steps: queries at positions
`[o, o+n)` over keys `[0, o+n)`, forward over all keys (output and
log-sum-exp), backward over one block of keys at a time.

`kernel_for` picks one the way SDPA would: PyTorch's flash attention and
cuDNN where they apply, in PyTorch's backend priority order and under its
`sdpa_kernel` switches; the explicit softmax elsewhere. Each choice is
logged on `longstraw.attention` at DEBUG level.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator

import torch
from torch.nn.attention import SDPBackend

from longstraw.runtime.mask_block import MaskBlock

log = logging.getLogger("longstraw.attention")


class AttentionKernel:
    """Attention of queries at positions `[o, o+n)` over keys `[0, o+n)`,
    causal unless a mask is given: forward over all keys returning the
    output and log-sum-exp, backward over one block of keys at a time.
    `q_start` at or past the last key places every query after every key:
    attention over all of them (right-padded queries, `attention_over_state.AttentionOverSpan`)."""

    def forward(self, q, keys, values, mask, scale, q_start: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def backward(self, grad_out, q, keys, values, out, lse, mask, scale, q_start: int, k_start: int):
        """dQ (partial), dK, dV of the key block starting at position k_start."""
        raise NotImplementedError

    def blocks(self, q: torch.Tensor, q_start: int) -> list[tuple[int, int]]:
        """(start, length) key blocks covering `[0, q_start)` and the step's own positions, never both."""
        return [(q_start, q.shape[-2]), *self.earlier_blocks(q, q_start)]

    def earlier_blocks(self, q: torch.Tensor, end: int) -> list[tuple[int, int]]:
        """(start, length) key blocks covering `[0, end)`."""
        raise NotImplementedError


def _split(start: int, end: int, size: int) -> list[tuple[int, int]]:
    return [(s, min(size, end - s)) for s in range(start, end, size)]


class FlashKernel(AttentionKernel):
    """PyTorch's flash attention (CUDA, fp16/bf16, no explicit mask): native
    GQA, lower-right causal alignment when there are more keys than queries,
    and the log-sum-exp the block backward needs."""

    def forward(self, q, keys, values, mask, scale, q_start):
        return self._flash(q, keys, values, q_start < keys.shape[-2], scale)

    @staticmethod
    def _flash(q, keys, values, causal, scale):
        """(output, log-sum-exp) of one flash call, lower-right causal where `causal`."""
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, keys, values, 0.0, causal, False, scale=scale)
        return out, lse

    def backward(self, grad_out, q, keys, values, out, lse, mask, scale, q_start, k_start):
        unused = torch.empty((), dtype=torch.long, device=q.device)  # philox seed/offset: no dropout
        # the kernel reads the log-sum-exp as a contiguous [B, H, n] buffer, whatever its strides say: a
        # merged one (`RowsOverState`'s rows, laid out from a transpose) is made contiguous here
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, keys, values, out, lse.contiguous(), None, None, q.shape[-2], keys.shape[-2],
            0.0, k_start == q_start, unused, unused, scale=scale,
        )

    # `blocks`: the own positions are one causal square (flash aligns causal masks lower-right)

    def earlier_blocks(self, q, end):
        return _split(0, end, FLASH_KEY_BLOCK)


class CudnnKernel(FlashKernel):
    """cuDNN's fused attention (Hopper: faster than flash at prompt-capture
    shapes and head dim 256). cuDNN takes grouped K/V natively but only
    top-left causal alignment, so the step's own positions (one causal
    square) and the keys before them, in blocks of FLASH_KEY_BLOCK, are
    separate calls merged by their log-sum-exp; the backward runs on the
    same blocks with the merged output and log-sum-exp, like flash's. Fixed
    block lengths let cuDNN reuse its execution plans from chunk to chunk
    (each new shape builds one). Under a `CudnnGate` (`gated`), a block
    whose layout no earlier step ran goes to flash instead, where flash is
    switched on: same blocks, same merge, no plan to build."""

    def forward(self, q, keys, values, mask, scale, q_start):
        out, lse = None, None
        compute = compute_dtype(q)
        after = q_start >= keys.shape[-2]
        for start, length in self.earlier_blocks(q, keys.shape[-2]) if after else self.blocks(q, q_start):
            own = start == q_start
            kb, vb = keys.narrow(-2, start, length), values.narrow(-2, start, length)
            call = self._call if _admits("forward", own, q, kb, vb) else self._flash
            o, s = call(q, kb, vb, own, scale)
            o, s = o.to(compute), s.to(compute)
            if out is None:
                out, lse = o, s
                continue
            new = torch.logaddexp(lse, s)
            out = out * torch.exp(lse - new)[..., None] + o * torch.exp(s - new)[..., None]
            lse = new
        return out.to(q.dtype), lse

    def backward(self, grad_out, q, keys, values, out, lse, mask, scale, q_start, k_start):
        if not _admits("backward", k_start == q_start, q, keys, values, grad_out, out, lse):
            return super().backward(grad_out, q, keys, values, out, lse.float(), mask, scale, q_start, k_start)
        # attn_bias, cumulative lengths and the philox seed/offset are absent (no bias, no varlen, no dropout)
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            grad_out, q, keys, values, out, lse.float().contiguous().unsqueeze(-1), None, None, None, None, None,
            q.shape[-2], keys.shape[-2], 0.0, k_start == q_start, scale=scale,
        )

    @staticmethod
    def _call(q, keys, values, causal, scale):
        out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(q, keys, values, None, True, 0.0, causal, False, scale=scale)
        return out, lse.reshape(q.shape[:-1])


ShapeKey = tuple


class CudnnShapes:
    """The cuDNN attention shapes one compiled loss's steps have run.

    cuDNN builds and compiles an execution plan for every new layout (sizes
    and strides; on the H100 a first call at new prompt lengths spent 7 of
    its 9 s there: `benchmarks/results/step_profile_new_length_h100.json`).
    A loop whose prompt and completion lengths change every step meets new
    layouts at every step, while the capture's full chunks recur. `gate()`
    hands a step the layouts earlier steps ran: cuDNN runs those (its plans
    are built), flash the rest. It remembers the last `CUDNN_SHAPES_KEPT`
    layouts, so a long run of new lengths does not grow it without end.
    Calls over fewer than `CUDNN_MIN_KEYS` keys always run flash, which is
    as fast there, so no plan is built for them at all."""

    def __init__(self) -> None:
        self.seen: dict[ShapeKey, None] = {}  # in the order first met
        self.calls = {"cudnn": 0, "flash": 0}  # gated calls so far, by the kernel that ran

    def gate(self) -> CudnnGate:
        return CudnnGate(frozenset(self.seen), self)

    def count(self, admitted: bool) -> None:
        self.calls["cudnn" if admitted else "flash"] += 1

    def record(self, key: ShapeKey, admitted: bool) -> None:
        self.count(admitted)
        if key not in self.seen:
            self.seen[key] = None
            if len(self.seen) > CUDNN_SHAPES_KEPT:
                del self.seen[next(iter(self.seen))]


@dataclasses.dataclass(frozen=True)
class CudnnGate:
    """One step's view of `CudnnShapes`: `allowed` is frozen when the step's
    forward starts and its backward reuses it, so a prompt recaptured in the
    backward runs the forward's kernels; the layouts the step meets are
    recorded in `shapes`, for later steps."""

    allowed: frozenset[ShapeKey]
    shapes: CudnnShapes

    def admits(self, key: ShapeKey) -> bool:
        admitted = key in self.allowed
        self.shapes.record(key, admitted)
        return admitted


CUDNN_SHAPES_KEPT = 16384
CUDNN_MIN_KEYS = 65536
"""A gated call over fewer keys runs flash: on the H100 a loop of new lengths
at P = 8K and 32K (flash at every call) ran as fast as the warm cuDNN step
once planning is taken out, while a layout met a second time built cuDNN
plans for seconds (`benchmarks/results/length_loop_strided_h100.json`,
`step_profile_new_length_strided_h100.json`). At 262K-position capture
chunks cuDNN is 1.6x flash (decision 0025); in between is not measured."""


_GATES: list[CudnnGate] = []


@contextlib.contextmanager
def gated(gate: CudnnGate) -> Iterator[None]:
    """cuDNN calls inside run only at layouts `gate` admits; flash runs the others."""
    _GATES.append(gate)
    try:
        yield
    finally:
        _GATES.remove(gate)


def _admits(direction: str, causal: bool, *tensors: torch.Tensor) -> bool:
    """Whether the innermost gate admits this cuDNN call. The key is what
    cuDNN keys its plans on: sizes and strides (a K/V view's strides follow
    the state buffer's capacity, so the same sizes at a new prompt length
    are a new plan), dtype, device, causality. With flash switched off
    (`sdpa_kernel` without FLASH_ATTENTION) every call runs cuDNN, as asked."""
    if not _GATES or not torch.backends.cuda.flash_sdp_enabled():
        return True
    if tensors[1].shape[-2] < CUDNN_MIN_KEYS:
        _GATES[-1].shapes.count(False)  # not remembered: it never runs cuDNN
        return False
    layout = tuple((tuple(t.shape), t.stride()) for t in tensors)
    return _GATES[-1].admits((direction, causal, layout, tensors[0].dtype, tensors[0].device))


class MathKernel(AttentionKernel):
    """Explicit softmax over key blocks, in at least float32 (float64 stays
    float64): every device, dtype and mask. It materialises one
    [heads, n, block] score block at a time, `MATH_BLOCK_SCORES` elements."""

    def forward(self, q, keys, values, mask, scale, q_start):
        compute = compute_dtype(q)
        lse = torch.full(_grouped(q, keys).shape[:-1], float("-inf"), dtype=compute, device=q.device)
        out = torch.zeros(*lse.shape, values.shape[-1], dtype=compute, device=q.device)
        after = q_start >= keys.shape[-2]
        for start, length in self.earlier_blocks(q, keys.shape[-2]) if after else self.blocks(q, q_start):
            cols = None if mask is None else mask.columns(start, length)
            s = _scores(q, keys.narrow(-2, start, length), cols, scale, q_start, start)
            new = torch.logaddexp(lse, s.logsumexp(-1))
            finite = torch.where(new.isneginf(), 0.0, new)  # rows that see nothing yet
            p = torch.exp(s - finite[..., None])
            out = out * torch.exp(lse - finite)[..., None] + torch.einsum(
                "bhgnm,bhme->bhgne", p, values.narrow(-2, start, length).to(compute)
            )
            lse = new
        return _ungrouped(out).to(q.dtype), _ungrouped(lse)

    def backward(self, grad_out, q, keys, values, out, lse, mask, scale, q_start, k_start):
        compute = compute_dtype(q)
        s = _scores(q, keys, mask, scale, q_start, k_start)
        lse = _grouped(q, keys, lse)
        # a row that sees no key (a left-padded query) has output 0 and no gradient, as in SDPA
        p = torch.exp(s - torch.where(lse.isneginf(), 0.0, lse)[..., None])
        do, o = _grouped(q, keys, grad_out).to(compute), _grouped(q, keys, out).to(compute)
        kb, vb, qg = keys.to(compute), values.to(compute), _grouped(q, keys).to(compute)
        grad_v = torch.einsum("bhgnm,bhgne->bhme", p, do)
        ds = p * (torch.einsum("bhgne,bhme->bhgnm", do, vb) - (do * o).sum(-1, keepdim=True))
        scale = _scale(q, scale)
        grad_q = torch.einsum("bhgnm,bhmd->bhgnd", ds, kb) * scale
        grad_k = torch.einsum("bhgnm,bhgnd->bhmd", ds, qg) * scale
        return _ungrouped(grad_q), grad_k.to(keys.dtype), grad_v.to(values.dtype)

    def blocks(self, q, q_start):
        n = q.shape[-2]
        return [*_split(q_start, q_start + n, self._size(q)), *self.earlier_blocks(q, q_start)]

    def earlier_blocks(self, q, end):
        return _split(0, end, self._size(q))

    @staticmethod
    def _size(q: torch.Tensor) -> int:
        return max(1, MATH_BLOCK_SCORES // (q.shape[-3] * q.shape[-2]))


FLASH_KEY_BLOCK = 65536
MATH_BLOCK_SCORES = 1 << 24
FLASH, CUDNN, MATH = FlashKernel(), CudnnKernel(), MathKernel()


Chooser = Callable[[torch.Tensor, "MaskBlock | None"], "AttentionKernel"]
_CHOOSERS: list[Chooser] = []


@contextlib.contextmanager
def choosing(chooser: Chooser) -> Iterator[None]:
    """Steps run while this is active take their attention kernel from
    `chooser(q, mask)` instead of SDPA's rules (the memory planner
    simulates a GPU's kernels this way on fake tensors)."""
    _CHOOSERS.append(chooser)
    try:
        yield
    finally:
        _CHOOSERS.remove(chooser)


def kernel_for(q: torch.Tensor, mask: MaskBlock | None) -> AttentionKernel:
    """The kernel for queries `q` [B, H, n, D] under `mask` (None: causal), logged."""
    kernel = _CHOOSERS[-1](q, mask) if _CHOOSERS else choose(q, mask)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("%s %s %s n=%d", type(kernel).__name__, "causal" if mask is None else "masked", q.dtype, q.shape[-2])
    return kernel


def choose(q: torch.Tensor, mask: MaskBlock | None) -> AttentionKernel:
    """Where a fused kernel applies, the kernel of the first backend in
    PyTorch's SDPA priority order that its switches leave on: flash, cuDNN
    (forward), or the explicit softmax for math and memory-efficient. So
    `sdpa_kernel(SDPBackend.CUDNN_ATTENTION)` selects cuDNN, and
    `sdpa_kernel([CUDNN_ATTENTION, FLASH_ATTENTION], set_priority=True)`
    prefers it. Read when the step runs, so the switches can be set around
    the compiled call."""
    if not fused_applies(q, mask):
        return MATH
    switches = torch.backends.cuda
    kernels = {
        int(SDPBackend.FLASH_ATTENTION): (switches.flash_sdp_enabled, FLASH),
        int(SDPBackend.CUDNN_ATTENTION): (switches.cudnn_sdp_enabled, CUDNN),
        int(SDPBackend.MATH): (switches.math_sdp_enabled, MATH),
        int(SDPBackend.EFFICIENT_ATTENTION): (switches.mem_efficient_sdp_enabled, MATH),
    }
    for backend in _sdpa_priority():
        if backend in kernels and kernels[backend][0]():
            return kernels[backend][1]
    return MATH


def fused_applies(q: torch.Tensor, mask: MaskBlock | None) -> bool:
    """Whether flash and cuDNN can run these queries: CUDA, 16-bit, no mask, head dim up to 256 in steps of 8."""
    head_dim = q.shape[-1]
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and mask is None and head_dim <= 256 and head_dim % 8 == 0


KERNELS = {"flash": FLASH, "cudnn": CUDNN, "math": MATH}


def preferring(name: str) -> Chooser:
    """A chooser for `choosing`: the named kernel where it applies, the explicit softmax elsewhere."""
    kernel = KERNELS[name]
    return lambda q, mask: kernel if kernel is MATH or fused_applies(q, mask) else MATH


def _sdpa_priority() -> list[int]:
    """PyTorch's SDPA backend priority, set by `sdpa_kernel(..., set_priority=True)`."""
    get = getattr(torch._C, "_get_sdp_priority_order", None)  # private: fall back to its default order
    if get is None:
        return [int(b) for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH, SDPBackend.CUDNN_ATTENTION)]
    return list(get())


def compute_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.promote_types(q.dtype, torch.float32)


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return q.shape[-1] ** -0.5 if scale is None else scale


def _grouped(q: torch.Tensor, keys: torch.Tensor, x: torch.Tensor | None = None) -> torch.Tensor:
    """[B, Hq, n, ...] -> [B, Hkv, Hq/Hkv, n, ...]: query head j reads key head j // (Hq/Hkv)."""
    x = q if x is None else x
    b, hq, hkv = q.shape[0], q.shape[1], keys.shape[1]
    return x.reshape(b, hkv, hq // hkv, *x.shape[2:])


def _ungrouped(x: torch.Tensor) -> torch.Tensor:
    return x.flatten(1, 2)


def _scores(q, keys, mask, scale, q_start: int, k_start: int) -> torch.Tensor:
    """Scaled scores [B, Hkv, g, n, m] of queries at `q_start...` over keys at
    `k_start...`, with the mask block applied (causal by position without one)."""
    compute = compute_dtype(q)
    s = torch.einsum("bhgnd,bhmd->bhgnm", _grouped(q, keys).to(compute), keys.to(compute)) * _scale(q, scale)
    n, m = s.shape[-2], s.shape[-1]
    if mask is None:
        if k_start + m - 1 > q_start:  # some key is later than the first query
            later = torch.ones(n, m, dtype=torch.bool, device=s.device).triu(q_start - k_start + 1)
            s = s.masked_fill(later, float("-inf"))
    else:
        mask = _grouped(q, keys, mask.expand(q.shape[0], q.shape[1], n, m))
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.to(compute)
    return s
