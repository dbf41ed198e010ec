"""A real GRPO training loop, generation included: TRL's default against
LongStraw, per step split into generation, scoring and the loss.

Per P and mode: `GRPOTrainer.train()` (TRL with gradient checkpointing, its
default) or `LongStrawGRPOTrainer.train()` (exact; `longstraw_exact_unshared`:
with `share_prefill=False`, HF's generate prefilling every row) for `--steps` steps on
`--prompts` random prompts per step of about P tokens (words of a
word-level tokenizer over the model's vocabulary; one length per step,
drawn from [7P/8, P], the dataset in order), G generations each of up to
R tokens (HF `generate`, as TRL does without vLLM), a constant reward.
A step's prompts share their length: HF's SDPA path builds an explicit
`[B, 1, P, P]` mask for a left-padded batch, 61 GiB at 8 rows of 64K,
where both trainers' generation ran out of memory on an 80 GB card. Each step's time is split, with the
device synchronised at every boundary, into:

  generation  TRL's `_generate` (sampling the completions)
  scoring     the rest of `_generate_and_score_completions` (rewards, advantages)
  loss        `compute_loss` (the policy's log-probs and the loss: LongStraw's forward)
  backward    the rest of `training_step` (LongStraw's backward: replays, reverse pass)
  other       the rest of the step (optimizer, logging)

The first step (planning, compiling) is reported apart from the mean of
the others; the peak is the loop's allocated peak. One untimed generation
at each P's shapes runs before its first mode (`warm_generation`).

    python benchmarks/trainer_loop_bench.py --P 16384,65536 --out-dir $OUT --name trainer_loop_h200
"""

from __future__ import annotations

import argparse
import contextlib
import random
import tempfile
import time
from collections.abc import Callable, Iterator

import torch
import transformers
import trl
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import TrainerCallback

from grpo.loop import add_loop_arguments, loop_start, run_loops
from grpo.measure import Clock, recorded_failure, sync, synced
from longstraw.integrations.trl import LongStrawGRPOTrainer
from peers.gated_delta import hopper_safe_gated_delta

MODES = ("trl_ckpt", "longstraw_exact", "longstraw_exact_unshared")
DEFAULT_MODES = MODES[:2]
PARTS = ("generation", "scoring", "loss", "backward", "other")


def word_tokenizer(vocab: int) -> transformers.PreTrainedTokenizerFast:
    """Word `w{i}` is token i (0: padding, 1: end of sequence): a prompt of
    n words is n tokens, built without a download."""
    words = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, vocab)}}
    backend = Tokenizer(models.WordLevel(vocab=words, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")


def prompts(steps: int, per_step: int, P: int, vocab: int, seed: int) -> list[str]:
    """`per_step` prompts of one length for each of `steps` steps, in the order the steps read them."""
    draw = random.Random(seed)
    out = []
    for _ in range(steps):
        length = draw.randint(7 * P // 8, P)
        out += [" ".join(f"w{draw.randrange(2, vocab)}" for _ in range(length)) for _ in range(per_step)]
    return out


def constant_reward(completions: list[str], **kwargs: object) -> list[float]:
    return [1.0] * len(completions)


class StepClock(TrainerCallback):
    """Seconds per step and per part (see the module docstring), device-synchronised."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.current: dict[str, float] = {}
        self.start = 0.0
        self.failed_in: str | None = None  # the innermost part an exception left, if one did

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
        try:
            with synced(lambda seconds: self.current.__setitem__(name, self.current[name] + seconds)):
                yield
        except BaseException:
            self.failed_in = self.failed_in or name
            raise

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
    # TRL's modes: a hybrid's Gated DeltaNet on fla's kernels where they run (`peers.gated_delta`)
    hf_layers = hopper_safe_gated_delta() if mode.startswith("trl") else contextlib.nullcontext()
    with recorded_failure(out, model), tempfile.TemporaryDirectory() as folder, hf_layers:
        config = trl.GRPOConfig(output_dir=folder, per_device_train_batch_size=rows, num_generations=args.G,
                                max_completion_length=args.R, max_steps=args.steps, beta=0.0, bf16=False,
                                use_cpu=model.device.type == "cpu", gradient_checkpointing=mode == "trl_ckpt",
                                learning_rate=1e-7, logging_steps=1, report_to="none", save_strategy="no", seed=0,
                                temperature=1.0, shuffle_dataset=False)
        dataset = Dataset.from_dict({"prompt": prompts(args.steps, args.prompts, P, vocab, P)})
        trainer_cls, extra = trl.GRPOTrainer, {}
        if mode.startswith("longstraw"):
            trainer_cls, extra = LongStrawGRPOTrainer, {"longstraw_options": {"prompt_grad": "exact"},
                                                        "share_prefill": mode != "longstraw_exact_unshared"}
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
    if not out.get("ok"):  # where it stopped: the part (generation, loss, ...) and the steps finished before
        out.update(failed_in=clock.failed_in, steps_done=len(clock.steps), steps=clock.steps)
    torch._dynamo.reset()
    return out


def warm_generation(model, P: int, args) -> float | str:
    """Seconds of one untimed `generate` at the loop's shapes (rows of P
    random tokens, R new ones), before the first mode at P: in one process
    the first mode generated about 4x slower for 3-4 steps with expandable
    segments on (`trainer_loop_shared_h100`, `trainer_loop_shared_b_h100`),
    whichever mode it was. Cached device memory is kept for the modes;
    "OOM" where the warm-up itself ran out of it."""
    rows = args.prompts * args.G
    ids = torch.randint(2, model.config.vocab_size, (rows, P), device=model.device)
    sync()
    start = time.perf_counter()
    try:
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.R,
                           min_new_tokens=args.R, do_sample=True, pad_token_id=0)
    except torch.OutOfMemoryError:
        return "OOM"
    sync()
    return time.perf_counter() - start


def table(result: dict) -> str:
    lines = ["| mode | P | first step s | step s | generation | scoring | loss | backward | other | peak GB |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for run in result["runs"]:
        if not run.get("ok"):
            where = f" in {run['failed_in']} of step {run['steps_done'] + 1}" if run.get("failed_in") else ""
            lines.append(f"| {run['mode']} | {run['P']:,} | {'OOM' if run.get('oom') else 'failed'}{where} | - | - | - | - | - "
                         f"| - | - |")
            continue
        mean = run["mean_s"]
        lines.append(f"| {run['mode']} | {run['P']:,} | {run['first_step_s']:.2f} | {mean['total']:.2f} | "
                     + " | ".join(f"{mean[p]:.2f}" for p in PARTS) + f" | {run['peak_gb']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_loop_arguments(parser, modes=DEFAULT_MODES, P="16384,65536", G=4, R=256, steps=4, name="trainer_loop_bench")
    args = parser.parse_args()
    clock = Clock(args.budget_s)
    model, modes, result, stem = loop_start(args, MODES, use_cache=True)
    result["warm_generation_s"] = {}

    def run(P: int, mode: str) -> dict:
        if P not in result["warm_generation_s"]:
            result["warm_generation_s"][P] = warm_generation(model, P, args)
        return run_mode(model, mode, P, args)

    run_loops(args, modes, result, stem, clock, run, table)

if __name__ == "__main__":
    main()
