"""`sharded_attention` over gloo: 2 and 3 processes, each holding one shard
of the keys and values, against single-process autograd through SDPA over
all the keys concatenated in rank order (float64, relative error 1e-10).

Every rank draws the same full inputs from the case's seed, keeps its own
shard and runs forward and backward with the same output gradient; it saves
the output, dQ and its dK/dV, and the reference runs here. The shards have
unequal lengths, one of them empty; the queries are grouped (GQA) in all but
one case. The explicit-softmax kernel's key blocks are made a few keys long,
so forward and backward walk several blocks per shard.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from helpers import gloo
from helpers.compare import assert_close

TOL = 1e-10


@dataclass(frozen=True)
class Case:
    name: str
    shards: tuple[int, ...]  # keys per rank of the group, in rank order
    hq: int
    hkv: int
    n: int = 3  # queries
    scale: float | None = None
    ranks: tuple[int, ...] | None = None  # a subgroup's ranks (None: the whole world)


CASES = {
    2: [
        Case("gqa", (5, 9), hq=4, hkv=2),
        Case("empty", (0, 7), hq=4, hkv=1, scale=0.3),
        Case("mha", (6, 2), hq=2, hkv=2, n=1),
    ],
    3: [
        Case("gqa", (4, 11, 3), hq=6, hkv=2, n=5),
        Case("empty", (8, 0, 5), hq=4, hkv=2, scale=0.7),
        Case("subgroup", (3, 6), hq=4, hkv=2, ranks=(0, 2)),
        Case("no keys", (0, 0, 0), hq=2, hkv=1),
    ],
}


def _inputs(case: Case, seed: int) -> tuple[torch.Tensor, ...]:
    """q [2, Hq, n, 8], all keys and values [2, Hkv, sum(shards), 8], the output gradient."""
    g = torch.Generator().manual_seed(seed)
    m = sum(case.shards)
    q = torch.randn(2, case.hq, case.n, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, case.hkv, m, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, case.hkv, m, 8, generator=g, dtype=torch.float64)
    return q, k, v, torch.randn(q.shape, generator=g, dtype=torch.float64)


def _worker(rank: int, world: int, port: int, out: str) -> None:
    gloo.init(rank, world, port)
    from longstraw.context_parallel import sharded_attention
    from longstraw.kernels import attention

    attention.MATH_BLOCK_SCORES = 64  # blocks of 64 // (Hq * n) keys
    res = {}
    for seed, case in enumerate(CASES[world]):
        group = None if case.ranks is None else dist.new_group(list(case.ranks))  # every rank joins new_group
        if case.ranks is not None and rank not in case.ranks:
            continue
        index = rank if case.ranks is None else case.ranks.index(rank)
        q, k, v, grad_out = _inputs(case, seed)
        start = sum(case.shards[:index])
        q = q.requires_grad_()
        local_k = k.narrow(-2, start, case.shards[index]).clone().requires_grad_()
        local_v = v.narrow(-2, start, case.shards[index]).clone().requires_grad_()
        output = sharded_attention(q, local_k, local_v, group=group, scale=case.scale)
        output.backward(grad_out)
        res[case.name] = (output.detach(), q.grad, local_k.grad, local_v.grad)
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _reference(case: Case, seed: int) -> tuple[torch.Tensor, ...]:
    """SDPA over every key at once: output, dQ, dK, dV."""
    q, k, v, grad_out = (t.requires_grad_() for t in _inputs(case, seed))
    output = F.scaled_dot_product_attention(q, k, v, scale=case.scale, enable_gqa=True)
    output.backward(grad_out.detach())
    return output.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("world", sorted(CASES))
def test_sharded_attention(world, tmp_path):
    results = gloo.spawn(_worker, world, tmp_path)
    for seed, case in enumerate(CASES[world]):
        ranks = case.ranks or tuple(range(world))
        got = [results[r][case.name] for r in ranks]
        if sum(case.shards) == 0:  # a row that sees no key gives 0, and no gradient
            for output, grad_q, grad_k, grad_v in got:
                assert not output.any() and not grad_q.any() and grad_k.numel() == grad_v.numel() == 0
            continue
        output, grad_q, grad_k, grad_v = _reference(case, seed)
        for index, (rank_output, rank_grad_q, rank_grad_k, rank_grad_v) in enumerate(got):
            what = f"{case.name}, rank {ranks[index]}"
            assert_close(rank_output, output, TOL, f"{what}: output")
            assert_close(rank_grad_q, grad_q, TOL, f"{what}: dQ")
            start, m = sum(case.shards[:index]), case.shards[index]
            assert_close(rank_grad_k, grad_k.narrow(-2, start, m), TOL, f"{what}: dK")
            assert_close(rank_grad_v, grad_v.narrow(-2, start, m), TOL, f"{what}: dV")
