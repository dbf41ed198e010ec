"""Attention over keys sharded across ranks (`parallel/sharded_attention.py`), on two ranks as threads,
against float64 attention over all the keys in one place: replicated queries over sharded keys, a
step's causal attention over a sharded prompt within a key interval, and a round's chunks, each rank
its own; the outputs and every gradient (queries, the step's own keys, each rank's d(state))."""

from __future__ import annotations

import re

import pytest
import torch
import torch.fx as fx

import longstraw.parallel.sharded_attention as sharded
from longstraw.analysis.slots import SlotKind, StateSlot
from longstraw.parallel.shards import PromptShard, SlotKeys
from longstraw.runtime.kernels import attention as kernels
from longstraw.runtime.prompt_state import ChunkRound, PromptState, StepContext

from helpers.compare import assert_close
from helpers.thread_ranks import ThreadRanks, on_ranks, this_thread

HQ, HKV, D = 4, 2, 4
TOL = 1e-12


@pytest.fixture(autouse=True)
def _small_key_blocks(monkeypatch):
    """Blocks of a few keys, so that the forward and backward walk several per shard."""
    monkeypatch.setattr(kernels, "MATH_BLOCK_SCORES", 32)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
               scale: float | None = None) -> torch.Tensor:
    """Attention in float64 where `allowed` [n, m]; query head j reads key head j // (Hq / Hkv), and a
    row that sees no key gives 0."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
    s = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    p = torch.softmax(s.masked_fill(~allowed, -1e30), -1) * allowed.any(-1, keepdim=True)
    return p @ v


def _random(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("q, k, v", [
    ((1, 3, 2, 4), (1, 2, 5, 4), (1, 2, 5, 4)),
    ((4, 2, 4), (1, 2, 5, 4), (1, 2, 5, 4)),
    ((1, 4, 2, 4), (1, 2, 5, 4), (1, 2, 6, 4)),
    ((1, 4, 2, 4), (1, 2, 5, 8), (1, 2, 5, 8)),
    ((2, 4, 2, 4), (1, 2, 5, 4), (1, 2, 5, 4)),
], ids=["3 query heads over 2 key heads", "q not 4-D", "more values than keys", "another head size", "another batch"])
def test_malformed_shapes_are_refused_naming_them(q, k, v):
    expected = f"Hq a multiple of Hkv, k and v [B, Hkv, m, D]; got q {q}, k {k}, v {v}"
    with pytest.raises(ValueError, match=re.escape(expected)):
        sharded.sharded_attention(*(torch.zeros(shape) for shape in (q, k, v)))


@pytest.mark.parametrize("shards, scale", [((3, 5), None), ((0, 4), 0.7), ((0, 0), None)])
def test_replicated_queries_over_sharded_keys_are_attention_over_all_of_them(shards, scale, monkeypatch):
    """Rank r holds keys `[sum(shards[:r]), ...)`; a shard may be empty, and with no key anywhere the output is 0."""
    monkeypatch.setattr(sharded, "Ranks", lambda group: this_thread())
    q, grad_out = _random(2, HQ, 3, D, seed=0), _random(2, HQ, 3, D, seed=1)
    k, v = _random(2, HKV, sum(shards), D, seed=2), _random(2, HKV, sum(shards), D, seed=3)

    def attend(ranks: ThreadRanks) -> tuple[torch.Tensor, ...]:
        start, length = sum(shards[:ranks.rank]), shards[ranks.rank]
        mine = [t.clone().requires_grad_() for t in (q, k.narrow(-2, start, length), v.narrow(-2, start, length))]
        out = sharded.sharded_attention(*mine, scale=scale)
        out.backward(grad_out)
        return out.detach(), *(t.grad for t in mine)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = _reference(*leaves, torch.ones(3, sum(shards), dtype=torch.bool), scale)
    want.backward(grad_out)
    for rank, (out, grad_q, grad_k, grad_v) in enumerate(on_ranks(attend)):
        start, length = sum(shards[:rank]), shards[rank]
        assert_close(out, want.detach(), TOL, f"rank {rank}: output")
        assert_close(grad_q, leaves[0].grad, TOL, f"rank {rank}: dQ")
        assert_close(grad_k, leaves[1].grad.narrow(-2, start, length), TOL, f"rank {rank}: dK")
        assert_close(grad_v, leaves[2].grad.narrow(-2, start, length), TOL, f"rank {rank}: dV")


def _sharded_state(ranks: ThreadRanks, shares, k: torch.Tensor, v: torch.Tensor) -> tuple[PromptState, torch.Tensor]:
    """The prompt's keys and values `k`, `v` [1, Hkv, P, D], this rank's share in the state's buffers; and its positions."""
    graph, prefix_len = fx.Graph(), k.shape[-2]
    slots = [StateSlot(i, SlotKind.SEQUENCE, graph.placeholder(name), token_dim=2, batch_dim=0, shape=tuple(k.shape),
                       dtype=k.dtype, reason=f"test:{name}") for i, name in enumerate("kv")]
    shard = PromptShard(ranks, shares)
    state = PromptState(slots, capacity=prefix_len, prefix_len=prefix_len, device=torch.device("cpu"), shard=shard)
    positions = shard.to_global(torch.arange(shard.size))
    state.buffers[0].copy_(k[..., positions, :])
    state.buffers[1].copy_(v[..., positions, :])
    state.allocate_grads()
    return state, positions


