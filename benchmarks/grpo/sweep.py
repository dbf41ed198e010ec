"""The prompt-length sweep (largest P per mode), the G=2 vs G=8 peak, warm speed and capture MFU."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from torch.nn.attention import SDPBackend, sdpa_kernel

from .flops import PEAK_FLOPS, FlopModel
from .measure import Clock, describe, measure, release, sync
from .models import make_group
from .modes import Runner

FIRST_STEP_S = {("dense", "eager_shared_prefix"): 180.0}


MODE_RESERVE_S = 60.0  # kept back for each later mode of the sweep


def next_step_seconds(runs: list[dict]) -> float:
    """The step time at the next doubling of P, from the last two successes:
    their ratio (attention makes it up to 4x), with a 20% margin."""
    ok = [r for r in runs if r["ok"]]
    if not ok:
        return 0.0
    last = ok[-1]["seconds"]
    if len(ok) < 2 or ok[-2]["P"] * 2 != ok[-1]["P"]:
        return 4 * last
    return last * min(4.0, max(2.0, 1.2 * last / ok[-2]["seconds"]))


BISECT_ALIGN = 1024  # the bisection tries multiples of this (of the resolution when that is smaller)


def bisect_largest(lo: int, hi: int, attempt: Callable[[int], dict], resolution: int, has_time: Callable[[], bool]) -> tuple[int, int]:
    """Narrow `lo` (runs) and `hi` (out of memory) to `resolution`, or lo/16
    when that is larger; stops early when the aligned midpoint is no new
    length, a run fails otherwise, or time runs out."""
    align = min(BISECT_ALIGN, resolution)
    while hi - lo > max(resolution, lo // 16) and has_time():
        mid = (lo + hi) // 2 // align * align
        if not lo < mid < hi:
            break
        result = attempt(mid)
        if result["ok"]:
            lo = mid
        elif result.get("oom"):
            hi = mid
        else:
            break
    return lo, hi


def sweep(model, kind, modes, args, clock: Clock, flops: FlopModel | None, out: dict, save: Callable[[], None],
          runner_of: Callable[[str], Any] | None = None, inputs_of: Callable[[int], Any] | None = None) -> dict:
    """Peak memory vs P and the largest P per mode: doubling, then bisection.
    Modes run in the order given; each may use the time left but
    MODE_RESERVE_S for every later mode. `out` is filled and saved after every run.
    `runner_of(mode)` (a context manager yielding an object with `.model`
    and `.step(inputs)`) and `inputs_of(P)` default to this benchmark's
    Runner and one group of G responses; with `flops` None no MFU is recorded."""
    vocab = model.config.vocab_size
    runner_of = runner_of or (lambda mode: Runner(model, kind, mode))
    inputs_of = inputs_of or (lambda P: make_group(args.G, P, args.R, vocab, model.device))
    for i, mode in enumerate(modes):
        mode_clock = Clock(clock.left() - MODE_RESERVE_S * (len(modes) - i - 1))
        runs, last_ok, first_bad = [], None, None
        out[mode] = entry = {"runs": runs, "max_prompt_tokens": None, "first_failure": None, "limited_by": "time"}
        stop = "p_max"
        with runner_of(mode) as runner:

            def attempt(P, runner=runner, mode=mode, runs=runs):
                result = measure(runner, inputs_of(P))
                result.update(P=P, G=args.G, R=args.R)
                if result["ok"] and flops is not None:
                    result["mfu"] = flops.step(mode, args.G, P, args.R) / result["seconds"] / PEAK_FLOPS
                runs.append(result)
                save()
                print(f"  {kind} {mode:20} P={P:>8} {describe(result)}", flush=True)
                return result

            P = args.start.get(mode, args.p_min)
            if mode_clock.left() < FIRST_STEP_S.get((kind, mode), 30.0):
                print(f"  {kind} {mode:20} not run: {mode_clock.left():.0f}s left", flush=True)
                continue
            while P <= args.p_max:
                if next_step_seconds(runs) > mode_clock.left():
                    stop = "time"
                    break
                result = attempt(P)
                if not result["ok"]:
                    first_bad, stop = P, "oom" if result.get("oom") else "error"
                    break
                last_ok = P
                P *= 2
            if last_ok is not None and first_bad is not None and stop == "oom":
                has_time = lambda runs=runs, clock=mode_clock: next_step_seconds(runs) < clock.left()  # noqa: E731
                last_ok, first_bad = bisect_largest(last_ok, first_bad, attempt, args.bisect_resolution, has_time)
        entry.update(max_prompt_tokens=last_ok, first_failure=first_bad, limited_by=stop)
        save()
    return out


def gdelta(model, kind, args, clock: Clock, sweep_out: dict) -> dict:
    """The G=8 peak is the sweep's run at the same P when there is one."""
    out = {}
    vocab = model.config.vocab_size
    for mode in ("longstraw_detached", "longstraw_exact"):
        with Runner(model, kind, mode) as runner:
            peaks = {}
            for run in sweep_out.get(mode, {}).get("runs", []):
                if run["P"] == args.p_gdelta and run["G"] == 8 and run["ok"]:
                    peaks[8] = run
            for G in [G for G in (2, 8) if G not in peaks]:
                if clock.left() < 30:
                    break
                result = measure(runner, make_group(G, args.p_gdelta, args.R, vocab, model.device))
                print(f"  {kind} {mode:20} P={args.p_gdelta:>8} G={G} {describe(result)}", flush=True)
                peaks[G] = result
        if all(peaks.get(G, {}).get("ok") for G in (2, 8)):
            out[mode] = {"P": args.p_gdelta, "peak_g2_gb": peaks[2]["peak_gb"], "peak_g8_gb": peaks[8]["peak_gb"],
                         "delta_gb": peaks[8]["peak_gb"] - peaks[2]["peak_gb"]}
        else:
            out[mode] = {"P": args.p_gdelta, "runs": peaks}
    return out


