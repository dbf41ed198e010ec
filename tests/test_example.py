"""The GRPO example runs end to end and reports its parity check."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "grpo_step.py"


def test_grpo_step_example():
    assert EXAMPLE.exists(), f"{EXAMPLE} is missing"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        proc = subprocess.run(
            [sys.executable, str(EXAMPLE)],
            cwd=REPO / "examples",  # not the repo root: import the installed package
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{EXAMPLE.name} did not finish in {e.timeout}s:\n{e.stdout}\n{e.stderr}")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{output}"
    assert "parity" in output.lower(), output
