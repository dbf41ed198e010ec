"""One GRPO step, LongStraw against the eager baselines, on the same inputs.

Modes (same model, prompt, responses, advantages and loss in every one):

  eager                the concatenated [prompt; response_g] batch under
                       autograd, with `logits_to_keep` (what TRL/verl do)
  eager_ckpt           the same with HF gradient checkpointing
  eager_shared_prefix  the prompt once, the branches attend to it, one
                       autograd graph (the PrefixGrouper idea). Dense: the
                       packed sequence [prompt, r_1 .. r_G] under a flex
                       attention block mask, so nothing is copied G times.
                       Hybrid: the branches continue from the prompt's HF
                       cache, repeated G times (flex packing cannot express
                       recurrent layers).
  longstraw_detached   torch.compile(loss, backend=longstraw, prompt_grad="detached")
  longstraw_exact      the same with prompt_grad="exact"

Models: `dense` is the 4-layer slice with Qwen3-8B layer shapes, `hybrid`
3 Gated DeltaNet + 1 full attention layers at transformers' default
Qwen3_5TextConfig shapes, `glm5` transformers' glm_moe_dsa at
GlmMoeDsaConfig's default (GLM-5) layer shapes, one dense and three MoE
layers, 16 routed experts (8 chosen per token, one shared), grouped_mm
experts; bf16, random init. Eager hybrid modes run HF's PyTorch Gated
DeltaNet (fla's backward does not run on this Triton). GLM-5 has no
shared-prefix mode.

GLM-5 on one H200 takes three commands (each under the 10-minute limit;
the JSON is written after every run, so a command stopped at the limit
keeps what it measured). Its eager modes hold G x 32 float32 index-score
matrices of (P + R)^2 and stop at a few thousand positions, so their
sweeps start at 1024; `--p-speed-from eager_ckpt` then times every mode
at the largest P eager + checkpointing reached. LongStraw's indexer
scores every earlier key (O(P^2) work, as eager's), so its sweeps are
limited by time: from 16384 to at most 262144, exact first (each
mode gets the time left but a minute per later mode, and its first step
compiles); a later command extends a sweep stopped by time with `--start
MODE:P` (the report merges them). Parity runs at 2048
(the responses' queries already select 2048 of up to 3072 keys; float64
at GLM-5 shapes holds 38 GB of weights and as much of gradients):

    python benchmarks/grpo_bench.py --model glm5 --parts sweep,speed --sweep-modes eager,eager_ckpt \
        --modes eager_ckpt,longstraw_detached,longstraw_exact --start eager:1024,eager_ckpt:1024 \
        --bisect-resolution 1024 --p-max 16384 --p-speed-from eager_ckpt --budget-s 540 \
        --out-dir $OUT --name grpo_bench_glm5_a_h200
    python benchmarks/grpo_bench.py --model glm5 --parts sweep --sweep-modes longstraw_exact,longstraw_detached \
        --p-min 16384 --p-max 262144 --budget-s 540 --out-dir $OUT --name grpo_bench_glm5_b_h200
    python benchmarks/grpo_bench.py --model glm5 --parts parity,gdelta --p-parity 2048 --p-gdelta 16384 \
        --budget-s 540 --out-dir $OUT --name grpo_bench_glm5_c_h200

Parts (`--parts`), all in one process; every run is bounded by
`--budget-s` so a command stays inside the 10-minute device limit:

  sweep    per mode (--sweep-modes, in that order), P doubles from --p-min
           (or --start MODE:P) until it runs out of memory, would exceed
           the time left, or reaches --p-max; then bisection between the
           last success and the first failure. Every run's peak allocated
           memory and step time are recorded (plot: peak vs P).
  gdelta   peak(G=8) - peak(G=2) at --p-gdelta for the longstraw modes.
  speed    warm step time of every mode at --p-speed (and MFU); the
           report keeps the entries of every P measured.
  parity   longstraw exact against eager (checkpointed, same math) at
           --p-parity, float32 (relative L2) and bf16 (cosine); both
           float32 runs also against a float64 eager run.
  kernels  flash and cuDNN against the explicit-softmax kernel, and their
           forward speed at a capture chunk.
  capture  the compiled forward at --p-capture, flash and cuDNN attention.
  trace    what is live at the peak of a longstraw step (allocator trace).
  profile  where a longstraw step's time goes (torch.profiler), at --p-speed.

MFU counts model FLOPs the mode's algorithm needs, without recomputation
(GLM-5: MLA as the model defines it, the top-k keys DSA selects, the
indexer forward only; see grpo/flops.py):
2 per parameter-token in every linear (the LM head only on the kept
positions), 4*H*D per visible key per query in attention, 4*H*Dk*Dv per
token in Gated DeltaNet; backward is twice forward. At prompt positions the
last layer counts only what its state needs (its output feeds no kept logit). Eager modes process G
copies of the prompt, shared-prefix and exact one, detached one without
backward. Against 790 TFLOP/s (H200 dense bf16, see the device notes).

Each run writes `<out-dir>/grpo_bench_<model>.json`; `--report` turns result
files into the plot and `summary.json` (on a machine with matplotlib):

    python benchmarks/grpo_bench.py --model dense --out-dir $OUT
    python benchmarks/grpo_bench.py --report benchmarks/results/grpo_bench_*.json
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import transformers

from grpo.flops import PEAK_FLOPS, FlopModel
from grpo.measure import Clock, memory_floor, peak_breakdown, profile_step
from grpo.models import build_model
from grpo.modes import MODES_OF
from grpo.parity import kernels, parity
from grpo.results import print_table, provenance, report
from grpo.sweep import capture_mfu, gdelta, speed, sweep

FLOP_MODELS = ("dense", "hybrid", "glm5")
"""The slices `FlopModel` counts (MFU is recorded for them only; capture and gdelta need it)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=tuple(MODES_OF), default="dense")
    parser.add_argument("--parts", default="kernels,parity,speed,capture,gdelta,sweep")
    parser.add_argument("--modes", default=None, help="modes of speed (default: every mode the model has)")
    parser.add_argument("--sweep-modes", default=None, help="modes of the sweep (default: --modes)")
    parser.add_argument("--G", type=int, default=8)
    parser.add_argument("--R", type=int, default=1024)
    parser.add_argument("--p-min", type=int, default=8192)
    parser.add_argument("--start", default="", help="per-mode first P of the sweep, MODE:P,... (flex recompiles per P)")
    parser.add_argument("--p-max", type=int, default=1 << 20)
    parser.add_argument("--bisect-resolution", type=int, default=8192)
    parser.add_argument("--p-gdelta", type=int, default=262144)
    parser.add_argument("--p-speed", type=int, default=32768)
    parser.add_argument("--p-speed-from", default=None, metavar="MODE", help="time at the largest P of MODE's sweep instead")
    parser.add_argument("--p-capture", type=int, default=262144)
    parser.add_argument("--p-parity", type=int, default=8192)
    parser.add_argument("--p-trace", type=int, default=131072)
    parser.add_argument("--budget-s", type=float, default=520, help="wall-clock budget of the whole command")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke run of the script)")
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--name", default=None, help="result file stem (default grpo_bench_<model>)")
    parser.add_argument("--command", default=None, help="the command line to record (default: argv)")
    parser.add_argument("--report", nargs="+", metavar="RESULT_JSON", help="only write the plot and summary.json from these")
    args = parser.parse_args()
    args.start = {m: int(p) for m, p in (item.split(":") for item in args.start.split(",") if item)}
    if args.report:
        report(args.report, args.out_dir)
        return

    clock = Clock(args.budget_s)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    parts = args.parts.split(",")
    modes = [m for m in (args.modes or ",".join(MODES_OF[args.model])).split(",") if m]
    # from the repository's root, the output folder named where the repository keeps it, whatever folder it ran in
    argv = [f"benchmarks/{Path(os.sys.argv[0]).name}",
            *["benchmarks/results" if a == args.out_dir else a for a in os.sys.argv[1:]]]
    command = args.command or "python " + " ".join(argv)
    result = {**provenance(command), "model": args.model, "G": args.G, "R": args.R, "p_speed": args.p_speed,
              "dtype": "bfloat16", "transformers": transformers.__version__, "peak_tflops": PEAK_FLOPS / 1e12}
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, (args.name or f"grpo_bench_{args.model}") + ".json")

    def save():  # after every part: a command stopped at its limit keeps what it measured
        with open(path, "w") as f:
            json.dump(result, f, indent=2)

    model = flops = None
    for part in parts:
        if part == "kernels" and device.type == "cuda":
            result["kernels"] = kernels(device)
        elif part == "parity":
            result["parity"] = parity(args.model, args, device)
        else:
            if model is None:
                model = build_model(args.model, args.tiny, torch.bfloat16, device)
                flops = FlopModel.of(model) if args.model in FLOP_MODELS else None  # the others: no MFU
            if part == "trace" and device.type == "cuda":
                if clock.left() > 60:
                    result["trace"] = [peak_breakdown(model, args.model, m, args) for m in ("longstraw_detached", "longstraw_exact")]
            elif part == "profile" and device.type == "cuda":
                result["profile"] = [profile_step(model, args.model, m, args) for m in ("longstraw_detached", "longstraw_exact")]
            elif part == "speed":
                if args.p_speed_from:
                    found = result.get("sweep", {}).get(args.p_speed_from, {}).get("max_prompt_tokens")
                    if found is None:
                        print(f"  speed not run: no sweep of {args.p_speed_from} reached a P", flush=True)
                        continue
                    args.p_speed = result["p_speed"] = found
                result["speed"] = speed(model, args.model, modes, args, clock, flops)
            elif part == "capture":
                result["capture"] = capture_mfu(model, args.model, args, clock, flops)
            elif part == "gdelta":
                result["gdelta"] = gdelta(model, args.model, args, clock, result.get("sweep", {}))
            elif part == "sweep":
                sweep_modes = [m for m in args.sweep_modes.split(",") if m] if args.sweep_modes is not None else modes
                sweep(model, args.model, sweep_modes, args, clock, flops, result.setdefault("sweep", {}), save)
                if device.type == "cuda":
                    result["memory_floor"] = memory_floor(model, args.model, args, result["sweep"])
        save()
    print_table(args.model, result)


if __name__ == "__main__":
    main()
