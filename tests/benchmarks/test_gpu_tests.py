"""benchmarks/gpu_tests.py on a folder of sample tests: every outcome is
read, a failure keeps its error, and the tests the budget cut are "not run"."""

from __future__ import annotations

import sys

from helpers.paths import BENCHMARKS

sys.path.insert(0, str(BENCHMARKS))
from gpu_tests import run, table  # noqa: E402

SAMPLE = '''
import time

import pytest


@pytest.mark.gpu
def test_passes():
    pass


@pytest.mark.gpu
def test_fails():
    assert 1 == 2, "one is not two"


@pytest.mark.gpu
@pytest.mark.skip(reason="no device")
def test_skips():
    pass


@pytest.mark.gpu
def test_outlives_the_budget():
    time.sleep(60)


@pytest.mark.gpu
def test_after_the_budget():
    pass


def test_unmarked_for_gpu_is_not_collected():
    pass
'''


def test_outcomes_of_a_run_the_budget_ends(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs CUDA\n")
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    # 6 s: pytest starts and runs the three quick tests in about 1 s; the budget ends the sleeping one
    tests, stopped = run([str(tmp_path)], budget_s=6, log_path=str(tmp_path / "out.log"))
    assert stopped
    got = {name.split("::")[-1]: test for name, test in tests.items()}
    assert {name: test["outcome"] for name, test in got.items()} == {
        "test_passes": "passed", "test_fails": "failed", "test_skips": "skipped",
        "test_outlives_the_budget": "not run", "test_after_the_budget": "not run"}
    assert "test_unmarked_for_gpu_is_not_collected" not in got
    assert got["test_fails"]["error"].startswith("AssertionError: one is not two")
    assert "| passed | failed | skipped | not run |" in table({"tests": tests})
