"""Running a step and measuring it: time, peak memory, out-of-memory, the wall-clock budget, memory breakdowns."""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import re
import time
from collections.abc import Callable, Iterator

import torch

import longstraw
from longstraw.runtime.phases import phase_of

from .models import Group, grpo_loss, make_group
from .modes import Runner, eager_step

GiB = 1e9  # decimal GB, as nvidia-smi and the issue report memory


def is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


def release(model=None) -> None:
    """Drop gradients (of `model`, when given) and cached device memory."""
    if model is not None:
        model.zero_grad(set_to_none=True)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@contextlib.contextmanager
def recorded_failure(out: dict, model) -> Iterator[None]:
    """One mode's measurement: an exception inside is recorded in `out`
    (`ok`, `oom`, `error`) instead of raised, so the other modes still run;
    the model's gradients and cached memory are released either way."""
    try:
        yield
        out["ok"] = True
    except Exception as error:  # noqa: BLE001 - a failing mode is recorded; the others still run
        out.update(ok=False, oom=is_oom(error), error=f"{type(error).__name__}: {str(error)[:400]}")
    finally:
        release(model)


@contextlib.contextmanager
def synced(record: Callable[[float], None]) -> Iterator[None]:
    """`record(seconds)` of the block, the device synchronised before and after."""
    sync()
    start = time.perf_counter()
    try:
        yield
    finally:
        sync()
        record(time.perf_counter() - start)


def timed_step(runner, batch) -> float:
    """Seconds of one `runner.step(batch)`, device-synchronised before and after."""
    seconds = []
    with synced(seconds.append):
        runner.step(batch)
    return seconds[0]


@contextlib.contextmanager
def dynamo_compiles() -> Iterator[dict[str, float]]:
    """Dynamo's compiles inside: how many (`counters`' unique graphs) and
    their wall seconds (between the compile callbacks Dynamo runs around each
    outermost compile). Not `get_compilation_metrics`: where logging the
    metrics fails (it did on the H100's torch 2.11), it records nothing."""
    from torch._dynamo.callback import callback_handler

    out = {"compiles": 0, "seconds": 0.0}
    started: list[float] = []
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]

    def start(_args) -> None:
        started.append(time.perf_counter())

    def end(_args) -> None:
        out["seconds"] += time.perf_counter() - started.pop()

    callback_handler.register_start_callback(start)
    callback_handler.register_end_callback(end)
    try:
        yield out
    finally:
        callback_handler.remove_start_callback(start)
        callback_handler.remove_end_callback(end)
        out["compiles"] = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs


@contextlib.contextmanager
def plans_made(runner) -> Iterator[list]:
    """The LongStraw plans the calls inside make (`GroupPlan`s; none for a
    peer without a LongStraw backend), filled in on exit. By identity: the
    backend keeps its last `plan_cache_size` plans, so its length stops
    growing."""
    backend = getattr(runner.trainer, "longstraw_backend", None)
    before = set() if backend is None else {id(p) for p in backend.plans}
    made: list = []
    yield made
    if backend is not None:
        made.extend(p for p in backend.plans if id(p) not in before)


@contextlib.contextmanager
def phase_seconds() -> Iterator[dict[str, float]]:
    """Seconds per runtime phase (prompt capture, branches, replays, reverse
    pass: `longstraw.runtime.runner.phase_of`) of the steps run inside, device-synchronised."""
    seconds: dict[str, float] = {}

    def timed(where: str) -> contextlib.AbstractContextManager:
        phase = phase_of(where)
        return synced(lambda s: seconds.__setitem__(phase, seconds.get(phase, 0.0) + s))

    with longstraw.around_steps(timed):
        yield seconds


@contextlib.contextmanager
def steps_named() -> Iterator[dict[str, int]]:
    """How many steps of each kind the runtime ran inside ("running 8-row branch
    steps": 2, "differentiating the kept 8-row branch steps": 1...), which shows
    the rows per step and what the plan kept."""
    counts: dict[str, int] = {}

    def rows(match: re.Match) -> str:
        return f"{len(match.group(1).split(','))}-row branch steps"

    def count(where: str) -> contextlib.AbstractContextManager:
        name = re.sub(r"branch(?:es)? ([\d, ]+) of \d+", rows, where.split(" over ")[0].split(";")[0])
        name = re.sub(r" \[\d+, \d+\)", "", name)
        counts[name] = counts.get(name, 0) + 1
        return contextlib.nullcontext()

    with longstraw.around_steps(count):
        yield counts


