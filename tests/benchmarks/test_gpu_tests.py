"""benchmarks/gpu_tests.py on a folder of sample tests: every outcome is
read, a failure keeps its error, the tests the budget cut are "not run",
and the budget covers the collection."""

from __future__ import annotations

import sys
import time

from helpers.paths import BENCHMARKS

sys.path.insert(0, str(BENCHMARKS))
import gpu_tests  # noqa: E402
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


def test_outcomes_of_a_run_the_budget_ends(tmp_path, monkeypatch):
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs CUDA\n")
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    collected = gpu_tests.collected
    # a collection 2 s slower: the budget that is left runs the tests
    monkeypatch.setattr(gpu_tests, "collected", lambda paths: (time.sleep(2), collected(paths))[1])
    # 6 s: collecting and starting pytest and the three quick tests take about 4 s; the budget ends the sleeping one
    start = time.monotonic()
    tests, stopped = run([str(tmp_path)], budget_s=6, log_path=str(tmp_path / "out.log"))
    assert stopped and time.monotonic() - start < 7.5
    got = {name.split("::")[-1]: test for name, test in tests.items()}
    assert {name: test["outcome"] for name, test in got.items()} == {
        "test_passes": "passed", "test_fails": "failed", "test_skips": "skipped",
        "test_outlives_the_budget": "not run", "test_after_the_budget": "not run"}
    assert "test_unmarked_for_gpu_is_not_collected" not in got
    assert got["test_fails"]["error"].startswith("AssertionError: one is not two")
    assert "| passed | failed | skipped | not run |" in table({"tests": tests})


def test_a_test_past_its_own_timeout_fails_and_the_rest_run(tmp_path):
    """With `test_timeout_s` the sleeping test fails at its timeout, not at
    the budget, and the test after it runs."""
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs CUDA\n")
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    tests, stopped = run([str(tmp_path)], budget_s=30, log_path=str(tmp_path / "out.log"), test_timeout_s=2)
    got = {name.split("::")[-1]: test for name, test in tests.items()}
    assert not stopped
    timed_out = got["test_outlives_the_budget"]
    assert timed_out["outcome"] == "failed" and "Timeout" in timed_out["error"]
    assert got["test_after_the_budget"]["outcome"] == "passed"
