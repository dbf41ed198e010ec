"""The GPU-marked tests on a GPU machine, each test's outcome kept as a result file.

`bash .ci/run` runs on a CPU, where the tests marked `gpu` skip. This runs
them where CUDA is and records every test's outcome with the provenance a
benchmark result carries, so that `benchmarks/results/INDEX.md` says which
commit's GPU tests passed on which card:

    PYTHONSAFEPATH=1 python benchmarks/gpu_tests.py tests/runtime --budget-s 560 --out-dir $OUT --name gpu_tests_runtime_gpu

It collects `pytest -m gpu <paths>`, runs them in a subprocess killed at the
budget, collection included (fla's kernels compile at their first call:
a whole folder can take ten minutes), and writes `<name>.json` (per test:
passed, failed with the first line of its error, skipped, or not run
where the budget ended first) and `<name>.log` (pytest's output).
`--test-timeout-s` fails a test that runs longer (pytest-timeout), so that
one test stuck compiling kernels does not take the whole budget. Outside
CI's machine install the package from a wheel and run with
`PYTHONSAFEPATH=1`, so that the tests import the installed package.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter

REPORTS = "GPU_TESTS_REPORTS"  # where the pytest process, with this module as a plugin, appends each test's report


def pytest_runtest_logreport(report) -> None:
    """A pytest hook (`-p gpu_tests`): each phase's report as it comes, so a
    run the budget ends keeps what it finished."""
    path = os.environ.get(REPORTS)
    if not path or (report.when != "call" and report.outcome == "passed"):
        return
    outcome = "error" if report.failed and report.when != "call" else report.outcome
    entry = {"test": report.nodeid, "outcome": outcome}
    if report.failed:
        lines = [line for line in report.longreprtext.splitlines() if line.startswith("E ")]
        entry["error"] = (lines[0][1:].strip() if lines else report.longreprtext.splitlines()[-1])[:300]
    with open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")


def gpu_pytest(paths: list[str], *extra: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-m", "gpu", *extra, *paths]


def collected(paths: list[str]) -> list[str]:
    """The node ids `pytest -m gpu paths` would run, in order."""
    out = subprocess.run(gpu_pytest(paths, "--collect-only", "-q"), capture_output=True, text=True)
    return [line.strip() for line in out.stdout.splitlines() if "::" in line]


def run(paths: list[str], budget_s: float, log_path: str, test_timeout_s: float | None = None,
        ) -> tuple[dict[str, dict], bool]:
    """(each collected test's outcome, whether the budget ended the run).
    The budget covers the collection too: a command that ends a little
    after it still gets the result file. `test_timeout_s`: a test that runs
    longer fails there (pytest-timeout) and the tests after it still run."""
    start = time.monotonic()
    tests = collected(paths)
    reports = log_path + ".reports"
    if os.path.exists(reports):
        os.remove(reports)
    env = {**os.environ, REPORTS: reports,
           "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH", "")])}
    with open(log_path, "w") as log:
        try:
            per_test = () if test_timeout_s is None else ("--timeout", str(test_timeout_s))
            subprocess.run(gpu_pytest(paths, "-v", "-p", "gpu_tests", *per_test), stdout=log,
                           stderr=subprocess.STDOUT, timeout=max(budget_s - (time.monotonic() - start), 1.0), env=env)
            stopped = False
        except subprocess.TimeoutExpired:
            stopped = True
    seen: dict[str, dict] = {}
    if os.path.exists(reports):
        with open(reports) as f:
            for line in f:
                entry = json.loads(line)
                if seen.get(entry["test"], {}).get("outcome") not in ("failed", "error"):  # a teardown error after a pass
                    seen[entry.pop("test")] = entry
        os.remove(reports)
    return {test: seen.get(test, {"outcome": "not run"}) for test in tests}, stopped


def table(result: dict) -> str:
    counts = Counter(test["outcome"] for test in result["tests"].values())
    lines = ["| " + " | ".join(counts) + " |", "|" + " ---: |" * len(counts),
             "| " + " | ".join(map(str, counts.values())) + " |"]
    lines += [f"- {name}: {test['outcome']}" + (f" ({test['error']})" if test.get("error") else "")
              for name, test in result["tests"].items() if test["outcome"] not in ("passed", "skipped")]
    return "\n".join(lines)


def main() -> None:
    # here, not at the top: pytest loads this module as a plugin (`-p gpu_tests`), and
    # grpo.results imports torch, which tests that do not need it should not wait for
    from grpo.results import provenance

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", help="test files or folders (node ids too)")
    parser.add_argument("--budget-s", type=float, default=560)
    parser.add_argument("--test-timeout-s", type=float, default=None,
                        help="fail a test that runs longer (needs pytest-timeout), so that one stuck test "
                             "does not take the whole budget")
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--name", default="gpu_tests")
    args = parser.parse_args()
    argv = ["python", "benchmarks/gpu_tests.py",
            *["benchmarks/results" if a == args.out_dir else a for a in sys.argv[1:]]]
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, args.name)
    tests, stopped = run(args.paths, args.budget_s, stem + ".log", args.test_timeout_s)
    result = {**provenance(" ".join(argv)), "paths": args.paths, "budget_s": args.budget_s,
              "test_timeout_s": args.test_timeout_s,
              "stopped_by_budget": stopped, "tests": tests}
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=2)
    print(table(result))


if __name__ == "__main__":
    main()
