"""A training loop whose prompt and completion lengths change every step.

Real GRPO loops bring new lengths at every generation: TRL left-pads each
micro-batch's prompts to its longest and right-pads its completions to its
longest. Per P and mode this runs, on the same model and TRL's layout
(peers/batch.py: 2 prompts x G completions):

- the warm step at a fixed length (P and P - P/8, completions up to R),
  after one untimed call;
- a loop of `--steps` steps, each with prompts of lengths drawn from
  [P/2, P] and completions from [R/2, R] (the same draws for every mode),
  timed step by step from the first (what a loop pays, planning included);

and reports the loop's mean step against the warm step, Dynamo's graphs
and LongStraw's plans (with the time planning took, `GroupPlan.seconds`),
and how many of the loop's fused attention calls the cuDNN gate ran on
cuDNN and how many on flash (`CudnnShapes.calls`).
Modes are peers_bench's (peers/modes.py): `compute_loss` of TRL's trainer.
Each (P, mode) runs in a process of its own: cuDNN keeps the attention
plans it builds for the whole process, so a mode run after another at the
same lengths would find them built (`--in-process` runs them all in one).

    python benchmarks/length_loop_bench.py --P 8192,32768,131072 --out-dir $OUT --name length_loop_h200

writes `<out-dir>/<name>.json` and `<name>.md` (the README's table).
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from grpo.loop import add_loop_arguments, isolated_run, loop_start, run_loops
from grpo.measure import Clock, plans_made, recorded_failure, release, timed_step
from peers.batch import trl_micro_batch
from peers.modes import PEERS, PeerRunner

LOOP_MODES = ("longstraw_exact", "longstraw_detached", "prefix_grouper", "trl_ckpt")


def loop_lengths(P: int, R: int, prompts: int, steps: int, seed: int) -> list[tuple[list[int], int]]:
    """Per step: the prompts' lengths in [P/2, P] and the completions' padded length in [R/2, R]."""
    draw = random.Random(seed)
    return [([draw.randint(P // 2, P) for _ in range(prompts)], draw.randint(R // 2, R)) for _ in range(steps)]


def run_mode(model, mode: str, P: int, args, vocab: int, device: torch.device) -> dict:
    """The warm fixed-length step, then the loop, of one mode at one P."""
    rows = args.prompts * args.G
    out: dict = {"mode": mode, "P": P, "options": args.options}
    # every plan of the loop kept, to count them (default: the last few)
    options = {**args.options, "plan_cache_size": args.steps + 1}
    with recorded_failure(out, model), PeerRunner(model, mode, rows, args.G, args.R, options) as runner:
        fixed = trl_micro_batch(args.prompts, args.G, P, args.R, vocab, device)
        runner.step(fixed)
        release(model)
        out["warm_s"] = min(timed_step(runner, fixed) for _ in range(2))
        release(model)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        torch._dynamo.utils.counters.clear()
        backend = getattr(runner.trainer, "longstraw_backend", None)
        calls = None if backend is None else backend.options.kernels.cudnn_shapes.calls
        calls_before = None if calls is None else dict(calls)
        seconds = []
        with plans_made(runner) as planned:
            for lengths, R in loop_lengths(P, args.R, args.prompts, args.steps, args.seed):
                batch = trl_micro_batch(args.prompts, args.G, P, R, vocab, device, lengths=lengths)
                seconds.append(timed_step(runner, batch))
                release(model)
        out["loop_s"] = seconds
        out["loop_mean_s"] = sum(seconds) / len(seconds)
        out["loop_over_warm"] = out["loop_mean_s"] / out["warm_s"]
        out["dynamo_graphs"] = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])  # traced in the loop
        out["plans"] = len(planned)
        out["plan_s"] = sum(p.seconds.total for p in planned)
        out["plan_split_s"] = {part: sum(getattr(p.seconds, part) for p in planned)
                               for part in ("specialize", "analysis", "memory")}
        out["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else 0.0
        if calls is not None:  # fused attention calls of the loop under the cuDNN gate, by the kernel that ran
            out["gated_attention_calls"] = {k: calls[k] - calls_before[k] for k in calls}
    return out


def table(result: dict) -> str:
    lines = ["| mode | P | warm step s | loop mean s | loop / warm | Dynamo compiles in the loop | plans | planning s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for run in result["runs"]:
        if not run.get("ok"):
            lines.append(f"| {run['mode']} | {run['P']:,} | {'OOM' if run.get('oom') else 'failed'} | - | - | - | - | - |")
            continue
        lines.append(f"| {run['mode']} | {run['P']:,} | {run['warm_s']:.2f} | {run['loop_mean_s']:.2f} | "
                     f"{run['loop_over_warm']:.2f} | {run['dynamo_graphs']} | {run['plans']} | {run['plan_s']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_loop_arguments(parser, modes=LOOP_MODES, P="8192,32768,131072", G=8, R=1024, steps=20, name="length_loop_bench")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--options", type=json.loads, default={},
                        help='LongStraw options (JSON) besides prompt_grad, e.g. \'{"kernels": {"attention": "flash"}}\'')
    parser.add_argument("--in-process", action="store_true",
                        help="run every P and mode in this process (cuDNN's plans carry from one to the next)")
    args = parser.parse_args()
    clock = Clock(args.budget_s)
    model, modes, result, stem = loop_start(args, PEERS, use_cache=False, build=args.in_process)
    result["isolated"] = not args.in_process
    if args.in_process:
        run = lambda P, mode: run_mode(model, mode, P, args, model.config.vocab_size, model.device)  # noqa: E731
    else:
        run = lambda P, mode: isolated_run(__file__, P, mode, clock)[0]  # noqa: E731
    run_loops(args, modes, result, stem, clock, run, table)


if __name__ == "__main__":
    main()
