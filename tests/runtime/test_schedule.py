"""`ChunkSchedule` (longstraw/runtime/schedule.py): the prompt's chunks, as the
runtime runs them, the planner counts them, context parallelism deals
them and the simulation samples them."""

from __future__ import annotations

import pytest

from longstraw.runtime.schedule import ChunkSchedule


def test_the_chunks_cover_the_prompt_once_and_are_counted():
    for prefix_len in range(0, 40):
        for size in (1, 3, 8, 64):
            schedule = ChunkSchedule(prefix_len, size)
            chunks = schedule.chunks
            assert len(chunks) == schedule.count
            assert sum(n for _, n in chunks) == prefix_len and all(0 < n <= size for _, n in chunks)
            assert [o for o, _ in chunks] == list(range(0, prefix_len, size))


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("prompt", [37, 100, 1000, 8 * 2 * 8 * 5])
def test_chunks_are_dealt_so_that_positions_and_attention_work_balance(world, prompt):
    """`shares`: every chunk on one rank, in position order; the positions
    held differ by at most one chunk, and the attention over earlier keys
    (per position held, the prompt positions after it) by at most one
    chunk's worth, 8 x prompt; both equal when the chunks are a multiple of
    2 x world. Contiguous shares would give rank 0 3/4 of the work at world 2."""
    schedule = ChunkSchedule(prompt, 8, world)
    chunks, held = schedule.chunks, schedule.shares
    assert sorted(c for h in held for c in h) == list(chunks) and all(list(h) == sorted(h) for h in held)
    positions = schedule.held
    work = [sum(n * (prompt - o - n) for o, n in h) for h in held]
    assert max(positions) - min(positions) <= 8
    assert schedule.largest_share == max(positions) and positions[schedule.largest_rank] == max(positions)
    assert all(schedule.owner(c) == rank for rank, h in enumerate(held) for c in h)
    if len(chunks) >= world:
        assert max(work) - min(work) <= 8 * prompt
    if len(chunks) % (2 * world) == 0:
        assert len(set(positions)) == 1 and len(set(work)) == 1


def test_rounds_are_consecutive_chunks_one_per_rank():
    """Rounds of `world` consecutive chunks, each chunk of a round on another
    rank; the chunks after the last whole round are the rest."""
    schedule = ChunkSchedule(29, 4, 3)  # 8 chunks: two rounds of three, two after them
    rounds, rest = schedule.rounds()
    assert [list(r) for r in rounds] == [list(schedule.chunks[:3]), list(schedule.chunks[3:6])]
    assert rest == list(schedule.chunks[6:])
    assert all(sorted(schedule.owner(c) for c in r) == [0, 1, 2] for r in rounds)


def test_a_simulation_samples_the_first_and_the_last_chunks_or_rounds():
    """The first chunk and the last two (a short last chunk included); over
    ranks in rounds, the first round, the last two and the chunks after them."""
    one = ChunkSchedule(33, 4)
    assert one.sampled(in_rounds=False) == (one.chunks[0], *one.chunks[-2:])
    assert ChunkSchedule(12, 4).sampled(in_rounds=False) == ChunkSchedule(12, 4).chunks  # three chunks: all
    two = ChunkSchedule(269, 30, 2)  # nine chunks: four rounds of two and one after them
    assert two.sampled(in_rounds=True) == two.chunks[:2] + two.chunks[4:]
    assert two.sampled(in_rounds=False) == (two.chunks[0], *two.chunks[-2:])
