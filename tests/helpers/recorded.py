"""Graphs whose nodes hold their values, as the backend's analyses read them."""

from __future__ import annotations

from typing import Any

import torch.fx as fx


class ValueRecorder(fx.Interpreter):
    """Runs a graph, keeping each node's value where the backend keeps it (`longstraw_value`)."""

    def run_node(self, n: fx.Node) -> Any:
        n.meta["longstraw_value"] = value = super().run_node(n)
        return value
