"""An on/off switch for one optional kernel family.

`KernelPolicy.active` turns a family off for the steps of one compiled
loss ("torch" in `Options.kernels`); the family's `applies` reads it.
Switches nest: a family is off while any `off()` around the call is open.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class KernelSwitch:
    def __init__(self, family: str) -> None:
        self.family = family
        self._offs = 0

    @property
    def on(self) -> bool:
        return self._offs == 0

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        """The family's kernels are not used by steps run inside."""
        self._offs += 1
        try:
            yield
        finally:
            self._offs -= 1

    def __repr__(self) -> str:
        return f"KernelSwitch({self.family!r}, on={self.on})"
