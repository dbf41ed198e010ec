"""The examples run end to end and report their parity checks."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from helpers.paths import REPO

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
    """The demo's parity line: a loss that is not zero, equal to eager's,
    and every gradient within the stated tolerance."""
    output = _run("grpo_step.py")
    parity = re.search(
        r"parity vs eager \(exact, float64\): loss (\S+) vs (\S+) \(relative (\S+)\), "
        r"max relative gradient error (\S+); tolerance (\S+)", output,
    )
    assert parity is not None, output
    loss, eager_loss, loss_error, grad_error, tolerance = (float(x) for x in parity.groups())
    assert tolerance == 1e-6
    assert abs(eager_loss) > 1e-3 and loss_error <= tolerance and grad_error <= tolerance, output
    assert abs(loss - eager_loss) <= tolerance * abs(eager_loss)


def test_custom_pass_example():
    """The refusal names the custom operator and the way to add a pass; with
    the pass, parity (asserted inside the example) and one carried state per layer."""
    output = _run("custom_pass.py")
    assert re.search(r"operator `example::ema` .* touches the sequence axis and has no dimension rule", output), output
    assert "options={'passes': [...]} or longstraw.register_pass" in output, output
    assert "parity against eager (float64)" in output, output
    assert re.search(r"total: 0 B per prompt position, 256 B fixed", output), output


@pytest.mark.slow  # 19-32 s in CI; tests/integrations/test_verl.py holds the same update to verl's in CI
def test_verl_actor_update_example():
    """One verl actor update through LongStraw against verl's own engine: gradients within 1e-5."""
    output = _run("verl_actor_update.py")
    parity = re.search(r"loss (\S+) vs verl's (\S+), max relative gradient error (\S+); tolerance (\S+)", output)
    assert parity is not None, output
    loss, verl_loss, grad_error, tolerance = (float(x) for x in parity.groups())
    assert tolerance == 1e-5 and abs(verl_loss) > 1e-3, output
    assert abs(loss - verl_loss) <= tolerance * abs(verl_loss) and grad_error <= tolerance, output
