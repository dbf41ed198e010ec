"""Which architecture passes a backend uses, and how passes from outside
the package get there.

Three routes, all added after the built-in passes (`passes.DEFAULT_PASSES`)
in this order:

- an entry point in the `longstraw.passes` group of an installed package
  (an `ArchitecturePass` subclass or instance), loaded once per process;
- `longstraw.register_pass(p)`, for the rest of the process;
- `options={"passes": [p, ...]}`, for one backend.

A backend takes its list when it is made, so a pass registered later
reaches backends made later. Two passes claiming one node is an error
(`partition.py`) naming both: the order never decides silently.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
from collections.abc import Iterable

from longstraw.passes import DEFAULT_PASSES, ArchitecturePass

from longstraw.errors import LongStrawError

log = logging.getLogger("longstraw.passes")

ENTRY_POINT_GROUP = "longstraw.passes"

_REGISTERED: list[ArchitecturePass] = []


def as_pass(value: object, where: str) -> ArchitecturePass:
    """An `ArchitecturePass` instance from an instance or a subclass."""
    if isinstance(value, type) and issubclass(value, ArchitecturePass):
        value = value()
    if not isinstance(value, ArchitecturePass):
        raise LongStrawError(
            f"{where}: expected an ArchitecturePass subclass or instance (longstraw.passes.ArchitecturePass), "
            f"got {value!r}"
        )
    return value


def register_pass(p: ArchitecturePass | type[ArchitecturePass]) -> ArchitecturePass:
    """Add a pass for every backend made from now on in this process; returns the instance."""
    instance = as_pass(p, "longstraw.register_pass")
    if instance not in _REGISTERED:
        _REGISTERED.append(instance)
    return instance


@functools.cache
def installed_passes() -> tuple[ArchitecturePass, ...]:
    """Passes that installed packages declare under the `longstraw.passes` entry-point group."""
    found = []
    for entry in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        where = f"entry point {entry.name} = {entry.value} (group {ENTRY_POINT_GROUP})"
        try:
            value = entry.load()
        except Exception as e:
            raise LongStrawError(f"{where} could not be loaded: {e}") from e
        found.append(as_pass(value, where))
        log.info("architecture pass %s from %s", type(found[-1]).__name__, where)
    return tuple(found)


def active_passes(extra: Iterable[ArchitecturePass] = ()) -> tuple[ArchitecturePass, ...]:
    """The built-in passes, then the installed, the registered and `extra` (each pass once)."""
    chosen: list[ArchitecturePass] = []
    for p in (*DEFAULT_PASSES, *installed_passes(), *_REGISTERED, *extra):
        if p not in chosen:
            chosen.append(p)
    return tuple(chosen)
