"""Result files: tables, the plot, summary.json, merging runs of several commands."""

from __future__ import annotations

import datetime
import json
import os
import subprocess

import torch

from .flops import PEAK_FLOPS, FlopModel
from .measure import describe, score_floor
from .models import build_model
from .modes import MODES


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m in results if "sweep" in results[m]]
    if not models:
        return
    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 5), squeeze=False)
    for ax, kind in zip(axes[0], models):
        for mode, data in sorted(results[kind]["sweep"].items(), key=lambda item: MODES.index(item[0])):
            ok = [r for r in data["runs"] if r["ok"]]
            for warm in speed_runs(results[kind]):
                if warm["mode"] == mode and warm.get("ok") and all(r["P"] != warm["P"] for r in ok):
                    ok.append(warm)
            if ok:
                ok.sort(key=lambda r: r["P"])
                color = f"C{MODES.index(mode)}"  # one colour per mode in every panel
                ax.plot([r["P"] for r in ok], [r["peak_gb"] for r in ok], marker="o", label=mode, color=color)
        ax.axhline(141, color="gray", linestyle=":", label="H200 (141 GB)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens P")
        ax.set_ylabel("peak allocated GB")
        ax.set_title(f"{kind}: one GRPO step, G={results[kind]['G']}, R={results[kind]['R']}, bf16")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summarize(result: dict) -> dict:
    sweep_out = result.get("sweep", {})
    summary = {
        "max_prompt_tokens": {m: d["max_prompt_tokens"] for m, d in sweep_out.items()},
        "max_prompt_limited_by": {m: d["limited_by"] for m, d in sweep_out.items()},
        "command": [s["command"] for s in result["sources"]],
        "commit": [s["commit"] for s in result["sources"]],
        "sources": result["sources"],
    }
    gd = result.get("gdelta", {})
    summary["peak_delta_g2_to_g8_gb"] = {m: d.get("delta_gb") for m, d in gd.items()}
    timed = speed_runs(result)
    warm = {(r["mode"], r["P"]): r for r in timed if r.get("ok")}
    speedups = {P: warm[("eager_ckpt", P)]["seconds"] / warm[("longstraw_exact", P)]["seconds"]
                for mode, P in warm if mode == "longstraw_exact" and ("eager_ckpt", P) in warm}
    if timed:
        summary["speedup_vs_eager_ckpt_at_32k"] = speedups.get(32768)
        summary["speedup_vs_eager_ckpt_by_p"] = dict(sorted(speedups.items()))
    if "capture" in result:
        summary["prefix_capture_mfu"] = result["capture"].get("mfu")
        summary["prefix_capture_at_p"] = result["capture"].get("P")
        summary["prefix_capture_kernel"] = result["capture"].get("kernel", "flash")
        summary["prefix_capture_mfu_by_kernel"] = {k: v.get("mfu") for k, v in result["capture"].get("kernels", {}).items()}
    for key, by_mode in floor_ranges(result).items():
        summary[f"peak_{key}"] = by_mode
    par = result.get("parity", {})
    if par:
        summary["parity_fp32_max_rel_l2"] = par.get("float32", {}).get("max_rel_l2")
        summary["parity_bf16_min_cosine"] = par.get("bfloat16", {}).get("min_cosine")
        if "longstraw_vs_float64" in par.get("float32", {}):
            summary["parity_fp32_max_rel_l2_vs_float64"] = {
                "longstraw": par["float32"]["longstraw_vs_float64"], "eager": par["float32"]["eager_vs_float64"]}
    return summary


def floor_ranges(result: dict) -> dict[str, dict[str, dict[str, float]]]:
    """Per score (`over_floor`, `over_phase_floor`) and mode, its min and max over the floor runs."""
    runs = result.get("memory_floor", {}).get("runs", [])
    return {
        key: {mode: {"max": max(r[key] for r in runs if r["mode"] == mode), "min": min(r[key] for r in runs if r["mode"] == mode)}
              for mode in sorted({r["mode"] for r in runs})}
        for key in ("over_floor", "over_phase_floor") if runs
    }


def print_table(kind: str, result: dict) -> None:
    print(f"\n== {kind} (G={result['G']}, R={result['R']})")
    if "sweep" in result:
        print(f"{'mode':22} {'max P':>9} {'limit':>6}   peak GB by P")
        for mode, data in result["sweep"].items():
            by_p = {r["P"]: r["peak_gb"] for r in data["runs"] if r["ok"]}  # a length may have run more than once
            peaks = " ".join(f"{P // 1024}K:{peak:.0f}" for P, peak in by_p.items())
            print(f"{mode:22} {data['max_prompt_tokens'] or 0:>9} {data['limited_by']:>6}   {peaks}")
    if speed_runs(result):
        print(f"{'mode':22} {'P':>9} {'s/step':>8} {'MFU':>6}")
        for r in sorted(speed_runs(result), key=lambda r: r["P"]):
            if r.get("ok"):
                mfu = f"{r['mfu']:>6.1%}" if "mfu" in r else f"{'-':>6}"  # no FLOP model of this slice
                print(f"{r['mode']:22} {r['P']:>9} {r['seconds']:>8.2f} {mfu}")
            else:
                print(f"{r['mode']:22} {r['P']:>9} {describe(r):>8}")
    ranges = floor_ranges(result)
    for mode in ranges.get("over_floor", {}):
        over, phase = ranges["over_floor"][mode], ranges["over_phase_floor"][mode]
        print(f"{mode:22} peak over floor {over['min']:+.1%}..{over['max']:+.1%}, "
              f"over phase floor {phase['min']:+.1%}..{phase['max']:+.1%}")
    for key in ("gdelta", "capture", "parity"):
        if key in result:
            print(f"{key}: {json.dumps(result[key])}")


