"""benchmarks/results/INDEX.md and the benchmark tables of README.md and
docs/benchmarks.md, generated from the result JSON files, so that every
number a reader sees is one a file holds and a stale copy fails `--check`
(and tests/benchmarks/test_results_index.py).

    python benchmarks/results_index.py          # rewrite INDEX.md and the pages' tables
    python benchmarks/results_index.py --check  # exit 1 when any of them is out of date

Adding a result: write `benchmarks/results/<benchmark>_<name>_<device>.json`
(a .log, .md or .png beside it with the same stem is linked) holding the
benchmark's own keys and the provenance every result carries:

- `command`: the command line, from the repository's root;
- `commit`: the commit measured (git's HEAD; `grpo.results.git_commit()`);
- `device`: `torch.cuda.get_device_name()`, or "cpu";
- `torch`: `torch.__version__`;
- `date`: the day of the run, YYYY-MM-DD.

A value nobody knows is null, never a guess. Files from before `date` existed
carry the day git first saw the file (`git log --diff-filter=A --format=%cs`);
`git_commit`, where a file has it, is the older name of `commit` (equal to it;
`grpo/results.py` still reads it). Then run this script and commit INDEX.md,
README.md and docs/benchmarks.md with the result. When the new run measures
again what an older one did, add the older to `SUPERSEDED`; when a table
should show it, change that table's files in `tables`. Which page holds
which table is `PAGE_TABLES`: each table sits between
`<!-- results:<name>:start -->` and `<!-- results:<name>:end -->` on its page.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
PROVENANCE = ("command", "commit", "device", "torch", "date")
SIBLINGS = (".log", ".md", ".png")

Result = dict[str, Any]


@dataclass(frozen=True)
class Supersession:
    """A later run that measured again what this one did (`partly`: only some
    of its numbers; the run stays current for the rest)."""

    by: str
    why: str
    partly: bool = False


# What the files cannot say: which run replaced which, from the pages that
# cite them (docs/benchmarks.md, docs/parallelism.md, the README). Runs not listed are current.
SUPERSEDED: dict[str, Supersession] = {
    "depth_bench_t32r2_h200": Supersession(
        "depth_bench_t32r2b_h200", "same command after the fix of the carries' reference cycle, which this run measured"),
    "depth_bench_z2_h200": Supersession(
        "depth_bench_z3_h200", "same runs after the checksum and reference-cycle fixes; this one ran out of memory"),
    "depth_bench_w_h200": Supersession("depth_bench_x_h200", "same command with the windowed host reads"),
    "cp_bench_dense_d_h200": Supersession("cp_bench_dense_f_h200", "same commands with the capture in rounds"),
    "cp_bench_hybrid_d_h200": Supersession(
        "cp_bench_hybrid_e_h200", "peaks after the carried operators stopped keeping the round's gathered inputs",
        partly=True),
    # The grpo_bench files the README's report merges: docs/benchmarks.md's table of what the report takes from each.
    "grpo_bench_dense_a_h200": Supersession("grpo_bench_dense_d_h200", "float32 parity, out of memory here", partly=True),
    "grpo_bench_dense_b_h200": Supersession(
        "grpo_bench_dense_f_h200", "LongStraw's sweeps after in-place gradient accumulation", partly=True),
    "grpo_bench_dense_d_h200": Supersession(
        "grpo_bench_dense_f_h200", "the detached sweep after in-place gradient accumulation", partly=True),
    "grpo_bench_dense_e_h200": Supersession(
        "grpo_bench_dense_f_h200", "the exact sweep after in-place gradient accumulation (to 1M: `g`)", partly=True),
    "grpo_bench_hybrid_b_h200": Supersession(
        "grpo_bench_hybrid_e_h200", "LongStraw's sweeps after in-place gradient accumulation", partly=True),
    "grpo_bench_dense_h_h200": Supersession("grpo_bench_dense_i_h200", "same command at a later commit"),
    "verl_bench_dense_h100": Supersession("verl_bench_dense_sweep_h100", "same command with a longer budget"),
    "gpu_tests_now_h100": Supersession("gpu_tests_all_b_h100", "the same tests among the 58 run again at a later commit"),
    "gpu_tests_rest_h100": Supersession("gpu_tests_all_b_h100", "the same tests among the 58 run again at a later commit"),
    "gpu_tests_runtime_fixed_h100": Supersession("gpu_tests_all_b_h100", "its tests but fla's run again at a later "
                                                 "commit (its fla convolution test in gpu_tests_all_h100)", partly=True),
    "grpo_bench_hybrid_h_h200": Supersession("grpo_bench_hybrid_i_h200", "same command at a later commit"),
    "grpo_bench_glm5_a_h200": Supersession(
        "grpo_bench_glm5_h_h200", "LongStraw's warm steps after selected attention and TF32 products", partly=True),
    "grpo_bench_glm5_b_h200": Supersession("grpo_bench_glm5_g_h200", "LongStraw's sweeps after selected attention"),
    "grpo_bench_glm5_c_h200": Supersession("grpo_bench_glm5_e_h200", "parity at 2048; float32 ran out of memory here"),
    "grpo_bench_glm5_d_h200": Supersession("grpo_bench_glm5_g_h200", "the profile at 8K after selected attention"),
    "grpo_bench_glm5_f_h200": Supersession("grpo_bench_glm5_h_h200", "same command after TF32 products"),
    "length_loop_gated_h100": Supersession(
        "length_loop_strided_h100", "the gate keyed on strides too, each mode in its own process"),
    "length_loop_strided_h100": Supersession(
        "length_loop_templates_h100", "same loop at 8K, 32K and 128K with values read off symbolic templates, "
        "flash below 65,536 keys and step graphs' code generated at their first run"),
    "length_loop_templates_h100": Supersession(
        "length_loop20_128k_h100", "the loop at the issue's 20 steps at 128K (from 2K to 32K: length_loop20_h100); "
        "its prefix-grouper row at 128K stands", partly=True),
    "length_loop20_h100": Supersession(
        "length_loop20_b_h100", "same command after planning holds the garbage collector off"),
    "step_profile_first64k_h100": Supersession(
        "step_profile_first64k_b_h100", "same command after the simulation's entry collection went and planning "
        "holds the garbage collector off"),
    "step_profile_peers_dense_h100": Supersession(
        "step_profile_peers_rows_h100", "every peer again from 2K to 16K with the rows at their measured bytes; "
        "its 32K exact step is `step_profile_exact32k_h100`, in a process of its own", partly=True),
    "step_profile_peers_rows_h100": Supersession(
        "step_profile_peers_cut4_h100", "every peer again from 2K to 8K (and prefix-grouper at 16K) with the branch "
        "steps cut at the last read; its 16K LongStraw and TRL steps stand", partly=True),
    "step_profile_cut_h100": Supersession(
        "step_profile_peers_cut4_h100", "the cut as it stands (steps dealt at 256 positions, one host copy of the "
        "key mask a call), beside every peer"),
    "step_profile_peers_cut4_h100": Supersession(
        "step_profile_peers_now_h100", "TRL + checkpointing, prefix-grouper and the exact step from 2K to 32K again "
        "at 69afc9f, each in a process of its own, on one machine"),
    "step_profile_syncs_h100": Supersession(
        "step_profile_finite_h100", "prefix-grouper at 2K and 4K and the exact step at 2K again with check_finite "
        "read once a call; its 4K LongStraw steps and the sync sites stand", partly=True),
    "step_profile_finite_h100": Supersession(
        "step_profile_now_h100", "prefix-grouper and the exact step at 2K and 4K again with the default branch steps "
        "(STEP_POSITIONS 640, decision 0041)"),
    "step_profile_now_h100": Supersession(
        "step_profile_peers_now_h100", "prefix-grouper and the exact step from 2K to 8K again at 69afc9f, beside "
        "TRL + checkpointing and up to 32K"),
    "step_profile_long_h100": Supersession(
        "step_profile_peers_now_h100", "prefix-grouper and the exact step from 8K to 32K again at 69afc9f; "
        "its detached steps stand", partly=True),
    "length_loop20_b_h100": Supersession(
        "length_loop_now3_h100", "the exact loop at 8K and 32K again at 69afc9f (prefix-grouper's at 8K: "
        "length_loop_now_h100); its 2K loops and the detached 32K loop stand", partly=True),
    "length_loop_now_h100": Supersession(
        "length_loop_now3_h100", "the exact loop at 8K again at 69afc9f; its prefix-grouper loop stands", partly=True),
    "length_loop20_128k_h100": Supersession(
        "length_loop_now3_h100", "the exact loop at 128K again at 69afc9f; its detached loop stands", partly=True),
    "trainer_loop_h100": Supersession(
        "trainer_loop_shared_h100", "both trainers at about 16K again, LongStraw's generation prefilling each prompt "
        "once, with expandable segments; its TRL run (generation without HF's cache) stands", partly=True),
    "trainer_loop64k_h100": Supersession(
        "trainer_loop64k_shared_h100", "the same loop with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True ran "
        "its three steps"),
    "step_profile_wg_h100": Supersession(
        "step_profile_syncs_h100", "prefix-grouper and LongStraw at 2K and 4K at fe0cf21 (padded queries left causal "
        "where unread), with the host's time and syncs; its before/after pair stands", partly=True),
    "step_profile_rows_h100": Supersession(
        "step_profile_planned_h100", "the exact and prefix-grouper steps again, with the rows' fused attention, "
        "kept graphs at their measured bytes and the rows giving way to kept graphs", partly=True),
    "step_profile_rows1_h100": Supersession(
        "step_profile_rows1_kept_h100", "same command with the kept graphs counted at their measured bytes"),
    "step_profile_new_length_h100": Supersession(
        "step_profile_new_length_strided_h100", "same command with cuDNN gated at layouts an earlier step ran"),
    "planning_bench_dense_cpu": Supersession(
        "planning_bench_dense_b_cpu", "same command with values read off symbolic examples and lazy code generation"),
    "planning_bench_hybrid_cpu": Supersession(
        "planning_bench_hybrid_b_cpu", "same command with values read off symbolic examples and lazy code generation"),
    "planning_bench_dense_b_cpu": Supersession(
        "planning_bench_dense_c_cpu", "22 draws, counting the garbage collector's full collections in each call"),
    "planning_bench_dense_c_cpu": Supersession(
        "planning_bench_dense_d_cpu", "same command after planning holds the garbage collector off (decision 0040)"),
    "planning_bench_dense_d_cpu": Supersession(
        "planning_bench_dense_e_cpu", "same command after specialisation compares arguments without pytree"),
    "planning_bench_hybrid_b_cpu": Supersession(
        "planning_bench_hybrid_c_cpu", "22 draws, counting the garbage collector's full collections in each call"),
    "planning_bench_hybrid_c_cpu": Supersession(
        "planning_bench_hybrid_d_cpu", "same command after planning holds the garbage collector off (decision 0040)"),
    "planning_bench_hybrid_d_cpu": Supersession(
        "planning_bench_hybrid_e_cpu", "same command after specialisation compares arguments without pytree"),
    "peers_bench_speed_h200": Supersession(
        "peers_bench_speed_b_h200", "LongStraw's warm steps after the padding fix; prefix-grouper's is still this one",
        partly=True),
}

# JSON files that are no run of their own.
DERIVED = {"summary": "merged by `grpo_bench.py --report` from the grpo_bench files the README's command names "
                      "(per model; its `sources` list them)"}

LIMITS = {"oom": "OOM", "time": "stopped by time", "p_max": "the sweep's end"}


def load(folder: Path = RESULTS) -> dict[str, Result]:
    """Every result JSON in `folder` but the derived ones, by stem."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json")) if p.stem not in DERIVED}


