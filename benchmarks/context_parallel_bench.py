"""Context parallelism on GPUs: grpo_bench's GRPO step with the prompt state
sharded over `--ranks` processes (`Options.context_parallel`).

    python benchmarks/context_parallel_bench.py --model dense --ranks 2 --P 65536,262144 \
        --out-dir $OUT --name cp_bench_dense_h200

Each rank is a process on GPU `rank mod the GPUs there are`: NCCL when every
rank has a GPU of its own, else gloo over CUDA tensors. Ranks sharing a GPU
measure each rank's memory exactly (the allocator's peak is per process) but
not the time, since they run on one GPU's compute: `shared_gpu` says which.

1. Parity: float32 (`--parity-dtype`) at `--p-parity` (several 8192-position chunks, so every
   rank holds some), exact mode: every rank's loss and gradients against the
   same step in one process, which each rank also runs alone (no
   collectives); relative L2 per parameter, the worst kept. Also whether
   the ranks' gradients agree bit for bit, and how far apart they are with
   the runtime's broadcast of the first rank's gradient turned off.
2. Per mode and P (bf16, G = 8, R = 1024, chunk 8192): each rank's peak
   allocated memory and step time (the first call, which plans and
   compiles, then a warm one, unless --no-warm); with `--baseline` also
   the same steps in one process, which every process runs alone at the
   same time (`"ranks": 1`: with a GPU each, the one-GPU time and peak
   measured in the same command). Each rank's peak per runtime phase
   (`phase_peaks_gb_per_rank`), and with `--trace` what was live at rank
   0's peak, grouped by the line that allocated it (`live_at_peak`).
   Rank 0 decides, by the time left, whether a run starts, and tells the
   others: ranks must agree, or one would wait in a collective the other
   never calls.

`tests/planning/test_report.py` holds the planner's per-rank peak
(`explain(...).plan(P, ranks=W)`) to these measurements.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

from longstraw.runtime import backward as runtime_backward

from grpo.measure import Clock, live_at_peak, phase_peaks, phase_seconds, release, sync
from grpo.models import build_model, make_group
from grpo.modes import Runner
from grpo.parity import _grads_on_cpu, compare
from grpo.ranks import agreed, init_rank, spawn
from grpo.results import provenance


def _step(runner: Runner, group, trace: bool = False) -> dict:
    """One step: seconds, the seconds of each phase of the runtime's steps
    (the rest of a first call is tracing, partitioning and compiling), and
    this process's peak allocated memory (0 on the CPU), on a GPU also per
    phase and, with `trace`, what was live at the peak (`live_at_peak`)."""
    cuda = torch.cuda.is_available()
    sync()
    start = time.perf_counter()
    with phase_seconds() as phases, phase_peaks() if cuda else contextlib.nullcontext({}) as peaks:
        loss, live = live_at_peak(lambda: runner.step(group)) if trace and cuda else (runner.step(group), None)
    sync()
    out = {"seconds": time.perf_counter() - start, "loss": float(loss), "phases": phases,
           "peak_gb": max(peaks.values(), default=0.0), "phase_peaks_gb": peaks}
    return out if live is None else {**out, "live_at_peak": live}


def _ranks_apart(grads: dict[str, torch.Tensor], device: torch.device) -> dict:
    """How the ranks' gradients differ: per parameter [sum, norm] in
    float64, gathered from every rank and compared with rank 0's."""
    sums = torch.stack([torch.stack([g.sum(dtype=torch.float64), g.norm(dtype=torch.float64)]) for g in grads.values()])
    sums = sums.to(device)
    gathered = [torch.empty_like(sums) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, sums)
    rows = torch.stack(gathered).cpu()
    apart = (rows != rows[:1]).any(-1).any(0)
    norm_diff = ((rows[:, :, 1] - rows[:1, :, 1]).abs() / rows[:1, :, 1].clamp_min(1e-300)).max()
    return {"parameters_apart": int(apart.sum()), "parameters": len(grads), "max_rel_norm_diff": float(norm_diff)}