def _causal_within(first: int, last: int, rows: range, keys: int) -> torch.Tensor:
    """[rows, keys]: key j is seen from position p where first <= j < last and j <= p."""
    p, j = torch.tensor(rows)[:, None], torch.arange(keys)[None, :]
    return (j >= first) & (j < last) & (j <= p)


P, N = 12, 4  # a prompt of 12 positions dealt in chunks of 4, then a step of 4
SHARES = (((0, 4),), ((4, 4), (8, 4)))


@pytest.mark.parametrize("first, last", [
    (0, P + N),  # plain causal
    (3, P + N),  # a left-padded prompt
    (P + 2, P + N),  # the step's first two rows see no key: 0
    (0, P + 2),  # a right-padded completion: its last rows see every key before P + 2
])
def test_a_steps_causal_attention_over_a_sharded_prompt_is_attention_within_its_key_interval(first, last):
    q, grad_out = _random(1, HQ, N, D, seed=0), _random(1, HQ, N, D, seed=1)
    k, v = _random(1, HKV, P + N, D, seed=2), _random(1, HKV, P + N, D, seed=3)

    def attend(ranks: ThreadRanks) -> tuple[torch.Tensor, ...]:
        state, positions = _sharded_state(ranks, SHARES, k[..., :P, :], v[..., :P, :])
        mine = [t.clone().requires_grad_() for t in (q, k[..., P:, :], v[..., P:, :])]
        out = sharded.sharded_causal_attention(StepContext(state, P, N, grad_enabled=True), *mine, SlotKeys(0, 1), None,
                                               first, last)
        out.backward(grad_out)
        return out.detach(), *(t.grad for t in mine), state.grads[0], state.grads[1], positions

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = _reference(*leaves, _causal_within(first, last, range(P, P + N), P + N))
    want.backward(grad_out)
    dk, dv = leaves[1].grad, leaves[2].grad
    for rank, (out, grad_q, grad_k, grad_v, state_k, state_v, positions) in enumerate(on_ranks(attend)):
        assert_close(out, want.detach(), TOL, f"rank {rank}: output")
        assert_close(grad_q, leaves[0].grad, TOL, f"rank {rank}: dQ")
        assert_close(grad_k, dk[..., P:, :], TOL, f"rank {rank}: the step's dK")
        assert_close(grad_v, dv[..., P:, :], TOL, f"rank {rank}: the step's dV")
        assert_close(state_k, dk[..., positions, :], TOL, f"rank {rank}: d(state) of its keys")
        assert_close(state_v, dv[..., positions, :], TOL, f"rank {rank}: d(state) of its values")
    if first >= P:
        assert not want.detach()[..., : first - P, :].any()


ROUND = ChunkRound(((8, 4), (12, 3)), owners=(1, 0), index=0)  # rank 1 runs [8, 12), rank 0 the shorter [12, 15)


@pytest.mark.parametrize("first", [0, 3, 10])
def test_a_rounds_chunks_are_causal_attention_each_on_its_rank(first):
    """The positions before the round, [0, 8), are sharded ([0, 4) on rank
    0, [4, 8) on rank 1); each rank passes its own chunk's queries, keys and
    values and gets its rows of attention over `[first, its end)`: outputs,
    dQ, dK/dV of its chunk (from the later chunk's queries too) and d(state) of its share."""
    before, end = ROUND.start, 15
    q, grad_out = _random(1, HQ, end - before, D, seed=0), _random(1, HQ, end - before, D, seed=1)
    k, v = _random(1, HKV, end, D, seed=2), _random(1, HKV, end, D, seed=3)

    def attend(ranks: ThreadRanks) -> tuple[torch.Tensor, ...]:
        state, positions = _sharded_state(ranks, (((0, 4),), ((4, 4),)), k[..., :before, :], v[..., :before, :])
        index = ROUND.owners.index(ranks.rank)
        offset, length = ROUND.chunks[index]
        step = StepContext(state, offset, length, grad_enabled=True, round=ChunkRound(ROUND.chunks, ROUND.owners, index))
        mine = [q[..., offset - before:offset - before + length, :], k[..., offset:offset + length, :],
                v[..., offset:offset + length, :]]
        mine = [t.clone().requires_grad_() for t in mine]
        out = sharded.round_attention(step, *mine, SlotKeys(0, 1), None, first, offset + length)
        out.backward(grad_out[..., offset - before:offset - before + length, :])
        return out.detach(), *(t.grad for t in mine), state.grads[0], state.grads[1], positions

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = _reference(*leaves, _causal_within(first, end, range(before, end), end))
    want.backward(grad_out)
    dq, dk, dv = (t.grad for t in leaves)
    for rank, (out, grad_q, grad_k, grad_v, state_k, state_v, positions) in enumerate(on_ranks(attend)):
        offset, length = ROUND.chunks[ROUND.owners.index(rank)]
        rows, keys = slice(offset - before, offset - before + length), slice(offset, offset + length)
        assert_close(out, want.detach()[..., rows, :], TOL, f"rank {rank}: output")
        assert_close(grad_q, dq[..., rows, :], TOL, f"rank {rank}: dQ")
        assert_close(grad_k, dk[..., keys, :], TOL, f"rank {rank}: its chunk's dK")
        assert_close(grad_v, dv[..., keys, :], TOL, f"rank {rank}: its chunk's dV")
        assert_close(state_k, dk[..., positions, :], TOL, f"rank {rank}: d(state) of its keys")
        assert_close(state_v, dv[..., positions, :], TOL, f"rank {rank}: d(state) of its values")
