"""HF's once-only logging calls: no-ops in Dynamo traces, not graph breaks.

transformers adds `warning_once`, `info_once` and `warning_advice` to
`logging.Logger` and calls them inside model forwards (the default
`gradient_checkpointing_enable()` logs "`use_cache=True` is incompatible
with gradient checkpointing" on every training forward). Dynamo breaks the
graph at any logger call it is not told to ignore, and LongStraw needs the
whole loss in one graph.

Importing longstraw adds these three functions, once transformers' logging
module is imported, to `torch._dynamo.config.ignore_logging_functions`
(`substitute_in_traces`, see `longstraw.models`). A traced call then logs
nothing and costs nothing; eager calls log as before. The functions exist
only because transformers defines them, so this touches no other logging
in the process; it holds for every compiled graph, whatever its backend,
as the other bindings do (a backend cannot scope Dynamo's tracing config:
`torch.compile` does not pass a backend's context to the trace). Any other
logger call inside the loss still breaks the graph, and LongStraw's error
names the logger method to add to that set.
"""

from __future__ import annotations

import types

import torch._dynamo.config

ONCE_METHODS = ("warning_once", "info_once", "warning_advice")


def substitute_in_traces(module: types.ModuleType) -> None:
    """Ignore transformers' once-only logging methods in every Dynamo trace."""
    for name in ONCE_METHODS:
        function = getattr(module, name, None)
        if function is not None:
            torch._dynamo.config.ignore_logging_functions.add(function)