def _parity(args, rank: int, device: torch.device) -> dict:
    """Also whether the ranks' gradients agree bit for bit (the runtime
    gives every rank the first rank's), and how far apart they are with
    that broadcast turned off (`drift_without_broadcast`): what a GPU's
    atomics leave between two ranks' copies of the same step."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dtype = getattr(torch, args.parity_dtype)
    model = build_model(args.model, args.tiny, dtype, device)
    group = make_group(args.G, args.p_parity, args.R, model.config.vocab_size, device)
    with Runner(model, args.model, "longstraw_exact", context_parallel=dist.group.WORLD, prefix_chunk_size=args.chunk) as runner:
        sharded_loss = float(runner.step(group))
        sharded = _grads_on_cpu(model)
        ranks_apart = _ranks_apart(sharded, device)
        broadcast, runtime_backward.replicate_from_first = runtime_backward.replicate_from_first, lambda tensors, group: None
        try:
            runner.step(group)
        finally:
            runtime_backward.replicate_from_first = broadcast
        drift = _ranks_apart(_grads_on_cpu(model), device)
    with Runner(model, args.model, "longstraw_exact", prefix_chunk_size=args.chunk) as runner:
        alone_loss = float(runner.step(group))
    alone = _grads_on_cpu(model)
    result = {"P": args.p_parity, "dtype": args.parity_dtype, "loss_rel_diff": abs(sharded_loss - alone_loss) / abs(alone_loss),
              **compare(sharded, alone), "ranks_apart": ranks_apart, "drift_without_broadcast": drift}
    del model, sharded, alone
    release()
    return result


def _worker(rank: int, world: int, port: int, args, out: str) -> None:
    device, backend = init_rank(rank, world, port)
    gpus = torch.cuda.device_count()
    clock = Clock(args.budget_s)
    result = {"rank": rank, "backend": backend, "shared_gpu": 0 < gpus < world, "runs": []}
    if args.p_parity:
        start = time.perf_counter()
        result["parity"] = _parity(args, rank, device)
        print(f"rank {rank} parity ({time.perf_counter() - start:.0f} s): {result['parity']}", flush=True)
    model = build_model(args.model, args.tiny, torch.bfloat16 if device.type == "cuda" else torch.float32, device)
    for mode in args.modes.split(","):
        for ranks in (world, 1) if args.baseline else (world,):
            group_of_ranks = dist.group.WORLD if ranks > 1 else None
            with Runner(model, args.model, f"longstraw_{mode}", context_parallel=group_of_ranks,
                        prefix_chunk_size=args.chunk) as runner:
                for P in (int(p) for p in args.P.split(",")):
                    run = {"mode": mode, "P": P, "G": args.G, "R": args.R, "ranks": ranks}
                    if not agreed(clock.left() > args.reserve_s, device):
                        result["runs"].append({**run, "ok": False, "skipped": "time"})
                        continue
                    result["runs"].append(_measured(run, runner, model, args))
                    print(f"rank {rank} {mode:8s} P={P:>8d} over {ranks} rank(s): {_described(result['runs'][-1])}",
                          flush=True)
            dist.barrier()  # the one-process steps end on every rank before the next mode's collectives
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _measured(run: dict, runner: Runner, model, args) -> dict:
    """`run` with the first call's and (unless --no-warm) a warm step's times and the peak."""
    group = make_group(args.G, run["P"], args.R, model.config.vocab_size, next(model.parameters()).device)
    first = _step(runner, group, trace=args.trace and not args.warm and dist.get_rank() == 0)
    release(model)
    warm = _step(runner, group, trace=args.trace and dist.get_rank() == 0) if args.warm else first
    release(model)
    traced = {"live_at_peak": warm["live_at_peak"]} if "live_at_peak" in warm else {}
    return {**run, "ok": True, "first_seconds": first["seconds"], "seconds": warm["seconds"],
            "peak_gb": max(first["peak_gb"], warm["peak_gb"]), "loss": warm["loss"],
            "first_phases": first["phases"], "phases": warm["phases"], "phase_peaks_gb": warm["phase_peaks_gb"], **traced}


def _described(run: dict) -> str:
    rounded = {phase: round(seconds, 2) for phase, seconds in run["phases"].items()}
    return f"first {run['first_seconds']:.1f}s, warm {run['seconds']:.2f}s {rounded}, peak {run['peak_gb']:.1f}GB"


def table(result: dict) -> str:
    lines = ["| mode | P | ranks | peak GB per process | first step s | warm step s |",
             "| --- | ---: | ---: | --- | ---: | ---: |"]
    for run in result["runs"]:
        head = f"| {run['mode']} | {run['P']:,} | {run['ranks']} |"
        if run["ok"]:
            peaks = " / ".join(f"{p:.1f}" for p in run["peak_gb_per_rank"])
            lines.append(f"{head} {peaks} | {run['first_seconds']:.1f} | {run['seconds']:.2f} |")
        else:
            lines.append(f"{head} skipped ({run.get('skipped')}) | | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("dense", "hybrid"), default="dense")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--modes", default="detached,exact")
    parser.add_argument("--P", default="65536,262144", help="prompt lengths, comma-separated")
    parser.add_argument("--G", type=int, default=8)
    parser.add_argument("--R", type=int, default=1024)
    parser.add_argument("--p-parity", type=int, default=32768, help="0: no parity run")
    parser.add_argument("--parity-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="bfloat16: the kernels of the measured runs (flash or cuDNN attention)")
    parser.add_argument("--chunk", type=int, default=8192, help="prefix_chunk_size")
    parser.add_argument("--warm", action=argparse.BooleanOptionalAction, default=True,
                        help="a second, warm step per run (--no-warm: the first call only, its time and peak)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (on the CPU without CUDA: a smoke run)")
    parser.add_argument("--baseline", action="store_true",
                        help="also each mode's steps without context parallelism, every process alone at once "
                             "(with a GPU each: the one-GPU time, in the same command)")
    parser.add_argument("--trace", action="store_true",
                        help="rank 0 records the allocator's trace of the measured step (the warm one, else the first) "
                             "and keeps what was live at its peak")
    parser.add_argument("--budget-s", type=float, default=480)
    parser.add_argument("--reserve-s", type=float, default=90, help="no run starts with less time left than this")
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--name", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.tiny:
        sys.exit("context_parallel_bench needs CUDA (or --tiny)")
    name = args.name or f"cp_bench_{args.model}"
    out = Path(args.out_dir)
    ranks_dir = out / f"{name}_ranks"
    ranks_dir.mkdir(parents=True, exist_ok=True)
    spawn(_worker, args.ranks, args, str(ranks_dir))
    per_rank = [torch.load(ranks_dir / f"rank{r}.pt", weights_only=False) for r in range(args.ranks)]
    runs = []
    for i, run in enumerate(per_rank[0]["runs"]):
        merged = dict(run)
        if run["ok"]:
            merged["peak_gb_per_rank"] = [r["runs"][i]["peak_gb"] for r in per_rank]
            merged["peak_gb"] = max(merged["peak_gb_per_rank"])
            merged["seconds"] = max(r["runs"][i]["seconds"] for r in per_rank)
            merged["first_seconds"] = max(r["runs"][i]["first_seconds"] for r in per_rank)
            merged["loss_per_rank"] = [r["runs"][i]["loss"] for r in per_rank]
            merged["phase_peaks_gb_per_rank"] = [r["runs"][i].get("phase_peaks_gb", {}) for r in per_rank]
        runs.append(merged)
    command = " ".join(["python", "benchmarks/context_parallel_bench.py", *sys.argv[1:]]).replace(
        str(args.out_dir), "benchmarks/results")
    result = {
        **provenance(command), "model": args.model, "ranks": args.ranks, "backend": per_rank[0]["backend"],
        "shared_gpu": per_rank[0]["shared_gpu"], "G": args.G, "R": args.R,
        "dtype": "bfloat16" if torch.cuda.is_available() else "float32", "prefix_chunk_size": args.chunk,
        "gpus": torch.cuda.device_count(), "transformers": transformers.__version__, "peak_unit": "1e+09 bytes",
        "parity_per_rank": [r.get("parity") for r in per_rank], "runs": runs,
    }
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    (out / f"{name}.md").write_text(table(result) + "\n")
    for path in ranks_dir.iterdir():
        path.unlink()
    ranks_dir.rmdir()
    print(table(result))
    print("parity:", result["parity_per_rank"])
    for run in runs:
        for rank, peaks in enumerate(run.get("phase_peaks_gb_per_rank", [])):
            print(f"{run['mode']} P={run['P']} over {run['ranks']}: rank {rank} peaks per phase (GB)",
                  {phase: round(gb, 2) for phase, gb in peaks.items()})
        for row in run.get("live_at_peak", {}).get("top", []):
            print(f"    {row['gb']:7.2f} GB  {row['where']}")


if __name__ == "__main__":
    main()
