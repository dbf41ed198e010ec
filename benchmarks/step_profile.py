"""Where one warm GRPO step's time goes, per mode: device busy time against
wall time, LongStraw's phases, the heaviest operators, and the host's
Python profile of LongStraw's step.

Same micro-batch and modes as peers_bench (TRL's `compute_loss`, 2 prompts
x G completions, R = 1024). Per model and P and mode: the first call,
split into Dynamo's compiles, LongStraw's planning and the run, the median of three warm steps, then
one warm step under `torch.profiler` (sum of kernel time: when it is far
under the wall time, the step waits on the host), the seconds until a warm
step returns to the host, with `--sync-sites` where it waits on the device,
and, for LongStraw, one
under `phase_seconds` (device-synchronised per runtime phase) and one under
cProfile. With `--new-length`, also LongStraw's first call at a prompt
length not seen before (what each step of a real loop pays), under
`phase_seconds` and cProfile.

    python benchmarks/step_profile.py --model dense,hybrid --P 16384 --out-dir $OUT --name step_profile_h200
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import os
import pstats
import statistics
import time
import traceback
import warnings
from pathlib import Path

import torch

from grpo.loop import isolated_run
from grpo.measure import Clock, dynamo_compiles, phase_seconds, plans_made, recorded_failure, release, steps_named, sync, timed_step
from grpo.models import build_model
from grpo.results import provenance
from peers.batch import trl_micro_batch
from peers.modes import PEERS, PeerRunner
from peers.plot_axes import against_prompt_length


def device_profile(runner: PeerRunner, batch: dict[str, torch.Tensor], top: int, shapes: bool = False) -> tuple[dict, str]:
    """Kernel time, launches and the heaviest operators of one step (`shapes`:
    also the heaviest operators by their input shapes)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sync()
    start = time.perf_counter()
    with torch.profiler.profile(activities=activities, record_shapes=shapes) as prof:
        runner.step(batch)
        sync()
    wall = time.perf_counter() - start
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in kernels) / 1e6
    # the host waiting on the device (the step's own syncs and the one after it)
    syncs = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU and "Synchronize" in e.name)
    averages = prof.key_averages()
    text = averages.table(sort_by="self_cuda_time_total" if kernels else "self_cpu_time_total", row_limit=top)
    by_cpu = averages.table(sort_by="self_cpu_time_total", row_limit=top)
    if shapes:
        by_shape = prof.key_averages(group_by_input_shape=True).table(
            sort_by="self_cuda_time_total" if kernels else "self_cpu_time_total", row_limit=2 * top)
        by_cpu += "\n" + by_shape
    return {"profiled_wall_s": wall, "kernel_s": busy, "kernel_launches": len(kernels), "host_syncs": syncs}, \
        text + "\n" + by_cpu


def host_seconds(runner: PeerRunner, batch: dict[str, torch.Tensor]) -> float:
    """Seconds until one step returns to the host, the device synchronised
    before but not after: near the wall time when the host (its launches or
    its waits on the device) paces the step, far under it when the device does."""
    sync()
    start = time.perf_counter()
    runner.step(batch)
    seconds = time.perf_counter() - start
    sync()
    return seconds


_OWN_FRAMES = ("longstraw", "trl", "transformers")
"""The frames `sync_sites` names a synchronising call by."""