def speed(model, kind, modes, args, clock: Clock, flops: FlopModel | None) -> dict:
    """Every mode's warm step at `args.p_speed`; with `flops` None no MFU is recorded."""
    out = {}
    vocab = model.config.vocab_size
    group = make_group(args.G, args.p_speed, args.R, vocab, model.device)
    for mode in modes:
        if clock.left() < 30:
            out[mode] = {"skipped": "time budget"}
            continue
        with Runner(model, kind, mode) as runner:
            result = measure(runner, group, repeats=2, warmup=True)
        result["P"] = args.p_speed
        if result["ok"] and flops is not None:
            result["mfu"] = flops.step(mode, args.G, args.p_speed, args.R) / result["seconds"] / PEAK_FLOPS
        print(f"  {kind} {mode:20} P={args.p_speed:>8} warm {describe(result)}", flush=True)
        out[mode] = result
    return out


def capture_mfu(model, kind, args, clock: Clock, flops: FlopModel) -> dict:
    """The compiled loss's forward at --p-capture (prompt capture plus the G
    branch forwards, both counted), once per attention kernel: the default
    (flash) and cuDNN, chosen as users choose it, through PyTorch's SDPA switch."""
    vocab = model.config.vocab_size
    group = make_group(args.G, args.p_capture, args.R, vocab, model.device)
    work = flops.compiled_forward(args.G, args.p_capture, args.R)
    out = {"P": args.p_capture, "forward_flops": work, "kernels": {}}
    for kernel, backends in (("flash", None), ("cudnn", [SDPBackend.CUDNN_ATTENTION])):
        if clock.left() < 60:
            break
        with Runner(model, kind, "longstraw_detached") as runner:

            def forward(runner=runner):  # no backward
                runner.compiled(model, group.input_ids, group.advantages, group.mask, args.R)

            try:
                forward()  # plan
                release(model)
                # the switch is read when the steps run (tracing under it would plan SDPA for cuDNN alone)
                with sdpa_kernel(backends) if backends else contextlib.nullcontext():
                    forward()  # untimed: cuDNN builds an execution plan per new shape on first use
                    release(model)
                    sync()
                    t0 = time.perf_counter()
                    forward()
                    sync()
                    seconds = time.perf_counter() - t0
                out["kernels"][kernel] = {"forward_seconds": seconds, "mfu": work / seconds / PEAK_FLOPS}
            except Exception as error:  # noqa: BLE001
                out["kernels"][kernel] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
            finally:
                release(model)
        print(f"  {kind} capture P={args.p_capture} {kernel}: {out['kernels'][kernel]}", flush=True)
    done = {k: v for k, v in out["kernels"].items() if "mfu" in v}
    if done:
        best = max(done, key=lambda k: done[k]["mfu"])
        out.update(kernel=best, **done[best])
    return out
