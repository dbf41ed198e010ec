"""The room for kept graphs a test sets, and a device that measures them."""

from __future__ import annotations

import pytest

from longstraw import pipeline
from longstraw.planning.sizing import KeptRoom
from longstraw.runtime import kept_graphs


def room_for_graphs(monkeypatch: pytest.MonkeyPatch, graphs: int = 3) -> dict[str, int]:
    """Every plan gets room for `graphs` planned graphs (kept graphs, and
    branch rows beside them), and every step that keeps its graph leaves a
    tenth of the first plan's planned graph allocated (what the device tells
    on CUDA, `kept_graphs.allocated`). Returns `{"graph": that planned graph's bytes}`."""
    sized = pipeline.size_plan
    planned: dict[str, int] = {}

    def with_room(program, *args):
        options, room = sized(program, *args)
        planned.setdefault("graph", room.graph_chunk)
        spare = graphs * room.graph_chunk
        return options, KeptRoom(0, spare, room.graph_chunk, room.step, spare)

    held = [0]

    def allocated(device):
        held[0] += planned["graph"] // 10
        return held[0]

    monkeypatch.setattr(pipeline, "size_plan", with_room)
    monkeypatch.setattr(kept_graphs, "allocated", allocated)
    return planned