def sync_sites(runner: PeerRunner, batch: dict[str, torch.Tensor], top: int) -> dict[str, int]:
    """Where one step makes the host wait on the device: each synchronising
    call (`torch.cuda.set_sync_debug_mode`), counted by its innermost frames
    in LongStraw, TRL and transformers, most frequent first."""
    if not torch.cuda.is_available():
        return {}
    sites: collections.Counter[str] = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        frames = [f for f in traceback.extract_stack()[:-1] if any(k in f.filename for k in _OWN_FRAMES)]
        sites[" <- ".join(f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in reversed(frames[-3:]))] += 1

    sync()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            runner.step(batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sync()
    return dict(sites.most_common(top))



def host_profile(runner: PeerRunner, batch: dict[str, torch.Tensor], top: int,
                 phases: dict[str, float] | None = None) -> str:
    """cProfile of one step; `phases` (when given) filled by `phase_seconds`."""
    profiler = cProfile.Profile()
    sync()
    profiler.enable()
    if phases is None:
        runner.step(batch)
    else:
        with phase_seconds() as seen:
            runner.step(batch)
        phases.update(seen)
    sync()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def split_call(runner: PeerRunner, batch: dict[str, torch.Tensor]) -> dict:
    """One call's seconds, split into Dynamo's compiles (tracing the loss:
    `entire_frame_compile_time_s` of the compiles it made), LongStraw's
    planning (`GroupPlan.seconds` of the plans it made) and the rest (running
    the step)."""
    torch._dynamo.utils.clear_compilation_metrics()  # a bounded record: cleared, not counted from
    with plans_made(runner) as plans, dynamo_compiles() as compiles:
        seconds = timed_step(runner, batch)
    metrics = torch._dynamo.utils.get_compilation_metrics()
    planning = sum(p.seconds.total for p in plans if p.seconds is not None)
    return {"s": seconds, "dynamo_compiles": compiles["compiles"], "dynamo_s": compiles["seconds"],
            "dynamo_metrics_s": sum(m.entire_frame_compile_time_s or 0.0 for m in metrics), "plans": len(plans),
            "plan_s": planning, "run_s": seconds - compiles["seconds"] - planning}


def plan_of(runner: PeerRunner) -> dict:
    backend = getattr(runner.trainer, "longstraw_backend", None)
    if backend is None or not backend.plans:
        return {}
    plan = list(backend.plans)[-1]
    options = plan.options
    runner = plan.runner
    return {"prefix_chunk_size": options.prefix_chunk_size, "recompute_layers": options.recompute_layers,
            "keeps_graphs": runner.keeps_graphs, "graph_room_gb": runner.graph_room / 1e9,
            "graph_chunk_gb": runner.graph_chunk_bytes / 1e9, "state_room_gb": runner.state_room / 1e9,
            "branch_room_gb": runner.branch_room / 1e9,
            "kept_gb_measured": {k: v / 1e9 for k, v in runner.graph_bytes.measured.items()},
            "plan_s": None if plan.seconds is None else plan.seconds.total,
            # the last call's branch positions run, of the padded rows' (decision 0041; absent before it)
            "branch_positions": getattr(runner.last_call, "branch_positions", None),
            "uncut": getattr(plan.program, "uncut", None)}


def profile_mode(model, kind: str, mode: str, P: int, args, report: list[str]) -> dict:
    rows = args.prompts * args.G
    batch = trl_micro_batch(args.prompts, args.G, P, args.R, model.config.vocab_size, model.device)
    out: dict = {"model": kind, "mode": mode, "P": P, "options": args.options}
    with recorded_failure(out, model), PeerRunner(model, mode, rows, args.G, args.R, args.options) as runner:
        out["first"] = split_call(runner, batch)
        out["first_s"] = out["first"]["s"]
        release(model)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        out["warm_s"] = statistics.median(timed_step(runner, batch) for _ in range(3))
        out["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else 0.0
        release(model)
        summary, text = device_profile(runner, batch, args.top, args.shapes)
        out.update(summary)
        out["host_s"] = host_seconds(runner, batch)
        if args.sync_sites:
            out["sync_sites"] = sync_sites(runner, batch, args.top)
            report.append(f"===== {kind} {mode} P={P}: host syncs by site\n"
                          + "\n".join(f"{n:5d} {site}" for site, n in out["sync_sites"].items()))
        report.append(f"===== {kind} {mode} P={P}: operators (by device time, then host time)\n{text}")
        release(model)
        if mode.startswith("longstraw"):
            out["plan"] = plan_of(runner)
            with phase_seconds() as phases, steps_named() as steps:
                runner.step(batch)
            out["phases_s"] = phases
            out["steps"] = steps
            release(model)
            if args.host_profile:
                report.append(f"===== {kind} {mode} P={P}: host profile\n{host_profile(runner, batch, args.top)}")
                release(model)
            if args.new_length:
                out["new_length"] = new_length_profile(runner, model, kind, mode, P, args, report)
    return out


def new_length_profile(runner: PeerRunner, model, kind: str, mode: str, P: int, args, report: list[str]) -> dict:
    """The first call at new prompt lengths (shorter than P by a fifth and a
    third, so neither was planned), then that call again warm: where the
    difference goes, by phase and in the host's profile; then a call at
    lengths one shorter again, split into compiles, planning and the run
    (`split_call`)."""
    lengths = [P - P // 5, P - P // 3][: args.prompts]
    batch = trl_micro_batch(args.prompts, args.G, P, args.R, model.config.vocab_size, model.device, lengths)
    phases: dict[str, float] = {}
    sync()
    start = time.perf_counter()
    text = host_profile(runner, batch, args.top, phases)
    first = time.perf_counter() - start
    release(model)
    again = trl_micro_batch(args.prompts, args.G, P, args.R, model.config.vocab_size, model.device,
                            [n - 1 for n in lengths])
    split = split_call(runner, again)  # one more new length, outside the profilers
    release(model)
    with phase_seconds() as warm_phases:
        warm = timed_step(runner, batch)
    release(model)
    report.append(f"===== {kind} {mode} P={P}: first call at prompt lengths {lengths}\n{text}")
    return {"lengths": lengths, "first_s": first, "phases_s": phases, "warm_s": warm, "warm_phases_s": warm_phases,
            "next": split}


def _split(call: dict) -> str:
    return f"{call['dynamo_s']:.2f}, {call['plan_s']:.2f}, {call['run_s']:.2f}"


def table(runs: list[dict]) -> str:
    lines = ["| model | mode | P | first s (Dynamo, plan, run) | warm s | host s | kernel s | launches | syncs | peak GB | phases s | new length: first s, warm s, first's phases s; next (Dynamo, plan, run) |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in runs:
        if not r.get("ok"):
            lines.append(f"| {r['model']} | {r['mode']} | {r['P']:,} | {r.get('error', '')[:60]} | | | | | | | | |")
            continue
        phases = ", ".join(f"{k} {v:.2f}" for k, v in r.get("phases_s", {}).items())
        new = r.get("new_length")
        new = "" if new is None else (f"{new['first_s']:.2f}, {new['warm_s']:.2f}; "
                                      + ", ".join(f"{k} {v:.2f}" for k, v in new["phases_s"].items())
                                      + f"; {_split(new['next'])}")
        first = f"{r['first_s']:.2f}" + (f" ({_split(r['first'])})" if "first" in r else "")
        lines.append(f"| {r['model']} | {r['mode']} | {r['P']:,} | {first} | {r['warm_s']:.3f} | "
                     f"{r.get('host_s', float('nan')):.3f} | {r['kernel_s']:.3f} | {r['kernel_launches']} | {r.get('host_syncs', '')} | {r['peak_gb']:.1f} | "
                     f"{phases} | {new} |")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Warm step seconds and peak GB against P, one line per model and mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (seconds, memory) = plt.subplots(1, 2, figsize=(14, 5))
    lines = sorted({(r["model"], r["mode"]) for r in result["runs"]})
    for i, (kind, mode) in enumerate(lines):
        ok = sorted((r for r in result["runs"] if r.get("ok") and (r["model"], r["mode"]) == (kind, mode)),
                    key=lambda r: r["P"])
        if ok:
            label = f"{kind}: {mode}" if len({k for k, _ in lines}) > 1 else mode
            seconds.plot([r["P"] for r in ok], [r["warm_s"] for r in ok], marker="o", label=label, color=f"C{i}")
            memory.plot([r["P"] for r in ok], [r["peak_gb"] for r in ok], marker="o", label=label, color=f"C{i}")
        for r in result["runs"]:
            if (r["model"], r["mode"]) == (kind, mode) and r.get("oom"):
                seconds.axvline(r["P"], color=f"C{i}", linestyle=":", alpha=0.6)
    against_prompt_length(((seconds, "warm step seconds"), (memory, "peak allocated GB")))
    fig.suptitle(f"one TRL GRPO micro-batch: {result['n_prompts']} prompts x G={result['G']}, R={result['R']}, "
                 f"{result['dtype'].removeprefix('torch.')}, {result.get('device') or 'unknown device'} "
                 "(dotted: out of memory)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="dense", help="comma-separated: dense, hybrid")
    parser.add_argument("--modes", default=",".join(PEERS))
    parser.add_argument("--P", default="16384", help="comma-separated longest prompts")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--G", type=int, default=8)
    parser.add_argument("--R", type=int, default=1024)
    parser.add_argument("--options", type=json.loads, default={}, help="LongStraw options (JSON) besides prompt_grad")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--no-host-profile", dest="host_profile", action="store_false",
                        help="skip the cProfile of LongStraw's step")
    parser.add_argument("--sync-sites", action="store_true",
                        help="also count where one step makes the host wait on the device, by source line")
    parser.add_argument("--shapes", action="store_true", help="also list the heaviest operators by input shape")
    parser.add_argument("--new-length", action="store_true",
                        help="also profile LongStraw's first call at new prompt lengths")
    parser.add_argument("--budget-s", type=float, default=300)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke run of the script)")
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--name", default="step_profile")
    parser.add_argument("--in-process", action="store_true",
                        help="run every model, P and mode in this process (by default each runs in its own, so "
                             "what a run that ran out of memory leaves on the device does not shrink the next "
                             "run's plan)")
    parser.add_argument("--plot", metavar="JSON", help="only draw FILE.png from a result FILE.json of this script")
    args = parser.parse_args()
    if args.plot:
        with open(args.plot) as f:
            plot(json.load(f), args.plot.removesuffix(".json") + ".png")
        return
    clock = Clock(args.budget_s)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    argv = [f"benchmarks/{Path(os.sys.argv[0]).name}",
            *["benchmarks/results" if a == args.out_dir else a for a in os.sys.argv[1:]]]
    result = {"n_prompts": args.prompts, "G": args.G, "R": args.R, "dtype": str(dtype),
              **provenance("python " + " ".join(argv)), "runs": []}
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, args.name)
    report: list[str] = []
    result["isolated"] = not args.in_process
    for kind in args.model.split(","):
        model = build_model(kind, args.tiny, dtype, device) if args.in_process else None
        if model is not None:
            model.config.use_cache = False
        for P in (int(p) for p in args.P.split(",")):
            for mode in args.modes.split(","):
                if clock.left() < 20:
                    result["runs"].append({"model": kind, "mode": mode, "P": P, "ok": False, "error": "time budget"})
                    continue
                if model is not None:
                    run = profile_mode(model, kind, mode, P, args, report)
                else:
                    run, text = isolated_run(__file__, P, mode, clock, model=kind)
                    run.setdefault("model", kind)
                    report.append(text)
                result["runs"].append(run)
                print(table([run]).splitlines()[-1], flush=True)
                with open(stem + ".json", "w") as f:
                    json.dump(result, f, indent=2)
        del model
        release()
    with open(stem + ".txt", "w") as f:
        f.write("\n\n".join(report))
    try:
        plot(result, stem + ".png")
    except ImportError:
        print("no plot: matplotlib is not installed", flush=True)
    print(table(result["runs"]))


if __name__ == "__main__":
    main()
