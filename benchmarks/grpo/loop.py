"""What the loop benchmarks share (length_loop_bench, trainer_loop_bench):
their common arguments, the model, and the result file's header."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import transformers
import trl

from .measure import Clock
from .models import build_model
from .results import provenance


def add_loop_arguments(parser: argparse.ArgumentParser, *, modes: Sequence[str], P: str, G: int, R: int, steps: int,
                       name: str) -> None:
    parser.add_argument("--modes", default=",".join(modes))
    parser.add_argument("--P", default=P, help="the longest prompt of each loop, comma-separated")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--G", type=int, default=G)
    parser.add_argument("--R", type=int, default=R)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--model", default="dense", choices=("dense", "hybrid"))
    parser.add_argument("--budget-s", type=float, default=540, help="wall-clock budget of the whole command")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke run of the script)")
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--name", default=name)


def loop_start(args: argparse.Namespace, known: Sequence[str], use_cache: bool,
               build: bool = True) -> tuple[transformers.PreTrainedModel | None, list[str], dict, str]:
    """The model (bf16 on CUDA, float32 elsewhere; None unless `build`), the
    modes asked for (refused unless `known`), the result's header and the
    output stem."""
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(known)
    if unknown:
        raise SystemExit(f"unknown modes {sorted(unknown)}; choose from {tuple(known)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(args.model, args.tiny, dtype, device) if build else None
    if model is not None:
        model.config.use_cache = use_cache
    argv = [f"benchmarks/{Path(os.sys.argv[0]).name}",
            *["benchmarks/results" if a == args.out_dir else a for a in os.sys.argv[1:]]]
    result = {"n_prompts": args.prompts, "G": args.G, "R": args.R, "steps": args.steps, "dtype": str(dtype),
              "model": args.model, "transformers": transformers.__version__, "trl": trl.__version__,
              **provenance("python " + " ".join(argv)), "runs": []}
    os.makedirs(args.out_dir, exist_ok=True)
    return model, modes, result, os.path.join(args.out_dir, args.name)


def run_loops(args: argparse.Namespace, modes: Sequence[str], result: dict, stem: str, clock: Clock,
              run: Callable[[int, str], dict], table: Callable[[dict], str]) -> None:
    """`run(P, mode)` for each P and mode while the budget lasts, the result
    saved after every run (`<stem>.json`), each run's table row printed;
    then the whole table (`<stem>.md`)."""
    for P in (int(p) for p in args.P.split(",")):
        for mode in modes:
            if clock.left() < 30:
                result["runs"].append({"mode": mode, "P": P, "ok": False, "error": "time budget"})
                continue
            out = run(P, mode)
            result["runs"].append(out)
            print(table({"runs": [out]}).splitlines()[-1], flush=True)
            with open(stem + ".json", "w") as f:
                json.dump(result, f, indent=2)
    with open(stem + ".md", "w") as f:
        f.write(table(result) + "\n")
    print(table(result))


def isolated_run(script: str, P: int, mode: str, clock: Clock, model: str | None = None) -> tuple[dict, str]:
    """One P and one mode of `script` in a process of its own (the script
    again with `--in-process`, its other arguments as given), so what one
    run leaves on the device (an out-of-memory peer's tensors, cuDNN's
    plans) does not reach the next run's planner: the run's record and the
    text it wrote beside it (`<name>.txt`, "" where none)."""
    with tempfile.TemporaryDirectory() as scratch:
        # the same arguments, the run's own given after them (argparse keeps an option's last value)
        command = [sys.executable, os.path.abspath(script), *sys.argv[1:], "--in-process", "--P", str(P),
                   "--modes", mode, "--out-dir", scratch, "--name", "one", "--budget-s", str(int(clock.left()))]
        if model is not None:
            command += ["--model", model]
        done = subprocess.run(command, timeout=clock.left() + 30, env=os.environ.copy())
        path = os.path.join(scratch, "one.json")
        if done.returncode != 0 or not os.path.exists(path):
            return {"mode": mode, "P": P, "ok": False, "error": f"the run's process exited with {done.returncode}"}, ""
        with open(path) as f:
            run = json.load(f)["runs"][0]
        text = os.path.join(scratch, "one.txt")
        return run, (Path(text).read_text() if os.path.exists(text) else "")
