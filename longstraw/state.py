"""Captured prompt state: what later tokens need, where it lives at run time.

A `StateSlot` is decided at compile time: one tensor in the graph (the cut
chosen by `boundary.py`) whose values at prompt positions every branch
reads. At run time each slot gets one buffer holding the prompt positions
`[0, s)` followed by scratch room for the positions of the step being run,
so a step attends to `buffer[:o + n]` without copying the prompt state. The
prompt region is written once, during capture, and never mutated after:
branch replays only write the scratch region.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx


@dataclasses.dataclass(frozen=True)
class StateSlot:
    """One captured tensor: a graph node and the layout of its buffer."""

    index: int
    node: fx.Node
    token_dim: int
    batch_dim: int | None
    shape: tuple[int, ...]  # with batch 1; the token dim holds the traced length
    dtype: torch.dtype
    reason: str  # which operator needs it, for explain/summary

    def bytes_per_position(self) -> int:
        numel = 1
        for i, size in enumerate(self.shape):
            if i != self.token_dim:
                numel *= size
        return numel * self.dtype.itemsize


class PromptState:
    """Buffers for all slots of one call, and (exact mode) their gradients."""

    def __init__(self, slots: list[StateSlot], capacity: int, prefix_len: int, device: torch.device) -> None:
        self.slots = slots
        self.prefix_len = prefix_len
        self.buffers: list[torch.Tensor] = []
        for slot in slots:
            shape = list(slot.shape)
            shape[slot.token_dim] = capacity
            self.buffers.append(torch.empty(shape, dtype=slot.dtype, device=device))
        self.grads: list[torch.Tensor] | None = None

    def allocate_grads(self) -> None:
        """d(state) for the prompt region, accumulated by replays in backward."""
        self.grads = []
        for slot, buf in zip(self.slots, self.buffers):
            self.grads.append(torch.zeros_like(buf.narrow(slot.token_dim, 0, self.prefix_len)))

    def release(self) -> None:
        self.buffers = []
        self.grads = None


@dataclasses.dataclass
class StepContext:
    """What a step graph needs besides tensors: where its positions start,
    how many there are, and the state it reads and writes."""

    state: PromptState
    offset: int
    length: int
    grad_enabled: bool

    def write(self, slot: int, value: torch.Tensor) -> torch.Tensor:
        """Store the step's new positions of a slot; returns `value` unchanged."""
        token_dim = self.state.slots[slot].token_dim
        self.state.buffers[slot].narrow(token_dim, self.offset, self.length).copy_(value.detach())
        return value

    def visible(self, slot: int) -> torch.Tensor:
        """All positions up to the end of this step: `[0, offset + length)`."""
        token_dim = self.state.slots[slot].token_dim
        return self.state.buffers[slot].narrow(token_dim, 0, self.offset + self.length)

    def accumulate_grad(self, slot: int, grad_visible: torch.Tensor) -> None:
        """Add the gradient of the positions before this step into d(state)."""
        grads = self.state.grads
        if grads is None or self.offset == 0:
            return
        token_dim = self.state.slots[slot].token_dim
        grads[slot].narrow(token_dim, 0, self.offset).add_(grad_visible.narrow(token_dim, 0, self.offset))


def write_state(ctx: StepContext, slot: int, value: torch.Tensor) -> torch.Tensor:
    """Graph-level call emitted after every captured node (see stepgraph.py)."""
    return ctx.write(slot, value)
