"""`longstraw explain` on the command line (longstraw/cli.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from longstraw.cli import main

from helpers.paths import REPO

EXAMPLE = REPO / "examples" / "grpo_step.py"


def test_explain_prints_the_plan_and_writes_the_views(tmp_path, capsys):
    html, dot = tmp_path / "plan.html", tmp_path / "plan.dot"
    code = main([
        "explain", f"{EXAMPLE}:example_group", "--P", "1048576", "--G", "8", "--budget-gb", "141",
        "--html", str(html), "--dot", str(dot),
    ])
    out = capsys.readouterr().out
    assert code == 0
    assert "B per prompt position" in out and "predicted peak" in out and "largest P that fits" in out
    assert "P=1048576 G=8" in out
    assert html.read_text().startswith("<!DOCTYPE html>") and "cluster_prefix" in dot.read_text()


def test_bad_targets_are_reported(capsys):
    assert main(["explain", "no_colon_here", "--P", "10"]) == 2
    assert "SCRIPT.py:FUNC" in capsys.readouterr().err
    assert main(["explain", f"{EXAMPLE}:missing_function", "--P", "10"]) == 2
    assert "no function 'missing_function'" in capsys.readouterr().err


def test_module_entry_point(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "longstraw", "explain", f"{EXAMPLE}:example_group", "--P", "4096", "--html", ""],
        capture_output=True, text=True, cwd=tmp_path, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "predicted peak" in result.stdout


@pytest.mark.slow  # 14 s; CI plans one rank of context parallelism in tests/planning/test_planner.py
def test_explain_plans_one_rank_of_a_context_parallel_run(capsys):
    """`--ranks 2`: the plan is one rank's, holding the larger share of the
    prompt state, so about twice the prompt fits the same budget."""
    def largest(out: str) -> int:
        return int(next(line for line in out.splitlines() if "largest P that fits" in line).split()[-1])

    argv = ["explain", f"{EXAMPLE}:example_group", "--P", "1048576", "--G", "8", "--budget-gb", "1", "--html", ""]
    assert main(argv) == 0
    one = largest(capsys.readouterr().out)
    assert main([*argv, "--ranks", "2"]) == 0
    out = capsys.readouterr().out
    assert "over 2 ranks" in out and "predicted peak per rank" in out
    assert 1.9 * one < largest(out) < 2.1 * one
