"""`longstraw` on the command line.

    longstraw explain examples/grpo_step.py:example_group --P 1048576 --G 8 --R 2048 --budget-gb 141
    longstraw explain examples/grpo_step.py:example_group --P 2097152 --ranks 2 --budget-gb 141

`TARGET` is `path/to/script.py:FUNC` or `package.module:FUNC`; `FUNC()`
returns `(loss_fn, args)` or `(loss_fn, args, kwargs)` with small example
inputs (the plan scales to --P). Prints the captured state and the memory
plan, and writes the HTML (and DOT) views.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import pathlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

from longstraw.errors import LongStrawError


def load_target(target: str) -> Callable[[], Any]:
    where, sep, name = target.rpartition(":")
    if not sep or not where or not name:
        raise LongStrawError(f"target must be SCRIPT.py:FUNC or MODULE:FUNC, got {target!r}")
    if where.endswith(".py") or pathlib.Path(where).is_file():
        path = pathlib.Path(where).resolve()
        spec = importlib.util.spec_from_file_location(path.stem, path)
        if spec is None or spec.loader is None:
            raise LongStrawError(f"cannot load {path}")
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(path.parent))  # the script's own imports
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise LongStrawError(f"{where} has no function {name!r}")
    return fn


def explain_command(args: argparse.Namespace) -> int:
    from longstraw.planning.report import explain

    made = load_target(args.target)()
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise LongStrawError(f"{args.target} must return (loss_fn, args) or (loss_fn, args, kwargs)")
    loss_fn, example_args, example_kwargs = (*made, {})[:3]
    options = {k: v for k, v in (("prompt_grad", args.prompt_grad), ("prefix_chunk_size", args.chunk)) if v is not None}
    report = explain(loss_fn, *example_args, options=options, **example_kwargs)
    print(report.state_table())
    print()
    print(report.plan(P=args.P, G=args.G, R=args.R, budget_gb=args.budget_gb, ranks=args.ranks).table())
    if args.html:
        report.to_html(args.html, P=args.P, G=args.G, R=args.R, budget_gb=args.budget_gb, ranks=args.ranks)
        print(f"\nwrote {args.html}")
    if args.dot:
        pathlib.Path(args.dot).write_text(report.to_dot())
        print(f"wrote {args.dot}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="longstraw", description="LongStraw: plan GRPO losses over long prompts.")
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("explain", help="show the partition and captured state, predict peak memory")
    ex.add_argument("target", help="SCRIPT.py:FUNC or MODULE:FUNC returning (loss_fn, args[, kwargs])")
    ex.add_argument("--P", type=int, required=True, help="prompt tokens")
    ex.add_argument("--G", type=int, default=None, help="responses per group (default: the example's)")
    ex.add_argument("--R", type=int, default=None, help="tokens per response (default: the example's)")
    ex.add_argument("--budget-gb", type=float, default=None, help="device memory budget: reports the largest P that fits")
    ex.add_argument("--prompt-grad", choices=("exact", "detached"), default=None)
    ex.add_argument("--chunk", type=int, default=None, help="prefix_chunk_size")
    ex.add_argument("--ranks", type=int, default=1, help="context parallelism: one rank's peak, the prompt state over this many")
    ex.add_argument("--html", default="longstraw_plan.html", help="HTML view to write ('' for none)")
    ex.add_argument("--dot", default=None, help="also write a Graphviz DOT file")
    args = parser.parse_args(argv)
    try:
        return explain_command(args)
    except LongStrawError as err:
        print(f"longstraw: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
