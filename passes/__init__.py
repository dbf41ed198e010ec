"""Architecture passes: which operators mix positions, and how to run them
incrementally from captured state.

A pass claims nodes of the Dynamo graph (by operator and, where needed, by
module path in `node.meta["nn_module_stack"]`). For every claimed node it
names the inputs whose earlier positions later positions read (`state_inputs`)
and emits the incremental step into the step graph (`emit_step`). The core
finds the cheapest tensors to capture for those inputs and wires them in.
"""

from __future__ import annotations

from .attention import CausalAttentionPass
from .base import ArchitecturePass, CarryPass, DimRules, SiteState
from .causal_conv import CausalConvPass
from .gated_delta import GatedDeltaPass
from .kimi_delta import KimiDeltaPass
from .mla import LatentAttentionPass
from .sinks import SinkAttentionPass, SlidingSinkAttentionPass
from .sliding_window import SlidingWindowAttentionPass
from .sparse_index import SparseLatentAttentionPass
from .ssd import SSDPass

DEFAULT_PASSES: tuple[ArchitecturePass, ...] = (
    CausalAttentionPass(), SlidingWindowAttentionPass(), LatentAttentionPass(), SparseLatentAttentionPass(),
    GatedDeltaPass(), KimiDeltaPass(), CausalConvPass(), SSDPass(), SinkAttentionPass(), SlidingSinkAttentionPass(),
)

__all__ = [
    "ArchitecturePass",
    "CausalAttentionPass",
    "CarryPass",
    "CausalConvPass",
    "DEFAULT_PASSES",
    "DimRules",
    "GatedDeltaPass",
    "KimiDeltaPass",
    "LatentAttentionPass",
    "SinkAttentionPass",
    "SiteState",
    "SlidingSinkAttentionPass",
    "SlidingWindowAttentionPass",
    "SparseLatentAttentionPass",
    "SSDPass",
]