def count(n: int | None) -> str:
    """A prompt length or byte count as the README writes it (1,048,576)."""
    return "-" if n is None else f"{n:,}"


def gb(x: float | None) -> str:
    """Gigabytes (1e9 bytes, as the benchmarks measure) to the 0.1 GB the tables show."""
    return "-" if x is None else f"{x:.1f} GB"


def benchmark(result: Result) -> str:
    """The script that wrote the file, from its command."""
    found = re.search(r"(\w+)\.py", result["command"])
    return found.group(1) if found else "?"


# Purpose and headline of each benchmark's files.

def _sweep_and_speed(result: Result) -> list[str]:
    """What grpo_bench and peers_bench share: each sweep's largest P and the warm steps."""
    parts = []
    if result.get("sweep"):
        largest = []
        for mode, sweep in result["sweep"].items():
            runs = {r["P"]: r for r in sweep["runs"] if r.get("ok")}
            top = sweep["max_prompt_tokens"]
            at = f" at {gb(runs[top]['peak_gb'])}" if top in runs else ""
            largest.append(f"{mode} {count(top)}{at} ({LIMITS.get(sweep['limited_by'], sweep['limited_by'])})")
        parts.append("largest P: " + ", ".join(largest))
    timed = [(mode, entry) for mode, entry in result.get("speed", {}).items() if "skipped" not in entry]
    if timed:
        P = timed[0][1].get("P", result.get("p_speed"))
        parts.append(f"warm at {count(P)}: " + ", ".join(
            f"{mode} {entry['seconds']:.2f} s" if entry.get("ok") else f"{mode} OOM" for mode, entry in timed))
    return parts


