"""benchmarks/planning_bench.py on the tiny dense slice: Dynamo compiles the
loss twice (static, then dynamic at the second shape) and never again, and
every new length is planned, with the plan's seconds split by stage."""

from __future__ import annotations

import argparse
import gc
import sys

from helpers.paths import BENCHMARKS

sys.path.insert(0, str(BENCHMARKS))
from planning_bench import FullCollections, plan_loop, table  # noqa: E402


def test_new_lengths_plan_without_recompiling():
    args = argparse.Namespace(model="dense", mode="exact", P=128, R=16, prompts=2, G=2, steps=4, seed=0, tiny=True)
    calls = plan_loop(args)
    assert [c["dynamo_compiled"] for c in calls] == [True, True, False, False]
    assert len({(tuple(c["prompt_lengths"]), c["R"]) for c in calls}) == 4  # four new signatures, four plans
    for call in calls:
        assert call["plan_s"] > 0
        assert abs(call["specialize_s"] + call["analysis_s"] + call["memory_s"] - call["plan_s"]) < 1e-9
        assert call["full_collections"] >= 0 and call["full_collection_s"] <= call["wall_s"]
    assert "| 4 | 2 |" in table({"calls": calls}) and "full collections" in table({"calls": calls})
    assert not any(isinstance(c, FullCollections) for c in gc.callbacks)  # the counter leaves with the loop
