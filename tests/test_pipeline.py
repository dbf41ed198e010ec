"""Planning runs as the declared pipeline, stage by stage, and each stage's output can be dumped."""

from __future__ import annotations

import gc
import logging

import pytest

import longstraw
from longstraw import pipeline
from longstraw.backend import PlanningDone
from longstraw.pipeline import PIPELINE, dumped_stages, enable_dumps, run_pipeline

from helpers.harness import compile_loss
from helpers.losses import grpo_loss_f64
from helpers.tiny_models import make_group, make_model


def test_the_stages_run_in_their_declared_order_and_each_is_dumped(caplog):
    model = make_model("qwen3")
    backend = longstraw.Backend(prefix_chunk_size=8)
    with caplog.at_level(logging.DEBUG, logger="longstraw.pipeline"):
        compile_loss(grpo_loss_f64, backend)(model, *make_group(2, 24, 4)).backward()
    dumped = [r.name.removeprefix("longstraw.pipeline.") for r in caplog.records if r.name.startswith("longstraw.pipeline.")]
    assert dumped == [stage.name for stage in PIPELINE]
    text = {r.name.removeprefix("longstraw.pipeline."): r.getMessage() for r in caplog.records}
    assert "claimed:" in text["classify"] and "causal_attention" in text["classify"]
    assert "slot 0:" in text["state"] and "slot 0:" not in text["classify"]  # the state stage adds the slots
    assert "--- branch step" in text["codegen"] and "prefix_chunk_size=8" in text["size"]
    plan = backend.plans[-1]
    assert plan.seconds.total > 0 and plan.options.prefix_chunk_size == 8


def test_a_failing_stage_keeps_the_guards_of_the_stages_before_it(monkeypatch):
    """A graph refused after `specialize` still reports the values the plan
    would have folded, so the fallback is cached under the same key."""
    def refuse(planning):
        raise longstraw.UnsupportedGraphError("refused for the test")

    at = next(i for i, s in enumerate(PIPELINE) if s.name == "classify")
    stages = list(PIPELINE)
    stages[at] = pipeline.Stage("classify", refuse, lambda p: "")
    monkeypatch.setattr(pipeline, "PIPELINE", tuple(stages))
    model = make_model("qwen3")
    backend = longstraw.Backend(prefix_chunk_size=8, on_unsupported="eager")
    with pytest.warns(UserWarning, match="refused for the test"):
        compile_loss(grpo_loss_f64, backend)(model, *make_group(2, 24, 4))
    assert [f.reason for f in backend.fallbacks] == ["refused for the test"]


def test_planning_runs_with_the_collector_off_then_collects_the_young(monkeypatch):
    """With the collector on, planning's short-lived objects that a young
    collection found alive were promoted, and every several new lengths a
    full collection walked every object Dynamo left (0.3 to 0.4 s on a
    2-core CPU). From its first stage on, with thresholds that would
    collect at every fifty allocations, planning runs no automatic
    collection; one of the young generations follows it, and the collector
    is on again."""
    started = []
    planning = []
    threshold = gc.get_threshold()

    def seen(phase, info):
        if phase == "start" and planning:
            started.append(info["generation"])

    def first_stage(p):
        gc.set_threshold(50, 1, 1)
        planning.append(True)
        return PIPELINE[0].run(p)

    def watched(p):
        try:
            return run_pipeline(p)
        finally:
            planning.clear()
            gc.set_threshold(*threshold)

    monkeypatch.setattr(pipeline, "PIPELINE", (pipeline.Stage(PIPELINE[0].name, first_stage, PIPELINE[0].dump),
                                               *PIPELINE[1:]))
    monkeypatch.setattr("longstraw.backend.run_pipeline", watched)
    backend = longstraw.Backend(prefix_chunk_size=8)
    backend.stop_after_planning = True
    gc.callbacks.append(seen)
    try:
        with pytest.raises(PlanningDone):
            compile_loss(grpo_loss_f64, backend)(make_model("qwen3"), *make_group(2, 24, 4))
    finally:
        gc.callbacks.remove(seen)
        gc.set_threshold(*threshold)
    assert started == [1] and gc.isenabled()


def test_the_dump_switch_names_stages():
    assert dumped_stages("all") == tuple(s.name for s in PIPELINE)
    assert dumped_stages("classify, codegen") == ("classify", "codegen")
    assert dumped_stages("") == ()
    with pytest.raises(longstraw.LongStrawError, match="names no stage 'partition'.*specialize, classify"):
        dumped_stages("classify,partition")


def test_enable_dumps_turns_a_stages_logger_on(monkeypatch):
    log = logging.getLogger("longstraw.pipeline.codegen")
    monkeypatch.setattr(log, "level", logging.NOTSET)
    monkeypatch.setattr(log, "handlers", [])
    monkeypatch.setenv(pipeline.DUMP_VARIABLE, "codegen")
    enable_dumps()
    assert log.isEnabledFor(logging.DEBUG) and len(log.handlers) == 1
    assert not logging.getLogger("longstraw.pipeline.size").isEnabledFor(logging.DEBUG)
