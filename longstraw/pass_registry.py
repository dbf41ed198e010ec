"""Which architecture passes a backend uses, and how passes from outside
the package get there.

Three routes, all added after the built-in passes (`passes.DEFAULT_PASSES`)
in this order:

- an entry point in the `longstraw.passes` group of an installed package
  (an `ArchitecturePass` subclass or instance), loaded once per process;
- `longstraw.register_pass(p)`, for the rest of the process;
- `options={"passes": [p, ...]}`, for one backend.

A backend takes its list when it is made, so a pass registered later
reaches backends made later; `Options.disable_passes` leaves passes out by
name. Where several passes claim one node, a pass that declares it
`overrides` the others takes it (`claiming_pass`); otherwise two passes
claiming one node is an error naming both: the order never decides.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
from collections.abc import Iterable

from longstraw.passes import DEFAULT_PASSES, ArchitecturePass

from torch import fx

from longstraw.errors import LongStrawError, describe_node

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


def active_passes(extra: Iterable[ArchitecturePass] = (), disabled: Iterable[str] = ()) -> tuple[ArchitecturePass, ...]:
    """The built-in passes, then the installed, the registered and `extra`
    (each pass once), less those named in `disabled`."""
    chosen: list[ArchitecturePass] = []
    for p in (*DEFAULT_PASSES, *installed_passes(), *_REGISTERED, *extra):
        if p not in chosen:
            chosen.append(p)
    disabled = set(disabled)
    unknown = disabled - {p.name for p in chosen}
    if unknown:
        raise LongStrawError(
            f"disable_passes names no pass {sorted(unknown)}: the backend's passes are {[p.name for p in chosen]}"
        )
    return tuple(p for p in chosen if p.name not in disabled)


def claiming_pass(node: fx.Node, passes: tuple[ArchitecturePass, ...]) -> ArchitecturePass | None:
    """The pass that claims `node`: of those whose `claims` accept it, the
    ones no other claiming pass `overrides`; more than one left is an error,
    whatever their order (a configuration error: `on_unsupported="eager"`
    does not hide it)."""
    claiming = [p for p in passes if p.claims(node)]
    overridden = {name for p in claiming for name in p.overrides}
    left = [p for p in claiming if p.name not in overridden]
    if len(left) > 1:
        names = " and ".join(f"{type(p).__module__}.{type(p).__qualname__} ({p.name!r})" for p in left)
        raise LongStrawError(
            f"{describe_node(node)} is claimed by {len(left)} architecture passes, {names}: each operator "
            "must belong to one pass. Drop one of them (options['passes'], options['disable_passes'], "
            "longstraw.register_pass or an installed package's `longstraw.passes` entry point), narrow its "
            "`claims`, or declare which one takes precedence (`ArchitecturePass.overrides`)."
        )
    return left[0] if left else None
