"""A rank's share of the prompt (`parallel/shards.py`): which rank holds a
position, where it sits in the rank's buffers and back, and the helpers a
round's gathers use. Index arithmetic only: the collectives run in
`test_context_parallel.py`."""

from __future__ import annotations

import types

import pytest
import torch

from longstraw.parallel.shards import PromptShard, by_rank, padded_to
from longstraw.runtime.prompt_state import ChunkRound
from longstraw.runtime.schedule import ChunkSchedule


def _shards(prefix_len: int, size: int, world: int) -> list[PromptShard]:
    shares = ChunkSchedule(prefix_len, size, world).shares
    return [PromptShard(types.SimpleNamespace(rank=r), shares) for r in range(world)]


@pytest.mark.parametrize("prefix_len, size, world", [(40, 8, 2), (37, 8, 3), (5, 8, 2)])
def test_every_position_has_one_owner_and_one_buffer_index(prefix_len, size, world):
    """Dealt in chunks of `size` (the last shorter; a rank may hold none):
    each position is held by exactly one rank, at a buffer index that maps
    back to it, and the buffer indices of an interval are one run."""
    shards = _shards(prefix_len, size, world)
    assert sum(s.size for s in shards) == prefix_len
    positions = torch.arange(prefix_len)
    held_by = torch.full((prefix_len,), -1)
    for shard in shards:
        local, held = shard.to_local(positions)
        assert torch.equal(shard.to_global(local[held]), positions[held])
        assert sorted(local[held].tolist()) == list(range(shard.size))
        held_by[held] = shard.rank
        for p in range(prefix_len):
            assert (shard.owner(p) == shard.rank) == bool(held[p])
        for first, last in [(0, prefix_len), (3, 11), (size, 2 * size + 1)]:
            begin, end = shard.local_range(first, last)
            inside = (positions >= first) & (positions < last) & held
            assert end - begin == int(inside.sum()) and set(local[inside].tolist()) == set(range(begin, end))
    assert bool((held_by >= 0).all())


def test_a_rounds_tensors_go_in_rank_order_and_short_ones_are_padded():
    round_ = ChunkRound(((0, 8), (8, 8)), owners=(1, 0), index=0)
    first, second = torch.zeros(2), torch.ones(2)
    assert torch.equal(by_rank([first, second], round_), torch.stack([second, first]))
    short = torch.ones(2, 3)
    assert torch.equal(padded_to(short, 1, 5, fill=-1.0), torch.tensor([[1.0, 1, 1, -1, -1]] * 2))
    assert padded_to(short, 1, 3) is short
