"""Which operators a call records or runs: what Dynamo's graph of it calls,
and what an eager call dispatches (the model bindings' tests: a trace
records LongStraw's operator, an eager call keeps HF's)."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def traced_targets(fn: Callable[..., Any], *args: Any) -> tuple[list[str], Any]:
    """The call targets of Dynamo's graph of `fn(*args)`, and what the compiled graph returns."""
    targets: list[str] = []

    def backend(gm, example_inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    return targets, torch.compile(fn, backend=backend, fullgraph=True)(*args)


class EagerOps(TorchDispatchMode):
    """The operators an eager call dispatches."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.add(str(func))
        return func(*args, **(kwargs or {}))
