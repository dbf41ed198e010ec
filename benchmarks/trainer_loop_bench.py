"""A real GRPO training loop, generation included: TRL's default against
LongStraw, per step split into generation, scoring and the loss.

Per P and mode: `GRPOTrainer.train()` (TRL with gradient checkpointing, its
default) or `LongStrawGRPOTrainer.train()` (exact) for `--steps` steps on
`--prompts` random prompts per step of about P tokens (words of a
word-level tokenizer over the model's vocabulary, lengths drawn from
[7P/8, P]), G generations each of up to R tokens (HF `generate`, as TRL
does without vLLM), a constant reward. Each step's time is split, with the
device synchronised at every boundary, into:

  generation  TRL's `_generate` (sampling the completions)
  scoring     the rest of `_generate_and_score_completions` (rewards, advantages)
  loss        `compute_loss` (the policy's log-probs and the loss: LongStraw's forward)
  backward    the rest of `training_step` (LongStraw's backward: replays, reverse pass)
  other       the rest of the step (optimizer, logging)

The first step (planning, compiling) is reported apart from the mean of
the others; the peak is the loop's allocated peak.

    python benchmarks/trainer_loop_bench.py --P 16384,65536 --out-dir $OUT --name trainer_loop_h200
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import transformers
import trl
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import TrainerCallback

from grpo.measure import Clock, recorded_failure, release, sync
from grpo.models import build_model
from grpo.results import provenance
from longstraw.integrations.trl import LongStrawGRPOTrainer

MODES = ("trl_ckpt", "longstraw_exact")
PARTS = ("generation", "scoring", "loss", "backward", "other")


def word_tokenizer(vocab: int) -> transformers.PreTrainedTokenizerFast:
    """Word `w{i}` is token i (0: padding, 1: end of sequence): a prompt of
    n words is n tokens, built without a download."""
    words = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, vocab)}}
    backend = Tokenizer(models.WordLevel(vocab=words, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")


def prompts(n: int, P: int, vocab: int, seed: int) -> list[str]:
    draw = random.Random(seed)
    return [" ".join(f"w{draw.randrange(2, vocab)}" for _ in range(draw.randint(7 * P // 8, P))) for _ in range(n)]


def constant_reward(completions: list[str], **kwargs: object) -> list[float]:
    return [1.0] * len(completions)


class StepClock(TrainerCallback):
    """Seconds per step and per part (see the module docstring), device-synchronised."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.current: dict[str, float] = {}
        self.start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        sync()
        self.current, self.start = dict.fromkeys(PARTS, 0.0), time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        sync()
        total = time.perf_counter() - self.start
        self.current["other"] = total - sum(self.current[p] for p in PARTS if p != "other")
        self.steps.append({"total": total, **self.current})

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            sync()
            self.current[name] += time.perf_counter() - start

    def timing(self, fn: Callable, name: str, less: tuple[str, ...] = ()) -> Callable:
        """`fn` timed into `name`, less the parts timed inside it (`less`)."""

        def timed(*args, **kwargs):
            inner = sum(self.current[p] for p in less)
            with self.part(name):
                out = fn(*args, **kwargs)
            self.current[name] -= sum(self.current[p] for p in less) - inner
            return out

        return timed