def _parity(parity: dict) -> list[str]:
    """Worst relative L2 and cosine per dtype, or why the comparison did not run."""
    out = []
    for dtype, entry in parity.items():
        if not isinstance(entry, dict):
            continue
        if "error" in entry:
            out.append(f"{dtype} parity failed ({entry['error'].split(':')[0]})")
        elif "max_rel_l2" in entry:
            out.append(f"{dtype} parity rel L2 {entry['max_rel_l2']:.1e}, cosine {entry['min_cosine']:.4f}")
    return out


def grpo_bench(r: Result) -> tuple[str, str]:
    parts = [k for k in ("sweep", "speed", "parity", "capture", "gdelta", "kernels", "profile") if k in r]
    head = _sweep_and_speed(r) + _parity(r.get("parity", {}))
    if "capture" in r:
        kernels = r["capture"].get("kernels") or {r["capture"].get("kernel", "flash"): r["capture"]}
        head.append(f"capture at {count(r['capture']['P'])}: "
                    + ", ".join(f"{k} MFU {v['mfu']:.1%}" for k, v in kernels.items()))
    if "gdelta" in r:
        head.append("G = 8 over G = 2: "
                    + ", ".join(f"{m} +{v['delta_gb']:.3f} GB" for m, v in r["gdelta"].items() if "delta_gb" in v))
    if "profile" in r:
        head.append("profile: " + ", ".join(f"{p['mode']} at {count(p['P'])}" for p in r["profile"]))
    return f"GRPO step, {r['model']} slice, G = {r['G']}, R = {r['R']}: {', '.join(parts)}", "; ".join(head)


def depth_bench(r: Result) -> tuple[str, str]:
    options = [f"{sorted({run['layers'] for run in r['runs']})[0]} layers"]
    if r.get("ranks", 1) > 1:
        options.append(f"{r['ranks']} {r['backend']} ranks" + (" sharing one GPU" if r.get("shared_gpu") else ""))
    options += ["LoRA"] * bool(r.get("lora")) + ["cuDNN attention"] * (r.get("sdpa") == "cudnn")
    options += ["bf16 adapters"] * (r.get("float32_adapters") is False)
    options += ["attention outputs on host"] * any(run.get("options", {}).get("attention_outputs_on_host")
                                                   for run in r["runs"])
    head = []
    for run in r["runs"]:
        what = f"{run['mode']} {count(run['P'])} (chunk {run.get('options', {}).get('prefix_chunk_size')})"
        if run.get("ok"):
            mfu = f", MFU {run['mfu']:.1%}" if run.get("mfu") else ""
            floor = f" (floor {run['floor_gb']:.1f})" if run.get("floor_gb") else ""
            profiled = " (profiled)" * ("profile" in run)
            head.append(f"{what}: peak {gb(run['peak_gb'])}{floor}, {run['seconds']:.0f} s{mfu}{profiled}")
        else:
            head.append(f"{what}: failed ({run.get('error', '?').split(':')[0]}, peak {gb(run.get('peak_gb'))})")
    return "GRPO step through Qwen3.5-27B-shaped layers: " + ", ".join(options), "; ".join(head)