def provenance(command: str) -> dict[str, str]:
    """The keys every result file starts with (`benchmarks/results_index.py`
    indexes them): the command, the commit, the device, torch, the date."""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"command": command, "commit": git_commit(), "device": device, "torch": torch.__version__,
            "date": datetime.date.today().isoformat()}


def git_commit() -> str:
    """LONGSTRAW_COMMIT when set (a copied working tree may carry a stale .git), else git's HEAD."""
    if os.environ.get("LONGSTRAW_COMMIT"):
        return os.environ["LONGSTRAW_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


MODE_KEYED_PARTS = ("sweep", "speed")


def speed_runs(result: dict) -> list[dict]:
    """Warm step times as a list of entries with `mode` and `P` (a merged
    result keeps them so; a file keys them by mode, and files before the
    entries carried P hold the file's `--p-speed`)."""
    if "speed_runs" in result:
        return result["speed_runs"]
    return [{**r, "mode": mode, "P": r.get("P", result["p_speed"])} for mode, r in result.get("speed", {}).items()]


def merge(results: list[dict]) -> dict:
    """Results of one model from several commands (the device's 10-minute
    limit): per mode and P, the sweep, speed and memory-floor runs of the
    last file that has them (so a command can extend another's sweep);
    every other part from the last file that has it. `sources` says which
    command measured what."""
    merged: dict = {"sources": []}
    warm: dict[tuple[str, int], dict] = {}
    for result in results:
        parts = [k for k in result if k in (*MODE_KEYED_PARTS, "gdelta", "capture", "parity", "kernels", "memory_floor", "trace", "profile")]
        merged["sources"].append({"command": result["command"], "commit": result.get("commit", result.get("git_commit")),
                                  "parts": parts,
                                  "modes": sorted({m for k in MODE_KEYED_PARTS for m in result.get(k, {})})})
        warm.update({(r["mode"], r["P"]): r for r in speed_runs(result)})
        for key, value in result.items():
            if key == "sweep":
                sweeps = merged.setdefault(key, {})
                for mode, entry in value.items():
                    sweeps[mode] = _merge_sweep(sweeps.get(mode), entry)
            elif key == "memory_floor":
                merged[key] = _merge_floor(merged.get(key), value)
            elif key not in ("sources", "speed"):
                merged[key] = value
    merged["speed_runs"] = list(warm.values())
    return merged


def _merge_sweep(old: dict | None, new: dict) -> dict:
    """Runs by P, the later file's where both ran one; the largest P run,
    and what stopped it, from the file that reached further."""
    if old is None:
        return new
    runs = {r["P"]: r for r in old["runs"]} | {r["P"]: r for r in new["runs"]}
    further = new if (new["max_prompt_tokens"] or 0) >= (old["max_prompt_tokens"] or 0) else old
    return {**further, "runs": [runs[P] for P in sorted(runs)]}


def _merge_floor(old: dict | None, new: dict) -> dict:
    """A later file's floor runs replace the earlier ones of the same mode and P."""
    fresh = {(r["mode"], r["P"]) for r in new["runs"]}
    kept = [r for r in (old or {}).get("runs", []) if (r["mode"], r["P"]) not in fresh]
    return {**new, "runs": kept + new["runs"]}


def rescore(result: dict, kind: str) -> dict:
    """MFU of every timed entry from the current FLOP model, and the memory
    floor from its measured terms (files measured earlier may carry an
    older count)."""
    flops = FlopModel.of(build_model(kind, False, torch.bfloat16, torch.device("meta")))
    G, R = result["G"], result["R"]
    for mode, entry in result.get("sweep", {}).items():
        for run in entry["runs"]:
            if run.get("ok"):
                run["mfu"] = flops.step(mode, run["G"], run["P"], run["R"]) / run["seconds"] / PEAK_FLOPS
    for run in speed_runs(result):
        if run.get("ok"):
            run["mfu"] = flops.step(run["mode"], G, run["P"], R) / run["seconds"] / PEAK_FLOPS
    if "memory_floor" in result:
        score_floor(result["memory_floor"], R)
    capture = result.get("capture", {})
    if "P" in capture:
        work = flops.compiled_forward(G, capture["P"], R)
        capture["forward_flops"] = work
        for entry in [capture, *capture.get("kernels", {}).values()]:
            if "forward_seconds" in entry:
                entry["mfu"] = work / entry["forward_seconds"] / PEAK_FLOPS
    return result


def report(paths: list[str], out_dir: str) -> None:
    """The plot and summary.json from result files (run where matplotlib is).
    Files of the same model are merged in the order given."""
    by_model: dict[str, list[dict]] = {}
    for path in paths:
        with open(path) as f:
            result = json.load(f)
        by_model.setdefault(result["model"], []).append(result)
    results = {kind: rescore(merge(files), kind) for kind, files in by_model.items()}
    plot(results, os.path.join(out_dir, "grpo_bench_peak_memory.png"))
    summary = {kind: summarize(r) for kind, r in results.items()}
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    for kind, result in results.items():
        print_table(kind, result)
