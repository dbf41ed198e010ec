"""What a new prompt length costs LongStraw on the host: Dynamo's compiles and
the plan of every new length, for a slice built on the meta device.

A training loop brings new prompt and completion lengths at every step
(length_loop_bench.py measures the whole step on a GPU). This isolates the
host's part, which needs no GPU: the loss of TRL's layout (2 prompts x G
completions, left-padded prompts, right-padded completions, the mask passed
to the model) is compiled with `backend="longstraw"` and planned, not run
(`Backend.stop_after_planning`), for `--steps` draws of lengths (the
same draws as length_loop_bench's). Per call it records the wall time
(Dynamo's compile included where one happens), whether Dynamo compiled,
and the plan's seconds split into specialisation, analysis and memory
(`GroupPlan.seconds`), and how many full collections of Python's
garbage collector ran in it (each walks every object Dynamo left in the
process). The memory stage simulates nothing on the meta device, so its
share here is the planner's arithmetic alone.

    python benchmarks/planning_bench.py --model dense --steps 12 --out-dir $OUT --name planning_bench_dense_cpu

writes `<out-dir>/<name>.json` and `<name>.md`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch

from grpo.models import build_model
from grpo.results import provenance
from length_loop_bench import loop_lengths
from longstraw.backend import Backend, PlanningDone
from peers.batch import trl_micro_batch

KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")


def trl_loss(model, prompt_ids, prompt_mask, completion_ids, completion_mask, advantages):
    """TRL's GRPO loss at one policy step (ratio 1, no KL), per-token mean over the batch."""
    ids = torch.cat([prompt_ids, completion_ids], 1)
    mask = torch.cat([prompt_mask, completion_mask], 1)
    R = completion_ids.shape[1]
    logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=R + 1).logits[:, :-1].float()
    logp = logits.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
    weight = completion_mask.float()
    return -((torch.exp(logp - logp.detach()) * advantages[:, None]) * weight).sum() / weight.sum()


class FullCollections:
    """Counts the garbage collector's full (generation 2) collections and their seconds, while entered."""

    def __init__(self) -> None:
        self.count, self.seconds, self._start = 0, 0.0, 0.0

    def __enter__(self) -> FullCollections:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)

    def __call__(self, phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.count += 1
            self.seconds += time.perf_counter() - self._start


def plan_loop(args: argparse.Namespace) -> list[dict]:
    model = build_model(args.model, args.tiny, torch.bfloat16, torch.device("meta"))
    model.config.use_cache = False
    backend = Backend(prompt_grad=args.mode, plan_cache_size=args.steps + 1)
    backend.stop_after_planning = True
    compiled = torch.compile(trl_loss, backend=backend)
    calls = []
    with FullCollections() as collections:
        for lengths, R in loop_lengths(args.P, args.R, args.prompts, args.steps, args.seed):
            batch = trl_micro_batch(args.prompts, args.G, max(lengths), R, model.config.vocab_size, torch.device("cpu"),
                                    lengths=lengths)
            frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            count, spent = collections.count, collections.seconds
            start = time.perf_counter()
            try:
                compiled(model, *(batch[k].to("meta") for k in KEYS))
                raise RuntimeError("the loss ran instead of stopping after planning")
            except PlanningDone as done:
                seconds = done.plan.seconds
            calls.append({"prompt_lengths": lengths, "R": R, "wall_s": time.perf_counter() - start,
                          "dynamo_compiled": torch._dynamo.utils.counters["stats"]["unique_graphs"] > frames,
                          "plan_s": seconds.total, "specialize_s": seconds.specialize, "analysis_s": seconds.analysis,
                          "memory_s": seconds.memory, "full_collections": collections.count - count,
                          "full_collection_s": collections.seconds - spent})
            print(f"  P {lengths} R {R}: {calls[-1]['wall_s']:.2f} s, plan {seconds.total:.2f} s "
                  f"(specialize {seconds.specialize:.2f}, analysis {seconds.analysis:.2f}, "
                  f"memory {seconds.memory:.3f}), "
                  f"{calls[-1]['full_collections']} full collections"
                  f"{', Dynamo compiled' if calls[-1]['dynamo_compiled'] else ''}", flush=True)
    return calls


def table(result: dict) -> str:
    calls = result["calls"]
    planned = [c for c in calls if not c["dynamo_compiled"]]
    mean = sum(c["plan_s"] for c in planned) / max(len(planned), 1)
    wall = sum(c["wall_s"] for c in planned) / max(len(planned), 1)
    lines = ["| calls | Dynamo compiles | their wall s | plan s per new length (mean) | specialise | analysis | memory "
             "| wall s per new length (mean, max) | full collections in them (s) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    compiles = [c for c in calls if c["dynamo_compiled"]]
    part = {k: sum(c[k] for c in planned) / max(len(planned), 1) for k in ("specialize_s", "analysis_s", "memory_s")}
    lines.append(f"| {len(calls)} | {len(compiles)} | {sum(c['wall_s'] for c in compiles):.2f} | {mean:.2f} | "
                 f"{part['specialize_s']:.3f} | {part['analysis_s']:.3f} | {part['memory_s']:.3f} | "
                 f"{wall:.3f}, {max((c['wall_s'] for c in planned), default=0):.3f} | "
                 f"{sum(c['full_collections'] for c in planned)} "
                 f"({sum(c['full_collection_s'] for c in planned):.2f}) |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="dense", choices=("dense", "hybrid", "hybrid_moe", "nemotron_h"))
    parser.add_argument("--mode", default="exact", choices=("exact", "detached"))
    parser.add_argument("--P", type=int, default=16384, help="the longest prompt; lengths are drawn from [P/2, P]")
    parser.add_argument("--R", type=int, default=1024)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--G", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a quick run of the script)")
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--name", default="planning_bench")
    args = parser.parse_args()
    argv = ["python", "benchmarks/planning_bench.py",
            *["benchmarks/results" if a == args.out_dir else a for a in os.sys.argv[1:]]]
    result = {**provenance(" ".join(argv)), "model": args.model, "mode": args.mode, "P": args.P, "R": args.R,
              "prompts": args.prompts, "G": args.G, "calls": plan_loop(args)}
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, args.name)
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=2)
    with open(stem + ".md", "w") as f:
        f.write(table(result) + "\n")
    print(table(result))


if __name__ == "__main__":
    main()
