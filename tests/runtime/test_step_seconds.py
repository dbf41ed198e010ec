"""`longstraw.runtime.step_seconds`: the steps' forward seconds, read from
CUDA events once they completed, and the least per position kept."""

from __future__ import annotations

import pytest
import torch

from longstraw.runtime.step_seconds import StepSeconds


class FakeEvent:
    """A CUDA event's `query` and `elapsed_time` (milliseconds since `start`)."""

    def __init__(self, at_ms: float, done: bool = True) -> None:
        self.at_ms, self.done = at_ms, done

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: FakeEvent) -> float:
        return end.at_ms - self.at_ms


def test_completed_timings_keep_the_least_seconds_per_position():
    """The first step of a shape compiles its kernels: of two timings of a
    kind the least per position stays; a step still running is read later."""
    seconds = StepSeconds()
    running = FakeEvent(5.0, done=False)
    seconds._pending = [(("branch", 4), 400, FakeEvent(0.0), FakeEvent(900.0)),
                        (("branch", 4), 400, FakeEvent(0.0), FakeEvent(40.0)),
                        (("prompt", 1), 1000, FakeEvent(0.0), running)]
    seconds.settle()
    assert seconds.measured == {("branch", 4): pytest.approx(1e-4)}
    assert seconds.branch(4, 100) == pytest.approx(0.04) and seconds.branch(1, 100) is None
    assert seconds.prompt(1000) is None
    running.done = True
    seconds.settle()
    assert seconds.prompt(2000) == pytest.approx(0.01) and seconds._pending == []


def test_steps_off_cuda_or_not_enabled_are_not_timed():
    seconds = StepSeconds()
    with seconds.timing(("branch", 1), 10, torch.device("cpu")):
        torch.ones(3).sum()
    with seconds.timing(("branch", 1), 10, torch.device("cuda"), enabled=False):
        pass
    seconds.settle()
    assert seconds.measured == {} and seconds._pending == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_step_on_cuda_is_timed_without_synchronising():
    seconds = StepSeconds()
    x = torch.randn(2048, 2048, device="cuda")
    with seconds.timing(("branch", 2), 4096, torch.device("cuda")):
        for _ in range(8):
            x = x @ x / 2048
    torch.cuda.synchronize()
    seconds.settle()
    assert 0 < seconds.branch(2, 2048) < 1.0