def measure(runner: Runner, group: Group, repeats: int = 1, warmup: bool = False) -> dict:
    """One (or `repeats`) steps: peak allocated memory and seconds per step.
    The first call at a new shape plans (and compiles); with `warmup` it is
    run once untimed."""
    model = runner.model
    try:
        if warmup:
            runner.step(group)
            release(model)
        times = []
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            runner.step(group)
            sync()
            times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
        return {"ok": True, "seconds": min(times), "peak_gb": peak / GiB, "includes_planning": not warmup}
    except Exception as error:  # noqa: BLE001 - every failure is recorded, the sweep goes on
        if not is_oom(error):
            return {"ok": False, "error": f"{type(error).__name__}: {str(error)[:400]}"}
        return {"ok": False, "oom": True}
    finally:
        release(model)


# FLOPs --------------------------------------------------------------------------


# What the last layer must compute at a prompt position whose own output no
# logit reads: the state later tokens need (K/V, or the recurrent state's inputs).


class Clock:
    def __init__(self, budget_s: float) -> None:
        self.end = time.perf_counter() + budget_s

    def left(self) -> float:
        return self.end - time.perf_counter()


# Seconds a mode's first sweep step needs before it is started: flex attention
# compiles its kernels and block mask per prompt length (about 150 s on the H200).


def describe(result: dict) -> str:
    if result.get("ok"):
        mfu = f" MFU {result['mfu']:.1%}" if "mfu" in result else ""
        return f"{result['seconds']:.2f}s {result['peak_gb']:.1f}GB{mfu}"
    return "OOM" if result.get("oom") else result.get("error", "failed")


@contextlib.contextmanager
def phase_peaks() -> Iterator[dict[str, float]]:
    """Peak allocated memory (GB) per runtime phase of the steps run inside
    (`longstraw.runtime.runner.phase_of`), "outside the steps" for the rest: the
    allocator's peak is read and reset as each step starts and ends (its
    counts are kept on the host: no synchronisation needed)."""
    peaks: dict[str, float] = {}

    def note(phase: str) -> None:
        peaks[phase] = max(peaks.get(phase, 0.0), torch.cuda.max_memory_allocated() / GiB)
        torch.cuda.reset_peak_memory_stats()

    @contextlib.contextmanager
    def measured(where: str) -> Iterator[None]:
        note("outside the steps")
        try:
            yield
        finally:
            note(phase_of(where))

    torch.cuda.reset_peak_memory_stats()
    with longstraw.around_steps(measured):
        yield peaks
    note("outside the steps")


PROJECT_FRAMES = ("longstraw", "passes", "transformers", "benchmarks")
KERNEL_FRAMES = ("/fla/",)  # kernel libraries whose own buffers are named by their line and the project's caller


def _frame(f: dict) -> str:
    return f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}"


def _where(frames: list[dict]) -> str:
    """The innermost frame of this project, after that of a kernel library called from it."""
    ours = [f for f in frames if any(k in f["filename"] for k in PROJECT_FRAMES)]
    kernel = [f for f in frames if any(k in f["filename"] for k in KERNEL_FRAMES)]
    where = _frame(ours[0]) if ours else "(no python frame)"
    return f"{_frame(kernel[0])} <- {where}" if kernel else where