def context_parallel_bench(r: Result) -> tuple[str, str]:
    head = _parity({p["dtype"]: p for p in r["parity_per_rank"][:1] if p})
    for run in r["runs"]:
        ranks = run.get("ranks") or r["ranks"]
        what = f"{run['mode']} {count(run['P'])} " + ("in one process" if ranks == 1 else f"over {ranks} ranks")
        if run.get("ok"):
            head.append(f"{what}: {gb(run['peak_gb'])}{' per rank' * (ranks > 1)}, {run['seconds']:.0f} s")
        else:
            head.append(f"{what}: {'skipped (' + run['skipped'] + ')' if 'skipped' in run else 'failed'}")
    shared = " sharing one GPU" if r.get("shared_gpu") else ""
    return (f"context parallelism, {r['model']} slice over {r['ranks']} {r['backend']} ranks{shared}, "
            f"G = {r['G']}, R = {r['R']}", "; ".join(head))


def peers_bench(r: Result) -> tuple[str, str]:
    return (f"TRL's GRPO micro-batch ({r['n_prompts']} prompts x G = {r['G']}, R = {r['R']}) on the {r['model']} "
            f"slice: {', '.join(r['sweep'])}", "; ".join(_sweep_and_speed(r)))


def attention_bench(r: Result) -> tuple[str, str]:
    kernels = list(dict.fromkeys(run["kernel"] for run in r["runs"]))
    n, far = r["runs"][0]["n"], max(run["o"] for run in r["runs"])
    best = [f"{run['kernel']} {run['forward_tflops']:.0f} / {run['backward_tflops']:.0f}"
            for run in r["runs"] if run["n"] == n and run["o"] == far]
    return (f"attention kernels ({', '.join(kernels)}): TFLOP/s of n queries over o earlier positions",
            f"n = {count(n)}, o = {count(far)}: " + ", ".join(best) + " TFLOP/s (forward / backward)")


def gpu_smoke(r: Result) -> tuple[str, str]:
    head = [f"{key.removesuffix('_parity_fp32')} {mode} rel L2 {entry['max_rel_l2']:.1e}"
            for key in r if key.endswith("_parity_fp32")
            for mode, entry in r[key].items() if isinstance(entry, dict) and "max_rel_l2" in entry]
    scale = r.get("scale_qwen3_8b_slice", [])
    for mode in dict.fromkeys(s["mode"] for s in scale):
        top = max((s for s in scale if s["mode"] == mode), key=lambda s: s["P"])
        head.append(f"{mode} {count(top['P'])} at {gb(top['peak_gb'])}, {top['seconds']:.1f} s")
    return "GPU smoke: float32 parity of the tiny dense and hybrid models, scale on the Qwen3-8B slice", "; ".join(head)


def state_bytes(r: Result) -> tuple[str, str]:
    models = [m["model"] for m in r["models"]]
    return (f"prompt state bytes at full model shapes ({', '.join(models)}), `longstraw.explain` on the meta device",
            "; ".join(f"{m['model']} {count(m['state_bytes_per_position'])} B / position, {m['ratio']:.1f}x under "
                      f"decompressed K/V" for m in r["models"]))


def planning_bench(r: Result) -> tuple[str, str]:
    planned = [c for c in r["calls"] if not c["dynamo_compiled"]]
    compiles = [c for c in r["calls"] if c["dynamo_compiled"]]
    mean = sum(c["plan_s"] for c in planned) / max(len(planned), 1)
    return (f"host cost of new prompt lengths ({r['model']} slice on the meta device, {r['mode']}): Dynamo's compiles "
            f"and the plan per new length",
            f"{len(compiles)} Dynamo compiles in {len(r['calls'])} calls ({sum(c['wall_s'] for c in compiles):.1f} s), "
            f"then {mean:.2f} s of planning per new length" + (
                f" ({sum(c['wall_s'] for c in planned) / max(len(planned), 1):.3f} s a call, "
                f"{sum(c['full_collections'] for c in planned)} full garbage collections in them)"
                if planned and "full_collections" in planned[0] else ""))


def length_loop_bench(r: Result) -> tuple[str, str]:
    kernels = {json.dumps(run.get("options", {}).get("kernels", "sdpa")) for run in r["runs"]}
    where = "its own process per run" if r.get("isolated") else "one process for every run"
    head = [f"{run['mode']} {count(run['P'])}: {run['loop_mean_s']:.2f} s against {run['warm_s']:.2f} s warm "
            f"({run['loop_over_warm']:.2f}x)" if run.get("ok") else f"{run['mode']} {count(run['P'])}: "
            + ("OOM" if run.get("oom") else "failed") for run in r["runs"]]
    return (f"a loop of {r['steps']} steps of new prompt and completion lengths ({r['model']} slice, "
            f"{r['n_prompts']} prompts x G = {r['G']}, R up to {r['R']}), attention {', '.join(sorted(kernels))}, "
            f"{where}", "; ".join(head))


def step_profile(r: Result) -> tuple[str, str]:
    head = []
    for run in r["runs"]:
        if not run.get("ok"):
            continue
        new = run.get("new_length")
        head.append(f"{run['model']} {run['mode']} {count(run['P'])}: warm {run['warm_s']:.2f} s"
                    + ("" if new is None else f", first call at new lengths {new['first_s']:.2f} s"))
    return f"where one step's time goes ({r['n_prompts']} prompts x G = {r['G']}, R = {r['R']})", "; ".join(head)


