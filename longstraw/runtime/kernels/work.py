"""A kernel's own count of its arithmetic, for the planner's count of a step's work.

`planning.step_time.WorkRecorder` counts the FLOPs of every operator a step
dispatches (PyTorch's `flop_registry`). Two kinds of kernel defeat such a
count: fused kernels that are not operators count nothing (fla's Triton
kernels), and block-wise PyTorch kernels count whole blocks (the chunked
gated delta rule pads a span to 64-position chunks, so a span of 14
positions counts as 64; on fake tensors its scan over the chunks does not
run at all). Such a kernel runs inside `counted_as(flops)`: while a
counter listens (`listening`), what the kernel dispatches inside adds no
FLOPs, and `flops()` does, once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import ContextManager, Protocol


class WorkCounter(Protocol):
    def counted_as(self, flops: float) -> ContextManager[None]:
        """Add `flops` to the step being counted and count no FLOPs of what
        is dispatched inside."""


_COUNTERS: list[WorkCounter] = []
"""The counters listening, innermost last. Module state, not a context
variable: a backward on a GPU runs in the autograd engine's device thread."""


@contextlib.contextmanager
def listening(counter: WorkCounter) -> Iterator[None]:
    _COUNTERS.append(counter)
    try:
        yield
    finally:
        _COUNTERS.remove(counter)


_NOT_COUNTING = contextlib.nullcontext()


def counted_as(flops: Callable[[], float]) -> ContextManager[None]:
    """Run a kernel whose arithmetic is `flops()` (called only while a
    counter listens). Every carried step of a run takes this: with no
    counter listening it is a shared no-op, no generator made per call."""
    if not _COUNTERS:
        return _NOT_COUNTING
    return _COUNTERS[-1].counted_as(flops())