def live_at_peak(fn: Callable[[], object], top: int = 16) -> tuple[object, dict]:
    """`fn()` under the allocator's trace, and what was live at its peak
    (`replayed`). If `fn` raises (out of memory), the error carries what
    was live at the peak before it as `live_at_peak`."""
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=4_000_000, stacks="python")

    def live() -> dict:
        snapshot = torch.cuda.memory._snapshot()
        return replayed([e for trace in snapshot["device_traces"] for e in trace], before, top)

    try:
        result = fn()
    except BaseException as error:
        error.live_at_peak = live()
        raise
    else:
        return result, live()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def replayed(events: list[dict], before: int, top: int = 16) -> dict:
    """An allocator trace replayed to its maximum from `before` allocated
    bytes: the peak, and the blocks alive then grouped by their innermost
    frame in this project or transformers (blocks allocated before the
    trace count as "before the call", less those freed by the peak); a
    block from a kernel library (fla) names its line too."""
    events = [e for e in events if e["action"] in ("alloc", "free_requested")]
    current = peak = before
    peak_at = -1
    for i, e in enumerate(events):
        current += e["size"] if e["action"] == "alloc" else -e["size"]
        if current > peak:
            peak, peak_at = current, i
    live: dict[int, dict] = {}
    freed_before = 0
    for e in events[: peak_at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif live.pop(e["addr"], None) is None:
            freed_before += e["size"]
    groups: dict[str, int] = {"before the call": before - freed_before}
    largest: dict[str, dict] = {}
    for e in live.values():
        where = _where(e.get("frames", []))
        groups[where] = groups.get(where, 0) + e["size"]
        if e["size"] > largest.get(where, {"size": -1})["size"]:
            largest[where] = e
    ranked = sorted(groups.items(), key=lambda kv: -kv[1])[:top]
    return {"peak_gb": peak / GiB, "events": len(events),
            "top": [{"where": w, "gb": b / GiB, **_stack(largest.get(w))} for w, b in ranked]}


def _stack(block: dict | None, depth: int = 10) -> dict:
    """The project's and kernel libraries' frames (innermost first) that allocated `block`."""
    frames = [f for f in (block or {}).get("frames", []) if any(k in f["filename"] for k in PROJECT_FRAMES + KERNEL_FRAMES)]
    return {"stack": [_frame(f) for f in frames[:depth]]} if frames else {}


def peak_breakdown(model, kind, mode, args, top: int = 14) -> dict:
    """What is live at the peak of one step (`live_at_peak`)."""
    group = make_group(args.G, args.p_trace, args.R, model.config.vocab_size, model.device)
    with Runner(model, kind, mode) as runner:
        runner.step(group)  # plan outside the trace
        release(model)
        try:
            _, live = live_at_peak(lambda: runner.step(group), top)
        finally:
            release(model)
    out = {"mode": mode, "P": args.p_trace, **live}
    print(f"  {kind} {mode} P={args.p_trace} live at peak ({live['peak_gb']:.1f} GB):", flush=True)
    for row in live["top"]:
        print(f"    {row['gb']:7.2f} GB  {row['where']}", flush=True)
    return out


def profile_step(model, kind, mode, args, top: int = 12) -> dict:
    """Where a warm step's time goes: the top operators by device and by host
    time, and which attention kernel the steps chose."""
    chosen: dict[str, int] = {}

    class Counting(logging.Handler):
        """Counts the attention kernels the steps choose (logged at DEBUG)."""

        def emit(self, record: logging.LogRecord) -> None:
            key = record.getMessage()
            chosen[key] = chosen.get(key, 0) + 1

    group = make_group(args.G, args.p_speed, args.R, model.config.vocab_size, model.device)
    log, handler = logging.getLogger("longstraw.attention"), Counting()
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        with Runner(model, kind, mode) as runner:
            runner.step(group)
            release(model)
            chosen.clear()
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=activities) as prof:
                runner.step(group)
                sync()
            release(model)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    events = prof.key_averages()
    by_device = sorted(events, key=lambda e: -e.self_device_time_total)[:top]
    by_host = sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]
    out = {
        "mode": mode, "P": args.p_speed, "kernels": chosen,
        "device_ms": [{"op": e.key, "ms": e.self_device_time_total / 1e3, "calls": e.count} for e in by_device],
        "host_ms": [{"op": e.key, "ms": e.self_cpu_time_total / 1e3, "calls": e.count} for e in by_host],
    }
    print(f"  {kind} {mode} P={args.p_speed} profile: kernels {chosen}", flush=True)
    for e in by_device:
        print(f"    device {e.self_device_time_total / 1e3:9.1f} ms {e.count:6d}x {e.key[:90]}", flush=True)
    for e in by_host:
        print(f"    host   {e.self_cpu_time_total / 1e3:9.1f} ms {e.count:6d}x {e.key[:90]}", flush=True)
    return out


