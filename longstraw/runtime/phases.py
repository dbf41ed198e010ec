"""The steps the runtime runs, named: hooks around each (`around_steps`, for timers
and profilers), the phase a name belongs to, and the note a failure gets of where it happened.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
from collections.abc import Callable, Iterator

_AROUND_STEPS: list[Callable[[str], contextlib.AbstractContextManager]] = []


@contextlib.contextmanager
def around_steps(around: Callable[[str], contextlib.AbstractContextManager]) -> Iterator[None]:
    """Run `around(where)` around every step the runtime runs while this is
    active, for timers and profilers. `where` names the step: "capturing
    prompt chunk [0, 8192)", "running branch 3 of 8", "replaying branch 3
    of 8; ...", "in the reverse pass over prompt chunk [0, 8192); ..."."""
    _AROUND_STEPS.append(around)
    try:
        yield
    finally:
        _AROUND_STEPS.remove(around)


def phase_of(where: str) -> str:
    """`replaying branch 3 of 8; ...` -> `replaying branch`: the phase of a step `around_steps` names."""
    words = itertools.takewhile(lambda w: not (w[0].isdigit() or w[0] == "["), where.split())
    return " ".join(list(words)[:4])


@contextlib.contextmanager
def noting(where: str) -> Iterator[None]:
    """Add where a step failed to its exception, keeping the type (callers
    catch torch.OutOfMemoryError, IndexError...), inside `around_steps`."""
    with contextlib.ExitStack() as stack:
        for around in list(_AROUND_STEPS):
            stack.enter_context(around(where))
        try:
            yield
        except Exception as err:
            err.add_note(f"longstraw: raised {where}")
            raise


def walked(chunks: list[tuple[int, int]], what: str, show: bool | None) -> Iterator[tuple[int, int]]:
    """`chunks` (offset, length), with a tqdm bar in tokens/s where `show`
    (`Options.progress`; None: when stderr is a terminal and there are four
    chunks or more)."""
    if show is None:
        show = sys.stderr.isatty() and len(chunks) >= 4
    if not show:
        yield from chunks
        return
    from tqdm.auto import tqdm

    total = sum(length for _, length in chunks)
    # one update per chunk: redraw on every one (mininterval=0)
    bar = tqdm(total=total, unit="tok", unit_scale=True, desc=f"longstraw {what}", leave=False, mininterval=0)
    with contextlib.closing(bar):
        for chunk in chunks:
            yield chunk
            bar.update(chunk[1])
