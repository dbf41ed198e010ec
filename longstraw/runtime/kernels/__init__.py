"""Kernels behind the operators the passes claim, and the policy that picks them.

Each module wraps one family of kernels (`attention`: flash, cuDNN, the
explicit softmax; `fla_gated_delta`: Gated DeltaNet through
flash-linear-attention; `fla_causal_conv`: the short causal convolution
through it), says where each applies, and is imported lazily
where a library is optional. `KernelPolicy` (`Options.kernels`) chooses
among them for one compiled loss.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Literal

from longstraw.errors import LongStrawError
from longstraw.runtime.kernels import attention, fla_causal_conv, fla_gated_delta
from longstraw.runtime.kernels.attention import CudnnGate, CudnnShapes

ATTENTION_CHOICES = ("sdpa", *attention.KERNELS)
FLA_CHOICES = ("auto", "torch")


@dataclasses.dataclass(frozen=True)
class KernelPolicy:
    """Which kernels the steps of one compiled loss run.

    `attention`: "sdpa" follows PyTorch's SDPA rules (its backend priority
    and `sdpa_kernel` switches around the call); "flash", "cudnn" or "math"
    (the explicit softmax) pick one.
    A fused kernel runs only where it applies (CUDA, 16-bit, no mask, head
    dim <= 256); elsewhere the explicit softmax does.
    `gated_delta` and `causal_conv`: "auto" runs fla's kernels where fla
    is installed and applies (CUDA, 16-bit), "torch" the PyTorch kernel
    everywhere.

    Under "sdpa", where SDPA's order picks cuDNN, cuDNN runs only at
    layouts an earlier step of this loss ran and flash at new ones
    (`attention.CudnnShapes`): a new length costs no plan builds, a
    repeated one runs cuDNN. "cudnn" runs it at every layout."""

    attention: Literal["sdpa", "flash", "cudnn", "math"] = "sdpa"
    gated_delta: Literal["auto", "torch"] = "auto"
    causal_conv: Literal["auto", "torch"] = "auto"
    cudnn_shapes: CudnnShapes = dataclasses.field(
        default_factory=CudnnShapes, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_CHOICES:
            raise LongStrawError(f"kernels['attention'] must be one of {ATTENTION_CHOICES}, got {self.attention!r}")
        for name in ("gated_delta", "causal_conv"):
            if getattr(self, name) not in FLA_CHOICES:
                raise LongStrawError(f"kernels['{name}'] must be one of {FLA_CHOICES}, got {getattr(self, name)!r}")

    def gate(self) -> CudnnGate | None:
        """The cuDNN layouts one step may run (None: no gating), taken when its forward starts."""
        return self.cudnn_shapes.gate() if self.attention == "sdpa" else None

    @contextlib.contextmanager
    def active(self, gate: CudnnGate | None = None) -> Iterator[None]:
        """Steps run inside take their kernels from this policy; `gate`: the step's (`gate()`)."""
        with contextlib.ExitStack() as stack:
            if self.attention != "sdpa":
                stack.enter_context(attention.choosing(attention.preferring(self.attention)))
            elif gate is not None:
                stack.enter_context(attention.gated(gate))
            if self.gated_delta == "torch":
                stack.enter_context(fla_gated_delta.SWITCH.off())
            if self.causal_conv == "torch":
                stack.enter_context(fla_causal_conv.SWITCH.off())
            yield