def run_mode(model, mode: str, P: int, args) -> dict:
    vocab = model.config.vocab_size
    out: dict = {"mode": mode, "P": P}
    rows = args.prompts * args.G
    clock = StepClock()
    with recorded_failure(out, model), tempfile.TemporaryDirectory() as folder:
        config = trl.GRPOConfig(output_dir=folder, per_device_train_batch_size=rows, num_generations=args.G,
                                max_completion_length=args.R, max_steps=args.steps, beta=0.0, bf16=False,
                                use_cpu=model.device.type == "cpu", gradient_checkpointing=mode == "trl_ckpt",
                                learning_rate=1e-7, logging_steps=1, report_to="none", save_strategy="no", seed=0,
                                temperature=1.0)
        dataset = Dataset.from_dict({"prompt": prompts(args.steps * args.prompts, P, vocab, P)})
        trainer_cls, extra = trl.GRPOTrainer, {}
        if mode.startswith("longstraw"):
            trainer_cls, extra = LongStrawGRPOTrainer, {"longstraw_options": {"prompt_grad": "exact"}}
        trainer = trainer_cls(model=model, reward_funcs=constant_reward, args=config, train_dataset=dataset,
                              processing_class=word_tokenizer(vocab), callbacks=[clock], **extra)
        trainer._generate = clock.timing(trainer._generate, "generation")
        trainer._generate_and_score_completions = clock.timing(trainer._generate_and_score_completions, "scoring",
                                                               less=("generation",))
        trainer.compute_loss = clock.timing(trainer.compute_loss, "loss")
        trainer.training_step = clock.timing(trainer.training_step, "backward", less=("generation", "scoring", "loss"))
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
        out["steps"] = clock.steps
        later = clock.steps[1:] or clock.steps
        out["first_step_s"] = clock.steps[0]["total"]
        out["mean_s"] = {k: sum(s[k] for s in later) / len(later) for k in ("total", *PARTS)}
        out["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else 0.0
        backend = getattr(trainer, "longstraw_backend", None)
        out["plans"] = 0 if backend is None else len(backend.plans)
        model.__dict__.pop("forward", None)  # TRL's fused LM head patches the instance's forward
        if mode == "trl_ckpt":
            model.gradient_checkpointing_disable()
    torch._dynamo.reset()
    return out


def table(result: dict) -> str:
    lines = ["| mode | P | first step s | step s | generation | scoring | loss | backward | other | peak GB |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for run in result["runs"]:
        if not run.get("ok"):
            lines.append(f"| {run['mode']} | {run['P']:,} | {'OOM' if run.get('oom') else 'failed'} | - | - | - | - | - | - | - |")
            continue
        mean = run["mean_s"]
        lines.append(f"| {run['mode']} | {run['P']:,} | {run['first_step_s']:.2f} | {mean['total']:.2f} | "
                     + " | ".join(f"{mean[p]:.2f}" for p in PARTS) + f" | {run['peak_gb']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--P", default="16384,65536", help="the longest prompt of each loop, comma-separated")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--G", type=int, default=4)
    parser.add_argument("--R", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--model", default="dense", choices=("dense", "hybrid"))
    parser.add_argument("--budget-s", type=float, default=540, help="wall-clock budget of the whole command")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke run of the script)")
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--name", default="trainer_loop_bench")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        raise SystemExit(f"unknown modes {sorted(unknown)}; choose from {MODES}")

    clock = Clock(args.budget_s)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(args.model, args.tiny, dtype, device)
    model.config.use_cache = True  # generation's
    argv = [f"benchmarks/{Path(os.sys.argv[0]).name}",
            *["benchmarks/results" if a == args.out_dir else a for a in os.sys.argv[1:]]]
    result = {"n_prompts": args.prompts, "G": args.G, "R": args.R, "steps": args.steps, "dtype": str(dtype),
              "model": args.model, "transformers": transformers.__version__, "trl": trl.__version__,
              **provenance("python " + " ".join(argv)), "runs": []}
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, args.name)
    for P in (int(p) for p in args.P.split(",")):
        for mode in modes:
            if clock.left() < 30:
                result["runs"].append({"mode": mode, "P": P, "ok": False, "error": "time budget"})
                continue
            run = run_mode(model, mode, P, args)
            release(model)
            result["runs"].append(run)
            print(table({"runs": [run]}).splitlines()[-1], flush=True)
            with open(stem + ".json", "w") as f:
                json.dump(result, f, indent=2)
    with open(stem + ".md", "w") as f:
        f.write(table(result) + "\n")
    print(table(result))


if __name__ == "__main__":
    main()