def trainer_loop_bench(r: Result) -> tuple[str, str]:
    head = []
    for run in r["runs"]:
        if not run.get("ok"):
            head.append(f"{run['mode']} {count(run['P'])}: " + ("OOM" if run.get("oom") else "failed"))
            continue
        mean = run["mean_s"]
        head.append(f"{run['mode']} {count(run['P'])}: {mean['total']:.2f} s a step, loss + backward "
                    f"{mean['loss'] + mean['backward']:.2f} s, peak {run['peak_gb']:.1f} GB")
    return (f"`train()` with generation ({r['model']} slice, {r['n_prompts']} prompts x G = {r['G']}, R = {r['R']}, "
            f"{r['steps']} steps): each step split into generation, scoring, loss and backward", "; ".join(head))


def verl_bench(r: Result) -> tuple[str, str]:
    head = []
    for mode, sweep in r["sweep"].items():
        ok = [run for run in sweep["runs"] if run.get("ok")]
        if not ok:
            head.append(f"{mode}: " + ("OOM" if any(run.get("oom") for run in sweep["runs"]) else "failed")
                        + f" at {count(sweep['runs'][0]['P'])}")
            continue
        last = ok[-1]
        head.append(f"{mode}: largest P {count(last['P'])} ({sweep['limited_by']}), warm update {last['warm_s']:.2f} s, "
                    f"peak {last['peak_gb']:.1f} GB")
    return (f"verl's FSDP2 actor update, its engine against LongStraw's ({r['model']} slice, 2 prompts x G = {r['G']}, "
            f"R = {r['R']}, flash_attn {'on' if r.get('flash_attn') else 'off'})", "; ".join(head))


def gpu_tests(r: Result) -> tuple[str, str]:
    counts = Counter(test["outcome"] for test in r["tests"].values())
    head = ", ".join(f"{n} {outcome}" for outcome, n in counts.items())
    bad = [name.split("::")[-1] for name, test in r["tests"].items() if test["outcome"] in ("failed", "error")]
    return (f"the GPU-marked tests of {', '.join(r['paths'])}",
            head + (f" ({', '.join(bad)})" if bad else "") + (", stopped by its budget" if r["stopped_by_budget"] else ""))


# By the name of the script that writes the files.
DESCRIBE: dict[str, Callable[[Result], tuple[str, str]]] = {f.__name__: f for f in (
    grpo_bench, depth_bench, context_parallel_bench, peers_bench, attention_bench, gpu_smoke, state_bytes,
    planning_bench, length_loop_bench, step_profile, trainer_loop_bench, verl_bench, gpu_tests)}


def describe(result: Result) -> tuple[str, str]:
    """Purpose and headline; a benchmark without a describer gets its name alone."""
    name = benchmark(result)
    return DESCRIBE[name](result) if name in DESCRIBE else (name, "")


# INDEX.md

def cell(text: str) -> str:
    """Text that cannot break the table's row."""
    return text.replace("|", "\\|").replace("\n", " ")


def run_cell(stem: str, folder: Path) -> str:
    links = [f"[{s[1:]}]({stem}{s})" for s in SIBLINGS if (folder / f"{stem}{s}").exists()]
    return f"[{stem}]({stem}.json)" + (f" ({', '.join(links)})" if links else "")


def superseded_cell(stem: str) -> str:
    s = SUPERSEDED.get(stem)
    return "" if s is None else f"{'partly: ' * s.partly}{s.by} ({s.why})"


def table(stems: list[str], runs: dict[str, Result], folder: Path) -> list[str]:
    lines = ["| run | purpose | command | commit | headline | superseded by |", "|---|---|---|---|---|---|"]
    for stem in stems:
        r = runs[stem]
        purpose, headline = describe(r)
        commit = f"`{r['commit'][:7]}`" if r.get("commit") else "unknown"
        lines.append("| " + " | ".join(cell(c) for c in (
            run_cell(stem, folder), purpose, f"`{r['command']}`", commit, headline, superseded_cell(stem))) + " |")
    return lines


def index(runs: dict[str, Result], folder: Path = RESULTS) -> str:
    """INDEX.md's text."""
    archived = [s for s in runs if s in SUPERSEDED and not SUPERSEDED[s].partly]
    current = [s for s in runs if s not in archived]
    stems = set(runs) | set(DERIVED)
    others = sorted(p.name for p in folder.iterdir()
                    if p.suffix in SIBLINGS and p.stem not in stems and p.name != "INDEX.md")
    lines = [
        "# Benchmark results",
        "",
        "Generated by `python benchmarks/results_index.py` from the JSON files in this folder; do not edit it by hand "
        "(`--check` fails when it is stale). Every result JSON records `command`, `commit`, `device`, `torch` and "
        "`date` (null where unknown; files from before `date` existed carry the day git first saw the file). How to add "
        "a result is in the script's docstring. A run is archived when a later run measured again what it did; which "
        "one, and why, is the script's `SUPERSEDED` table, taken from docs/benchmarks.md and docs/parallelism.md. "
        "\"partly\" marks a run of which only some numbers were measured again: it stays current for the rest.",
        "",
        f"## Current runs ({len(current)})",
        "",
        *table(current, runs, folder),
        "",
        f"## Archived runs ({len(archived)})",
        "",
        *table(archived, runs, folder),
        "",
        "## Other files",
        "",
        *[f"- [{stem}.json]({stem}.json): {why}" for stem, why in DERIVED.items()],
        "- without a result JSON (GPU test runs, comparisons, the report's plot): "
        + ", ".join(f"[{name}]({name})" for name in others),
        "",
    ]
    return "\n".join(lines)


