"""What the prompt leaves for later tokens, decided at compile time.

Two kinds of `StateSlot`:

- `sequence`: one tensor per position (attention K/V), the cut chosen by
  `analysis.boundary`. At run time it gets one buffer holding the prompt
  positions `[0, s)` followed by scratch room for the positions of the step
  being run (`runtime.prompt_state`).
- `carry`: a fixed-size state carried from one position range to the next
  (a recurrent matrix, a convolution's last inputs), produced by a claimed
  operator.
"""

from __future__ import annotations

import dataclasses
import enum
import math

import torch
import torch.fx as fx

from longstraw.errors import module_path


class SlotKind(enum.StrEnum):
    """How a slot's state grows: per prompt position, or a fixed-size carry."""

    SEQUENCE = "sequence"
    CARRY = "carry"


@dataclasses.dataclass(frozen=True)
class StateSlot:
    """One captured tensor: a graph node and the layout of its state."""

    index: int
    kind: SlotKind
    node: fx.Node  # sequence: the captured node; carry: the claimed operator
    token_dim: int | None  # sequence slots only
    batch_dim: int | None
    shape: tuple[int, ...]  # with batch 1; a sequence slot's token dim holds the traced length
    dtype: torch.dtype
    reason: str  # which operator needs it, for summaries and reports

    def bytes_per_position(self) -> int:
        if self.kind != SlotKind.SEQUENCE:
            return 0
        return math.prod(s for i, s in enumerate(self.shape) if i != self.token_dim) * self.dtype.itemsize

    def fixed_bytes(self) -> int:
        if self.kind != SlotKind.CARRY:
            return 0
        return math.prod(self.shape) * self.dtype.itemsize

    def label(self) -> str:
        """The slot and the layer it belongs to, for messages."""
        return f"state slot {self.index} ({self.reason}) of `{module_path(self.node) or self.node.name}`"
