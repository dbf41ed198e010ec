"""The runtime's named steps (`runtime/phases.py`): hooks around each step,
the phase a step's name belongs to, the note a failure gets, and the
progress walk over a prompt's chunks."""

from __future__ import annotations

import contextlib

import pytest

from longstraw.runtime.phases import around_steps, noting, phase_of, walked


@pytest.mark.parametrize("where, phase", [
    ("capturing prompt chunk [0, 8192)", "capturing prompt chunk"),
    ("capturing again prompt chunk [8, 16)", "capturing again prompt chunk"),
    ("running branch 3 of 8 over [16, 20)", "running branch"),
    ("running branches 0, 1 of 8 over [16, 20)", "running branches"),
    ("replaying branch 3 of 8; over [16, 20)", "replaying branch"),
    ("in the reverse pass over prompt chunk [0, 8192); ...", "in the reverse pass"),
])
def test_a_step_belongs_to_the_phase_its_name_starts_with(where, phase):
    assert phase_of(where) == phase


def test_hooks_run_around_every_noted_step_while_active():
    seen = []

    @contextlib.contextmanager
    def around(where):
        seen.append(("enter", where))
        yield
        seen.append(("exit", where))

    with around_steps(around):
        with noting("running branch 0 of 2"):
            seen.append("step")
    with noting("running branch 1 of 2"):  # after the block: no hook
        pass
    assert seen == [("enter", "running branch 0 of 2"), "step", ("exit", "running branch 0 of 2")]


def test_a_failure_keeps_its_type_and_says_where():
    with pytest.raises(IndexError) as info, noting("in the reverse pass over prompt chunk [8, 16)"):
        raise IndexError("out of range")
    assert info.value.__notes__ == ["longstraw: raised in the reverse pass over prompt chunk [8, 16)"]


def test_the_walk_yields_every_chunk_with_or_without_a_bar(capsys):
    chunks = [(0, 8), (8, 8), (16, 4)]
    assert list(walked(chunks, "prompt capture", show=False)) == chunks
    assert list(walked(chunks, "prompt capture", show=True)) == chunks
    assert "longstraw prompt capture" in capsys.readouterr().err