# The pages' tables: merged the way `grpo_bench.py --report` merges files.

@dataclass
class Merged:
    """Per mode: the sweep's runs by P (the later file's where two ran one),
    its largest P and what stopped it (from the file that reached further),
    and the warm step of the last file that timed the mode (and that file)."""

    runs: dict[str, dict[int, dict]]
    largest: dict[str, tuple[int | None, str, int | None]]
    warm: dict[str, tuple[str, dict]]

    def peak(self, mode: str, P: int | None) -> float | None:
        """A sweep's run at P, else a warm step's."""
        run = self.runs.get(mode, {}).get(P)
        if run and run.get("ok"):
            return run["peak_gb"]
        entry = self.warm.get(mode, ("", {}))[1]
        return entry["peak_gb"] if entry.get("ok") and entry.get("P") == P else None


def merge(runs: dict[str, Result], stems: list[str]) -> Merged:
    """`stems` in order, later files over earlier ones (a command of ten
    minutes extends another's sweep or times a mode again)."""
    merged = Merged({}, {}, {})
    for stem in stems:
        r = runs[stem]
        for mode, sweep in r.get("sweep", {}).items():
            merged.runs[mode] = merged.runs.get(mode, {}) | {run["P"]: run for run in sweep["runs"]}
            top = sweep["max_prompt_tokens"]
            if mode not in merged.largest or (top or 0) >= (merged.largest[mode][0] or 0):
                merged.largest[mode] = (top, sweep["limited_by"], sweep.get("first_failure"))
        for mode, entry in r.get("speed", {}).items():
            if "skipped" not in entry:
                merged.warm[mode] = (stem, {**entry, "P": entry.get("P", r.get("p_speed"))})
    return merged


def warm_seconds(m: Merged, mode: str, P: int) -> str:
    """A mode's warm step at P, "OOM" where it ran out of memory, "-" where not timed."""
    entry = m.warm.get(mode, ("", {}))[1]
    if entry.get("P") != P:
        return "-"
    return f"{entry['seconds']:.2f}" if entry.get("ok") else "OOM"


GRPO_MODES = {"eager": "eager", "eager_ckpt": "eager + checkpointing",
              "eager_shared_prefix": "eager shared prefix (flex attention)",
              "longstraw_detached": "longstraw detached", "longstraw_exact": "longstraw exact"}
PEERS_MODES = {"trl_eager": "TRL", "trl_ckpt": "TRL + gradient checkpointing", "prefix_grouper": "prefix-grouper",
               "longstraw_detached": "LongStraw detached", "longstraw_exact": "LongStraw exact"}


def grpo_dense(runs: dict[str, Result], stems: list[str], P: int) -> list[str]:
    """Every mode's warm step and peak at P, and how far its sweep went."""
    m = merge(runs, stems)
    lines = [f"| mode | s/step at P = {P // 1024}K | peak at {P // 1024}K | largest P run |", "|---|---|---|---|"]
    for mode, label in GRPO_MODES.items():
        top, limit, _ = m.largest[mode]
        largest = f"{count(top)} (then OOM)" if limit == "oom" else f"{count(top)} at {gb(m.peak(mode, top))}"
        lines.append(f"| {label} | {warm_seconds(m, mode, P)} | {gb(m.peak(mode, P))} | {largest} |")
    return lines


def grpo_glm5(runs: dict[str, Result], stems: list[str], P: int) -> list[str]:
    """How far each mode's sweep went and why it stopped, and the warm step at P."""
    m = merge(runs, stems)
    lines = [f"| mode | largest P | peak there | s/step at P = {P} (warm) | peak at {P} |", "|---|---|---|---|---|"]
    for mode, label in GRPO_MODES.items():
        if mode in m.largest:
            top, limit, failure = m.largest[mode]
            why = f"{count(failure)} OOM" if limit == "oom" else LIMITS[limit]
            lines.append(f"| {label} | {count(top)} ({why}) | {gb(m.peak(mode, top))} | "
                         f"{warm_seconds(m, mode, P)} | {gb(m.peak(mode, P))} |")
    return lines


def peers(runs: dict[str, Result], stems: list[str], P: int, before: str) -> list[str]:
    """`before`: the file of the warm steps before the padding fix, shown beside the later ones."""
    m = merge(runs, stems)
    old = {mode: e for mode, e in runs[before]["speed"].items() if e.get("ok")}
    lines = [f"| mode | largest P | first P out of memory | peak at P = {P // 1024}K | warm s/step at {P // 1024}K |",
             "|---|---|---|---|---|"]
    for mode, label in PEERS_MODES.items():
        top, limit, failure = m.largest[mode]
        largest = (count(top) if limit == "oom" or top is None
                   else f"{count(top)} at {gb(m.peak(mode, top))} ({LIMITS[limit]})")
        seconds = warm_seconds(m, mode, P)
        if mode in old and m.warm[mode][0] != before:
            seconds += f" ({old[mode]['seconds']:.2f} before the fix)"
        first_oom = count(failure) if limit == "oom" else "-"
        lines.append(f"| {label} | {largest} | {first_oom} | {gb(m.peak(mode, P))} | {seconds} |")
    return lines


