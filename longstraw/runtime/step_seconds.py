"""What the forward's steps took on the device, for choosing between steps of
several branch rows and kept graphs by time (decision 0045).

Steps of several rows launch a step's kernels once for its rows; where a
step is bound by launching kernels (the Qwen3.5 hybrid's: fla's recurrent
kernels, many small operators a layer) that is most of its time, and where
it is bound by arithmetic (the dense slice's) it saves little. What the
room those rows take costs instead is kept graphs: each saves its positions'
second forward. Which weighs more is the device's to say: each prompt chunk
and branch step of a real call on CUDA is timed with a pair of CUDA events,
read once both completed (`settle`, at the next call: no synchronisation),
and kept as the least seconds per position seen for its kind and row count
(the first steps of a shape compile kernels: the least is the steady one).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

Kind = tuple[str, int]
"""("prompt", 1) for a prompt chunk, ("branch", rows) for a branch step of that many rows."""


class StepSeconds:
    """The least forward seconds per position measured for each `Kind`
    (`measured`: shared by one compiled loss's plans, as the kept graphs'
    bytes are: a step's time per position hardly depends on the prompt's
    length), and the timings not read yet."""

    def __init__(self, measured: dict[Kind, float] | None = None) -> None:
        self.measured: dict[Kind, float] = {} if measured is None else measured
        self._pending: list[tuple[Kind, int, torch.cuda.Event, torch.cuda.Event]] = []

    @contextlib.contextmanager
    def timing(self, kind: Kind, positions: int, device: torch.device, enabled: bool = True) -> Iterator[None]:
        """Around a step's forward over `positions` positions (rows times
        their length): on CUDA, events before and after it; none where not
        `enabled` (a step on fake tensors in the planner's simulation, or of
        a plan that never reads the timings)."""
        if device.type != "cuda" or not enabled:
            yield
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self._pending.append((kind, positions, start, end))

    def settle(self) -> None:
        """Read the timings whose steps completed; keep the others for later."""
        waiting = []
        for kind, positions, start, end in self._pending:
            if not end.query():
                waiting.append((kind, positions, start, end))
                continue
            per_position = start.elapsed_time(end) / 1e3 / max(positions, 1)
            self.measured[kind] = min(self.measured.get(kind, math.inf), per_position)
        self._pending = waiting

    def branch(self, rows: int, positions: int) -> float | None:
        """A step of `rows` branch rows of `positions` positions each, or None where none was measured."""
        per_position = self.measured.get(("branch", rows))
        return None if per_position is None else per_position * rows * positions

    def prompt(self, positions: int) -> float | None:
        """A prompt's forward over `positions` positions, or None where no chunk was measured."""
        per_position = self.measured.get(("prompt", 1))
        return None if per_position is None else per_position * positions
