"""Peers, side by side: one GRPO micro-batch through TRL, prefix-grouper and LongStraw.

The micro-batch is TRL's: 2 prompts x G = 8 completions, prompts left-padded
(the second is 1/8 shorter), completions right-padded to R = 1024, fed to
`GRPOTrainer.compute_loss` (see peers/modes.py for what each mode runs).
The model is grpo_bench's dense slice (4 layers at Qwen3-8B's shapes, bf16,
random init) or, with `--model hybrid`, its Qwen3.5 hybrid slice (three
Gated DeltaNet layers and one full attention layer; `hybrid_moe` the same
at Qwen3.5-MoE's shapes, `nemotron_h` Nemotron-H-8B's Mamba-2, MLP and
attention layers: grpo/models.py), where prefix-grouper
does not run: it packs a prompt's completions into one row, and a Gated
DeltaNet layer would run each completion from the one before it. Per mode, P (the longer prompt) doubles from --p-min until the
step runs out of memory, would exceed the time left, or reaches --p-max,
then bisects; every run's peak allocated memory and step time are recorded
(first calls: LongStraw's include planning and compiling). Then every mode's
warm step time at the P of `--p-speed` (default: the largest P that
trl_ckpt reached, so every mode runs there).

    python benchmarks/peers_bench.py --out-dir $OUT --name peers_bench_h200

writes `<out-dir>/<name>.json`, `<name>.png` (with matplotlib) and
`<name>.md` (the README's table).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import transformers
import trl

from grpo.measure import GiB, Clock, describe, measure
from grpo.models import RECURRENT_KINDS, build_model
from grpo.results import provenance
from grpo.sweep import sweep
from peers.batch import trl_micro_batch
from peers.modes import PEERS, PeerRunner
from peers.plot_axes import against_prompt_length


SLICES = {"dense": "dense 4-layer Qwen3-8B", "hybrid": "Qwen3.5 hybrid 4-layer", "hybrid_moe": "Qwen3.5-MoE 4-layer",
          "nemotron_h": "Nemotron-H-8B 4-layer"}


def table(result: dict) -> str:
    sweep_out, speed = result.get("sweep", {}), result.get("speed", {})
    p_speed = result.get("p_speed")
    lines = [f"| mode | largest P | first P out of memory | peak GB at P={p_speed} | warm step s at P={p_speed} |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for mode in PEERS:
        data, timed = sweep_out.get(mode), speed.get(mode, {})
        if data is None:
            continue
        largest = f"{data['max_prompt_tokens']:,}" if data["max_prompt_tokens"] else "-"
        first_bad = f"{data['first_failure']:,}" if data["first_failure"] else f"(stopped by {data['limited_by']})"
        peak = f"{timed['peak_gb']:.1f}" if timed.get("ok") else "-"
        seconds = f"{timed['seconds']:.2f}" if timed.get("ok") else "-"
        lines.append(f"| {mode} | {largest} | {first_bad} | {peak} | {seconds} |")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (memory, time) = plt.subplots(1, 2, figsize=(14, 5))
    for i, mode in enumerate(PEERS):
        ok = sorted((r for r in result.get("sweep", {}).get(mode, {}).get("runs", []) if r["ok"]), key=lambda r: r["P"])
        if ok:
            memory.plot([r["P"] for r in ok], [r["peak_gb"] for r in ok], marker="o", label=mode, color=f"C{i}")
            time.plot([r["P"] for r in ok], [r["seconds"] for r in ok], marker="o", label=mode, color=f"C{i}")
    memory.axhline(141, color="gray", linestyle=":", label="H200 (141 GB)")
    against_prompt_length(((memory, "peak allocated GB"), (time, "step seconds (first call at each P)")))
    slice_ = SLICES[result["model"]]
    fig.suptitle(f"one TRL GRPO micro-batch: {result['n_prompts']} prompts x G={result['G']}, R={result['R']}, "
                 f"{slice_} slice, bf16")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="dense", choices=("dense", "hybrid", "hybrid_moe", "nemotron_h"))
    parser.add_argument("--modes", default=",".join(PEERS))
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--G", type=int, default=8)
    parser.add_argument("--R", type=int, default=1024)
    parser.add_argument("--p-min", type=int, default=8192)
    parser.add_argument("--p-max", type=int, default=1 << 19)
    parser.add_argument("--start", default="", help="per-mode first P of the sweep, MODE:P,...")
    parser.add_argument("--bisect-resolution", type=int, default=8192)
    parser.add_argument("--p-speed", type=int, default=None, help="P of the warm timing (default: trl_ckpt's largest)")
    parser.add_argument("--budget-s", type=float, default=540, help="wall-clock budget of the whole command")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke run of the script)")
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--name", default="peers_bench")
    args = parser.parse_args()
    args.start = {m: int(p) for m, p in (item.split(":") for item in args.start.split(",") if item)}
    modes = [m for m in args.modes.split(",") if m]
    skipped = {}
    if args.model in RECURRENT_KINDS and "prefix_grouper" in modes:
        modes.remove("prefix_grouper")
        skipped["prefix_grouper"] = ("not exact on a hybrid: its packed row runs each completion's Gated DeltaNet "
                                     "layers from the state the completion before it left")
    clock = Clock(args.budget_s)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(args.model, args.tiny, torch.bfloat16, device)
    model.config.use_cache = False
    rows, vocab = args.prompts * args.G, model.config.vocab_size
    argv = [f"benchmarks/{Path(os.sys.argv[0]).name}",
            *["benchmarks/results" if a == args.out_dir else a for a in os.sys.argv[1:]]]
    result = {"n_prompts": args.prompts, "G": args.G, "R": args.R, "dtype": "bfloat16", "model": args.model,
              "skipped": skipped,
              "transformers": transformers.__version__, "trl": trl.__version__,
              **provenance("python " + " ".join(argv))}
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, args.name)

    def save() -> None:
        with open(stem + ".json", "w") as f:
            json.dump(result, f, indent=2)

    def runner_of(mode: str) -> PeerRunner:
        return PeerRunner(model, mode, rows, args.G, args.R)

    def inputs_of(P: int) -> dict[str, torch.Tensor]:
        return trl_micro_batch(args.prompts, args.G, P, args.R, vocab, device)

    sweep(model, args.model, modes, args, clock, None, result.setdefault("sweep", {}), save, runner_of, inputs_of)
    p_speed = args.p_speed or result["sweep"].get("trl_ckpt", {}).get("max_prompt_tokens")
    if p_speed:
        result["p_speed"], result["speed"] = p_speed, {}
        for mode in modes:
            if clock.left() < 30:
                result["speed"][mode] = {"skipped": "time budget"}
                continue
            with runner_of(mode) as runner:
                timed = measure(runner, inputs_of(p_speed), repeats=2, warmup=True)
            timed["P"] = p_speed
            result["speed"][mode] = timed
            print(f"  {mode:20} P={p_speed:>8} warm {describe(timed)}", flush=True)
            save()
    result["peak_unit"] = f"{GiB:.0e} bytes"
    save()
    with open(stem + ".md", "w") as f:
        f.write(table(result) + "\n")
    try:
        plot(result, stem + ".png")
    except ImportError:
        print("  no plot: matplotlib is not installed", flush=True)
    print(table(result))


if __name__ == "__main__":
    main()