def step_profiles(runs: dict[str, Result], before: str, stems: list[str]) -> list[str]:
    """One row per (mode, P, options) of `stems`' step profiles, with the warm step of `before` beside it."""
    earlier = {(r["mode"], r["P"]): r for r in runs[before]["runs"] if r.get("ok")}
    lines = ["| mode | P | warm s/step | before | kernel s | peak | phases s |", "|---|---|---|---|---|---|---|"]
    for stem in stems:
        for r in runs[stem]["runs"]:
            if not r.get("ok"):
                continue
            options = ", ".join(f"`{k}={v}`" for k, v in (r.get("options") or {}).items())
            mode = r["mode"] + (f" ({options})" if options else "")
            old = earlier.get((r["mode"], r["P"]))
            was = f"{old['warm_s']:.2f}" if old else "-"
            phases = ", ".join(f"{name} {t:.2f}" for name, t in r.get("phases_s", {}).items()) or "-"
            lines.append(f"| {mode} | {count(r['P'])} | {r['warm_s']:.2f} | {was} | {r['kernel_s']:.2f} | "
                         f"{gb(r['peak_gb'])} | {phases} |")
    return lines


EVERY_LENGTH_MODES = ("longstraw_exact", "longstraw_detached", "prefix_grouper", "trl_ckpt")


def every_length(runs: dict[str, Result], stems: list[str], invalid: set[tuple[str, str, int]]) -> list[str]:
    """Warm step and peak per prompt length and peer, each cell from the
    last of `stems` that ran it, except the runs `invalid` names
    (stem, mode, P); an out-of-memory run says so."""
    cells: dict[tuple[str, int], str] = {}
    for stem in stems:
        for r in runs[stem]["runs"]:
            if (stem, r["mode"], r["P"]) in invalid or r["mode"] not in EVERY_LENGTH_MODES:
                continue
            if r.get("ok"):
                cells[r["mode"], r["P"]] = f"{r['warm_s']:.3f} s ({gb(r['peak_gb'])})"
            elif r.get("oom"):
                cells[r["mode"], r["P"]] = "out of memory"
    lengths = sorted({P for _, P in cells})
    lines = ["| P | " + " | ".join(PEERS_MODES[m] for m in EVERY_LENGTH_MODES) + " |",
             "|---|" + "---|" * len(EVERY_LENGTH_MODES)]
    for P in lengths:
        lines.append(f"| {count(P)} | " + " | ".join(cells.get((m, P), "-") for m in EVERY_LENGTH_MODES) + " |")
    return lines


def length_loop(runs: dict[str, Result], stems: list[str]) -> list[str]:
    """Per mode and P: the warm step at P, the mean step of the loop of new
    lengths, and their ratio; a (mode, P) of several files from the first."""
    lines = ["| P | mode | steps | warm step at P | mean step of the loop | loop / warm | plans (s) | Dynamo compiles |",
             "|---|---|---|---|---|---|---|---|"]
    seen = set()
    rows = [(stem, r) for stem in stems for r in runs[stem]["runs"]]
    for stem, r in sorted(rows, key=lambda sr: sr[1]["P"]):
        if (r["mode"], r["P"]) in seen:
            continue
        seen.add((r["mode"], r["P"]))
        label, steps = PEERS_MODES[r["mode"]], runs[stem]["steps"]
        if not r.get("ok"):
            lines.append(f"| {count(r['P'])} | {label} | {steps} | {'out of memory' if r.get('oom') else 'failed'} "
                         "| - | - | - | - |")
            continue
        lines.append(f"| {count(r['P'])} | {label} | {steps} | {r['warm_s']:.2f} s | {r['loop_mean_s']:.2f} s | "
                     f"{r['loop_over_warm']:.2f}x | {r['plans']} ({r['plan_s']:.1f}) | {r['dynamo_graphs']} |")
    return lines


def depth(runs: dict[str, Result], stems: list[str]) -> list[str]:
    """One row per file: its largest P run."""
    lines = ["| mode | P | peak | floor (weights + grads + state (+ d(state))) | seconds (whole call) |",
             "|---|---|---|---|---|"]
    for stem in stems:
        r = runs[stem]
        run = max((run for run in r["runs"] if run.get("ok")), key=lambda run: run["P"])
        details = [f"chunk {run['options']['prefix_chunk_size']}"] + ["cuDNN attention"] * (r.get("sdpa") == "cudnn")
        details += ["bf16 adapters"] * (r.get("float32_adapters") is False)
        details += ["`attention_outputs_on_host`"] * bool(run["options"].get("attention_outputs_on_host"))
        lines.append(f"| {run['mode']} ({', '.join(details)}) | {count(run['P'])} | {gb(run['peak_gb'])} | "
                     f"{gb(run['floor_gb'])} | {run['seconds']:.0f} (MFU {run['mfu']:.1%}) |")
    return lines


STATE_TENSORS = ("latent", "rope key", "index key")  # MLA's state per position, in the order explain lists them
SHAPES_OF = {"GLM-5.1": "GLM-5's shapes"}


def state(runs: dict[str, Result], stem: str) -> list[str]:
    """Per model, the state's bytes per position against decompressed K/V's."""
    r = runs[stem]
    size = {"bfloat16": 2, "float16": 2, "float32": 4}[r["traced"]["dtype"]]
    lines = ["| model | layers | state B / position / layer | whole model B / position | "
             "decompressed K/V B / position | ratio |", "|---|---|---|---|---|---|"]
    for m in r["models"]:
        values = " + ".join(f"{name} {b // size}"
                            for name, b in zip(STATE_TENSORS, m["state_tensors_bytes_per_position_per_layer"]))
        name = m["model"] + (f" ({SHAPES_OF[m['model']]})" if m["model"] in SHAPES_OF else "")
        lines.append(f"| {name} | {m['layers']} | {count(m['state_bytes_per_position_per_layer'])} ({values} values, "
                     f"{'bf16' if size == 2 else r['traced']['dtype']}) | {count(m['state_bytes_per_position'])} | "
                     f"{count(m['decompressed_kv_bytes_per_position'])} | {m['ratio']:.1f}x |")
    return lines


