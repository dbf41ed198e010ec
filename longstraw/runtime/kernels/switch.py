"""An on/off switch for one optional kernel family.

`KernelPolicy.active` turns a family off for the steps of one compiled
loss ("torch" in `Options.kernels`); the family's `applies` reads it.
Switches nest: a family is off while any `off()` around the call is open.
The planner's simulation (`simulating()`) lets the family's path take
tensors without values, which its library could not launch on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class KernelSwitch:
    def __init__(self, family: str) -> None:
        self.family = family
        self._offs = 0
        self._simulations = 0

    @property
    def on(self) -> bool:
        return self._offs == 0

    @property
    def fakes(self) -> bool:
        """Inside `simulating()`: tensors without values (meta, fake) take
        the family's path, through its fake entry points."""
        return self._simulations > 0

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        """The family's kernels are not used by steps run inside."""
        self._offs += 1
        try:
            yield
        finally:
            self._offs -= 1

    @contextlib.contextmanager
    def simulating(self) -> Iterator[None]:
        """The planner's simulation of a device with the family's library:
        its kernels apply to tensors without values as they would to the
        device's, and allocate the library's outputs without computing."""
        self._simulations += 1
        try:
            yield
        finally:
            self._simulations -= 1

    def __repr__(self) -> str:
        return f"KernelSwitch({self.family!r}, on={self.on})"
