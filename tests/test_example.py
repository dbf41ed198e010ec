"""The examples run end to end and report their parity checks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"


def _run(name: str) -> str:
    """The example's output; fails the test on a non-zero exit or a timeout."""
    example = EXAMPLES / name
    assert example.exists(), f"{example} is missing"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        proc = subprocess.run(
            [sys.executable, str(example)],
            cwd=EXAMPLES,  # not the repo root: import the installed package
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{name} did not finish in {e.timeout}s:\n{e.stdout}\n{e.stderr}")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{output}"
    return output


def test_grpo_step_example():
    assert "parity" in _run("grpo_step.py").lower()


def test_custom_pass_example():
    """The refusal names the custom operator and the way to add a pass; with
    the pass, parity (asserted inside the example) and one carried state per layer."""
    output = _run("custom_pass.py")
    assert re.search(r"operator `example::ema` .* touches the sequence axis and has no dimension rule", output), output
    assert "options={'passes': [...]} or longstraw.register_pass" in output, output
    assert "parity against eager (float64)" in output, output
    assert re.search(r"total: 0 B per prompt position, 256 B fixed", output), output