PAGE_TABLES: dict[str, tuple[str, ...]] = {
    "README": ("grpo-dense", "every-length", "depth", "index"),
    "benchmarks": ("grpo-dense", "every-length", "length-loop", "depth", "grpo-glm5", "state-bytes", "peers",
                   "step-profile"),
}
"""Which tables each page holds (README.md, docs/benchmarks.md), by marker name."""


def tables(runs: dict[str, Result]) -> dict[str, str]:
    """The text of each marked table, by name; the files each table shows are
    chosen here (the dense one: the files the README's report command merges)."""
    dense = [f"grpo_bench_dense_{n}_h200" for n in "abdefg"]
    glm5 = [f"grpo_bench_glm5_{n}_h200" for n in "acegh"]
    return {
        "grpo-dense": "\n".join(grpo_dense(runs, dense, 32768)),
        # the later run's exact step at 32K planned for what an out-of-memory peer left held (its note)
        "every-length": "\n".join(every_length(runs, ["step_profile_peers_dense_h100", "step_profile_peers_rows_h100",
                                                       "step_profile_exact32k_h100", "step_profile_peers_cut4_h100",
                                                       "step_profile_wg_h100", "step_profile_long_h100",
                                                       "step_profile_syncs_h100", "step_profile_finite_h100",
                                                       "step_profile_now_h100", "step_profile_peers_now_h100"],
                                                # a row's cells from one run: the 4K exact step did not run there
                                                {("step_profile_peers_rows_h100", "longstraw_exact", 32768),
                                                 ("step_profile_finite_h100", "prefix_grouper", 4096)})),
        "length-loop": "\n".join(length_loop(runs, ["length_loop_now3_h100", "length_loop_now3_pg_h100",
                                                    "length_loop_now_h100", "length_loop20_b_h100", "length_loop20_128k_h100",
                                                          "length_loop_templates_h100"])),
        "depth": "\n".join(depth(runs, ["depth_bench_k_h200", "depth_bench_x_h200", "depth_bench_s_h200"])),
        "grpo-glm5": "\n".join(grpo_glm5(runs, glm5, 3072)),
        "state-bytes": "\n".join(state(runs, "state_bytes")),
        "peers": "\n".join(peers(runs, ["peers_bench_speed_h200", "peers_bench_h200", "peers_bench_speed_b_h200"],
                                 16384, before="peers_bench_speed_h200")),
        "step-profile": "\n".join(step_profiles(runs, "step_profile_dense_h200",
                                                 ["step_profile_dense_b_h200", "step_profile_dense_nokeep_h200"])),
        "index": "Every result file, with its purpose, command, commit, headline and what\n"
                 "superseded it: [benchmarks/results/INDEX.md](benchmarks/results/INDEX.md).\n"
                 "The tables between `results:` markers here and in [docs/benchmarks.md](docs/benchmarks.md)\n"
                 "are generated from the result files by `python benchmarks/results_index.py`\n"
                 "(`--check` fails when they are stale).",
    }


def page_tables(runs: dict[str, Result], page: str) -> dict[str, str]:
    """The tables of one page of `PAGE_TABLES`."""
    every = tables(runs)
    return {name: every[name] for name in PAGE_TABLES[page]}


def readme_tables(runs: dict[str, Result]) -> dict[str, str]:
    """The README's tables, by name."""
    return page_tables(runs, "README")


def render(text: str, tables: dict[str, str], page: str = "README.md") -> str:
    """`text` with each marked region's content replaced by its table."""
    for name, body in tables.items():
        start, end = f"<!-- results:{name}:start -->", f"<!-- results:{name}:end -->"
        if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
            raise ValueError(f"{page} needs one {start} ... {end} pair")
        head, rest = text.split(start)
        text = f"{head}{start}\n\n{body}\n\n{end}{rest.split(end)[1]}"
    return text


def render_readme(text: str, tables: dict[str, str]) -> str:
    """`render` for the README."""
    return render(text, tables)


def outputs(folder: Path = RESULTS, readme: Path = README, benchmarks: Path = BENCHMARKS) -> dict[Path, str]:
    """Each generated file and the text it should hold."""
    runs = load(folder)
    return {folder / "INDEX.md": index(runs, folder),
            readme: render(readme.read_text(), page_tables(runs, "README"), "README.md"),
            benchmarks: render(benchmarks.read_text(), page_tables(runs, "benchmarks"), "docs/benchmarks.md")}


def main(argv: list[str] | None = None, folder: Path = RESULTS, readme: Path = README,
         benchmarks: Path = BENCHMARKS) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when INDEX.md or a page's tables are stale")
    args = parser.parse_args(argv)
    stale = {path: text for path, text in outputs(folder, readme, benchmarks).items()
             if not path.exists() or path.read_text() != text}
    for path, text in stale.items():
        if args.check:
            print(f"{path} is out of date: run python benchmarks/results_index.py", file=sys.stderr)
        else:
            path.write_text(text)
            print(f"wrote {path}")
    return int(args.check and bool(stale))


if __name__ == "__main__":
    sys.exit(main())
