"""verl's actor update, its own engine against LongStraw's, on one GPU.

One update (`train_batch`: the micro-batches' forwards and backwards and
the optimizer step) of verl 0.9.1's FSDP2 actor engine with verl's own
model path (its gradient checkpointing on, verl's default; remove-padding
with flash-attention 2 where it is installed, else the padded batch with
SDPA) and with `LongStrawActorEngine` in exact and detached mode, on
grpo_bench's dense slice (4 layers at Qwen3-8B's shapes) or its Qwen3.5
hybrid slice, random weights saved where verl loads them from. The batch is
2 prompts x G = 8 responses (the second prompt 1/8 shorter), responses of
R tokens, GRPO's `ppo_loss` (KL to a reference), one micro-batch per
prompt group, verl's default mixed precision (float32 weights, bf16
autocast). Per mode, P doubles from --p-min until the update runs out of
memory, would exceed the time left, or reaches --p-max; the first update
at each P (LongStraw's includes compiling and planning) and a second one
are timed, with the peak allocated memory.

    python benchmarks/verl_bench.py --model dense --out-dir $OUT --name verl_bench_dense_h200

writes `<out-dir>/<name>.json` and `<name>.md`. Needs verl installed as
docs/verl.md says.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from verl_stand_ins import stand_in_for_ray

stand_in_for_ray()  # before verl imports it

from tensordict import TensorDict  # noqa: E402
from verl.models.transformers import monkey_patch  # noqa: E402
from verl.trainer.config import CheckpointConfig  # noqa: E402
from verl.workers.config import FSDPActorConfig, FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig  # noqa: E402
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

from grpo.measure import GiB, is_oom, release  # noqa: E402
from grpo.models import build_model  # noqa: E402
from grpo.results import provenance  # noqa: E402
from longstraw.integrations.verl import longstraw_engine, recorded_batch  # noqa: E402
from longstraw.integrations.verl_cpu import use_cpu_platform  # noqa: E402

MODES = ("verl", "longstraw_exact", "longstraw_detached")


def start(device: torch.device) -> None:
    """A one-rank process group (NCCL on a GPU; gloo and verl's CPU platform otherwise)."""
    monkey_patch.is_trl_available = lambda: False  # verl 0.9.1 patches a class trl >= 1.16 no longer has
    if device.type == "cpu":
        use_cpu_platform()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)


def engine_for(mode: str, model_path: str, tiny: bool):
    """The engine `mode` names, built as verl's worker builds it."""
    ours = mode != "verl"
    flash = importlib.util.find_spec("flash_attn") is not None
    attention = "flash_attention_2" if flash and not ours else "sdpa"
    model = HFModelConfig(path=model_path, load_tokenizer=False, override_config={"attn_implementation": attention},
                          use_remove_padding=ours or flash, enable_gradient_checkpointing=not ours)
    precision = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"} if tiny else None
    engine_class = (longstraw_engine({"prompt_grad": mode.removeprefix("longstraw_")}) if ours
                    else FSDPEngineWithLMHead)
    engine = engine_class(model, FSDPEngineConfig(strategy="fsdp2", mixed_precision=precision, use_torch_compile=False),
                          FSDPOptimizerConfig(lr=1e-6, clip_grad=1.0), CheckpointConfig())
    engine.initialize()
    return engine


