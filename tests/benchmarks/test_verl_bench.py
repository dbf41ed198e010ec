"""benchmarks/verl_bench.py end to end on tiny shapes on the CPU (its own
process: it starts a process group), every mode's updates run at two P."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers.paths import BENCHMARKS


@pytest.mark.slow
def test_verl_bench_runs_on_the_cpu(tmp_path):
    command = [sys.executable, str(BENCHMARKS / "verl_bench.py"), "--tiny", "--p-min", "16", "--p-max", "32",
               "--G", "2", "--R", "8", "--out-dir", str(tmp_path), "--name", "smoke"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(BENCHMARKS), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "smoke.json").read_text())
    assert set(result["sweep"]) == {"verl", "longstraw_exact", "longstraw_detached"}
    for mode, data in result["sweep"].items():
        assert [run["P"] for run in data["runs"] if run["ok"]] == [16, 32], (mode, data)
        assert data["max_prompt_tokens"] == 32 and data["limited_by"] == "p_max"
    assert (tmp_path / "smoke.md").read_text().startswith("verl actor update, dense slice")