def memory_floor(model, kind, args, sweep_out: dict) -> dict:
    """weights + grads + state(P) (+ d(state) in exact mode) + one branch + one chunk,
    per longstraw run (`floor_gb`). The state comes from the plan of a small
    run; one branch and one chunk are the activations of eager fwd+bwd over R
    and over one chunk of a single sequence (detached: the chunk without
    grad), measured with every .grad already held, as LongStraw holds the
    sum while it replays the branches and chunks after the first. The
    hybrid's Gated DeltaNet runs LongStraw's operators there, as in the
    step (HF's PyTorch kernel keeps several times their activations)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    vocab = model.config.vocab_size
    backend = longstraw.Backend(prompt_grad="exact", prefix_chunk_size=8192, recompute_layers=False)
    group = make_group(2, 4096, 64, vocab, model.device)
    with Runner(model, kind, "longstraw_exact") as runner:
        runner.compiled = torch.compile(grpo_loss, backend=backend)
        runner.step(group)
    plan = backend.plans[-1]
    release(model)
    chunk = plan.options.prefix_chunk_size  # as planned: the option itself may be None
    activations = {}
    with Runner(model, kind, "eager", longstraw_operators=True) as runner:
        for name, P, R, grad in (("branch", 1, args.R, True), ("chunk_grad", chunk, 1, True), ("chunk_nograd", chunk, 1, False)):
            g = make_group(1, P, R, vocab, model.device)
            release(model)
            if grad:
                runner.step(g)  # allocates every .grad
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            with torch.set_grad_enabled(grad):
                if grad:
                    eager_step(model, g).backward()  # accumulates into the held .grad
                else:
                    model(input_ids=g.input_ids, logits_to_keep=1)
            activations[name] = torch.cuda.max_memory_allocated() - base
            release(model)
    out = {"weights_gb": weights / GiB, "grads_gb": weights / GiB, "grads_held": True, "longstraw_operators": True,
           "state_bytes_per_position": plan.state_bytes_per_position, "state_fixed_bytes": plan.state_fixed_bytes,
           "activations_gb": {k: v / GiB for k, v in activations.items()}, "prefix_chunk_size": chunk, "runs": []}
    for mode in ("longstraw_detached", "longstraw_exact"):
        for run in sweep_out.get(mode, {}).get("runs", []):
            if run["ok"]:
                out["runs"].append({"mode": mode, "P": run["P"], "peak_gb": run["peak_gb"]})
    return score_floor(out, args.R)


def score_floor(floor: dict, R: int) -> dict:
    """`floor_gb` and `over_floor` of every run from the measured terms: the
    issue's sum. `phase_floor_gb` takes the larger of the branch and the
    chunk instead, as the step never holds both: the prompt chunks run
    before the branches, the reverse pass after them.
    Files without `grads_held` measured the branch and chunk from empty
    .grad, so their peaks include the gradients the backward allocated;
    those come off, which leaves a lower bound on the activations (the
    eager step's peak can fall where its activations and its gradients are
    not both live): their floors are lower bounds."""
    acts = floor["activations_gb"]
    grads = 0.0 if floor.get("grads_held") else floor["grads_gb"]
    for run in floor["runs"]:
        P, exact = run["P"], run["mode"] == "longstraw_exact"
        chunks = math.ceil((P - 1) / floor["prefix_chunk_size"])
        state = (floor["state_bytes_per_position"] * (P - 1 + R) + floor["state_fixed_bytes"] * (chunks + 1)) / GiB
        chunk = acts["chunk_grad"] - grads if exact else acts["chunk_nograd"]
        held = floor["weights_gb"] + floor["grads_gb"] + state * (2 if exact else 1)
        run["floor_gb"] = held + acts["branch"] - grads + chunk
        run["over_floor"] = run["peak_gb"] / run["floor_gb"] - 1
        run["phase_floor_gb"] = held + max(acts["branch"] - grads, chunk)
        run["over_phase_floor"] = run["peak_gb"] / run["phase_floor_gb"] - 1
    return floor
