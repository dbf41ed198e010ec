"""`longstraw.runtime.kernels.work`: a kernel's own count of its arithmetic
reaches the innermost counter listening, is asked for only while one
listens, and a counter stops listening when its block ends, raised or not."""

from __future__ import annotations

import contextlib

import pytest

from longstraw.runtime.kernels import work


class Counter:
    def __init__(self) -> None:
        self.flops: list[float] = []
        self.inside = 0

    @contextlib.contextmanager
    def counted_as(self, flops: float):
        self.flops.append(flops)
        self.inside += 1
        try:
            yield
        finally:
            self.inside -= 1


def test_the_innermost_listener_counts_and_only_while_it_listens():
    outer, inner = Counter(), Counter()
    with work.counted_as(lambda: pytest.fail("asked with no counter listening")):
        pass
    with work.listening(outer):
        with work.listening(inner):
            with work.counted_as(lambda: 5.0):
                assert (inner.inside, outer.inside) == (1, 0)
        with work.counted_as(lambda: 7.0):
            pass
    with pytest.raises(RuntimeError), work.listening(outer):
        raise RuntimeError
    with work.counted_as(lambda: pytest.fail("asked after the counters stopped listening")):
        pass
    assert (inner.flops, outer.flops, inner.inside) == ([5.0], [7.0], 0)