def rollout_batch(P: int, G: int, R: int, vocab: int, remove_padding: bool, seed: int = 0) -> TensorDict:
    """2 prompts x G responses, prompts left-padded to P (the second 1/8
    shorter), responses of R - g tokens, in verl's no-padding layout."""
    g = torch.Generator().manual_seed(seed)
    rows = 2 * G
    ids = torch.randint(1, vocab, (rows, P + R), generator=g)
    positions = torch.arange(P + R)
    prompt_lengths = torch.tensor([P, P - P // 8]).repeat_interleave(G)  # [rows]
    response_lengths = R - torch.arange(rows) % G  # [rows]
    mask = ((positions >= P - prompt_lengths[:, None]) & (positions < P + response_lengths[:, None])).long()
    ids[:G, :P] = ids[0, :P]
    ids[G:, :P] = ids[G, :P]
    ids = ids * mask
    return recorded_batch(ids, mask, P, torch.randn(rows, generator=g), old_log_probs=-torch.rand(rows, R, generator=g),
                          ref_log_prob=-torch.rand(rows, R, generator=g), temperature=1.0, calculate_entropy=False,
                          global_batch_size=rows, use_remove_padding=remove_padding, use_dynamic_bsz=False,
                          micro_batch_size_per_gpu=G, max_token_len_per_gpu=0, use_fused_kernels=False)


def timed_update(engine, batch: TensorDict, loss) -> tuple[float, float | None]:
    """Seconds and peak allocated GB (None on the CPU) of one `train_batch`."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    begin = time.perf_counter()
    with engine.train_mode():
        engine.train_batch(batch, loss_function=loss)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / GiB if torch.cuda.is_available() else None
    return time.perf_counter() - begin, peak


def sweep_mode(mode: str, args, model_path: str, vocab: int, deadline: float,
               save: Callable[[dict], None]) -> None:
    """One mode's P sweep: first and second update at each P, until OOM, --p-max or the deadline;
    `save(sweep so far)` after each P, so that a command killed mid-sweep keeps what it measured."""
    engine = engine_for(mode, model_path, args.tiny)
    loss = functools.partial(ppo_loss, FSDPActorConfig(strategy="fsdp2", rollout_n=args.G, use_kl_loss=True,
                                                       ppo_micro_batch_size_per_gpu=args.G))
    out: dict = {"runs": [], "max_prompt_tokens": None, "limited_by": "p_max"}
    remove_padding = engine.use_remove_padding
    P = args.p_min
    while P <= args.p_max:
        # The next P's two updates, each taken as twice the last warm one (the
        # first update's compile is paid once, so it says nothing about them).
        if time.monotonic() + 2 * 2 * (out["runs"][-1]["warm_s"] if out["runs"] else 0) > deadline:
            out["limited_by"] = "time budget"
            break
        run: dict = {"P": P}
        try:
            batch = lambda: rollout_batch(P, args.G, args.R, vocab, remove_padding)  # noqa: E731
            run["first_s"], run["first_peak_gb"] = timed_update(engine, batch(), loss)
            run["warm_s"], run["peak_gb"] = timed_update(engine, batch(), loss)
            run["ok"] = True
            out["max_prompt_tokens"] = P
        except Exception as error:  # noqa: BLE001 - a failing P ends this mode's sweep; the others still run
            run.update(ok=False, oom=is_oom(error), error=f"{type(error).__name__}: {str(error)[:300]}")
            out["limited_by"] = "out of memory" if run["oom"] else "error"
        finally:
            release(engine.module)
        out["runs"].append(run)
        save(out)
        print(f"  {mode:20} P={P:>8} " + (f"first {run['first_s']:.2f} s, warm {run['warm_s']:.2f} s, "
                                           f"peak {gb(run['peak_gb'])} GB" if run["ok"] else run["error"]), flush=True)
        if not run["ok"]:
            break
        P *= 2
    del engine
    release()
    save(out)


def gb(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def table(result: dict) -> str:
    lines = [f"verl actor update, {result['model']} slice, 2 prompts x G = {result['G']}, R = {result['R']}",
             "", "| mode | P | first update (s) | warm update (s) | peak (GB) |", "|---|---|---|---|---|"]
    for mode, data in result["sweep"].items():
        for run in data["runs"]:
            if run["ok"]:
                lines.append(f"| {mode} | {run['P']} | {run['first_s']:.2f} | {run['warm_s']:.2f} | "
                             f"{gb(run['peak_gb'])} |")
            else:
                lines.append(f"| {mode} | {run['P']} | {'OOM' if run['oom'] else 'error'} | | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="dense", choices=("dense", "hybrid"))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--G", type=int, default=8)
    parser.add_argument("--R", type=int, default=1024)
    parser.add_argument("--p-min", type=int, default=8192)
    parser.add_argument("--p-max", type=int, default=1 << 19)
    parser.add_argument("--budget-s", type=float, default=540, help="wall-clock budget of the whole command")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes, float32 (a CPU smoke run of the script)")
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--name", default="verl_bench")
    args = parser.parse_args()
    deadline = time.monotonic() + args.budget_s
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    start(device)
    model = build_model(args.model, args.tiny, torch.float32, torch.device("cpu"))
    model_path = tempfile.mkdtemp()
    model.save_pretrained(model_path)
    vocab = model.config.vocab_size
    del model
    argv = [f"benchmarks/{Path(sys.argv[0]).name}",
            *["benchmarks/results" if a == args.out_dir else a for a in sys.argv[1:]]]
    result = {"model": args.model, "G": args.G, "R": args.R, "flash_attn": importlib.util.find_spec("flash_attn")
              is not None, **provenance("python " + " ".join(argv)), "sweep": {}}
    modes = [m for m in args.modes.split(",") if m]
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, args.name)

    def save(mode: str, sweep: dict) -> None:
        result["sweep"][mode] = sweep
        with open(stem + ".json", "w") as f:
            json.dump(result, f, indent=2)

    for index, mode in enumerate(modes):
        share = (deadline - time.monotonic()) / (len(modes) - index)  # the time left, split over the modes left
        sweep_mode(mode, args, model_path, vocab, time.monotonic() + share, functools.partial(save, mode))
    with open(stem + ".md", "w") as f:
        f.write(table(result) + "\n")
    print(table(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
