"""Attention outputs kept in host memory for the reverse pass (`runtime/host_offload.py`): entries kept
as they were and read back as copies, the next read's copy started once a chunk's order of reads is
learned, a chunk's entries forgotten, no entry kept where it would leave the host short, under context
parallelism kept by the chunk's rank alone (or a round's on every rank or none), and host memory read
from /proc/meminfo."""

from __future__ import annotations

import io
import logging

import pytest
import torch

from longstraw.runtime import host_offload
from longstraw.runtime.host_offload import HostAttentionOutputs, HostCopier, host_memory

from helpers.thread_ranks import ThreadRanks, on_ranks, this_thread

CPU = torch.device("cpu")


def _entry(seed: float) -> tuple[torch.Tensor, torch.Tensor]:
    """out [1, 2, 3, 4] and lse [1, 2, 3] in float32: 96 + 24 bytes."""
    return torch.full((1, 2, 3, 4), seed), torch.full((1, 2, 3), -seed)


@pytest.fixture
def roomy_host(monkeypatch) -> None:
    monkeypatch.setattr(host_offload, "host_memory", lambda: (1 << 40, 1 << 40))


def _host_with(available: int, total: int = 1000):
    return lambda: (available, total)


def test_an_entry_is_kept_as_it_was_and_each_read_is_its_own_copy(roomy_host):
    kept = HostAttentionOutputs(CPU)
    out = torch.arange(24.0).view(1, 3, 2, 4).transpose(1, 2)  # a transposed layout, as flash attention's output
    lse = torch.zeros(1, 2, 3)
    kept.keep(7, 16, out, lse)
    out.add_(100.0)
    first = kept.get(7, 16)
    assert torch.equal(first[0], torch.arange(24.0).view(1, 3, 2, 4).transpose(1, 2)) and torch.equal(first[1], lse)
    assert first[0].stride() == out.stride()
    first[0].zero_()
    assert kept.get(7, 16)[0].sum().item() == sum(range(24))
    assert kept.has(7, 16) and not kept.has(7, 0) and not kept.has(6, 16) and kept.get(7, 0) is None


def test_dropping_a_chunk_forgets_its_entries_only(roomy_host):
    kept = HostAttentionOutputs(CPU)
    for slot, offset in ((0, 0), (1, 3), (0, 4), (1, 7)):
        kept.keep(slot, offset, *_entry(offset))
    kept.drop(0, 4)
    assert [kept.has(slot, offset) for slot, offset in ((0, 0), (1, 3), (0, 4), (1, 7))] == [False, False, True, True]
    kept.close()
    assert not kept.has(0, 4) and not kept.has(1, 7)


def test_once_a_chunks_order_of_reads_is_learned_each_read_starts_the_next_ones_copy(roomy_host):
    """Chunk [0, 4) reads slot 5, then slot 2; in chunk [4, 8) the copy of
    slot 5's entry starts with the chunk, and of slot 2's with that read:
    the device holds the entry being read and the next one only."""
    kept = HostAttentionOutputs(CPU)
    for offset in (0, 4):
        kept.keep(5, offset, *_entry(offset + 5))
        kept.keep(2, offset, *_entry(offset + 2))
    kept.prefetch(0)
    assert kept.arriving == {}  # nothing learned yet
    assert [kept.get(slot, 0)[0][0, 0, 0, 0].item() for slot in (5, 2)] == [5.0, 2.0]
    kept.drop(0, 4)
    kept.prefetch(4)
    assert set(kept.arriving) == {(5, 4)}
    assert kept.get(5, 4)[0][0, 0, 0, 0].item() == 9.0
    assert set(kept.arriving) == {(2, 4)}
    assert kept.get(2, 4)[0][0, 0, 0, 0].item() == 6.0
    assert kept.arriving == {} and kept.order == [5, 2]


def test_a_copy_on_its_way_for_a_dropped_chunk_is_let_go(roomy_host):
    kept = HostAttentionOutputs(CPU)
    for offset in (0, 4):
        kept.keep(1, offset, *_entry(offset))
    kept.get(1, 0)
    kept.drop(0, 4)
    kept.prefetch(4)
    assert set(kept.arriving) == {(1, 4)}
    kept.drop(4, 4)
    assert kept.arriving == {} and not kept.has(1, 4)


def test_an_entry_that_would_leave_the_host_short_is_not_kept_and_warned_about_once(monkeypatch, caplog):
    """With 10% of 1000 bytes to leave available, an entry of 120 bytes fits
    in 250 available bytes, not in 150."""
    kept = HostAttentionOutputs(CPU)
    monkeypatch.setattr(host_offload, "host_memory", _host_with(150))
    with caplog.at_level(logging.WARNING, logger="longstraw.runtime.host_offload"):
        kept.keep(0, 0, *_entry(1.0))
        kept.keep(0, 4, *_entry(1.0))
    assert not kept.has(0, 0) and not kept.has(0, 4) and kept.get(0, 0) is None
    assert len(caplog.records) == 1 and "host memory is short" in caplog.text and "from position 0 on" in caplog.text
    monkeypatch.setattr(host_offload, "host_memory", _host_with(250))
    kept.keep(0, 8, *_entry(1.0))
    assert kept.has(0, 8)
    assert HostCopier(CPU).host_bytes_to_take(_entry(1.0)) == 120


def _keeping(ranks: ThreadRanks, owner: int) -> tuple[bool, bool, bool]:
    kept = HostAttentionOutputs(CPU, ranks)
    kept.keep(3, 8, *_entry(1.0), owner=owner)
    return (3, 8) in kept.entries, (3, 8) in kept.elsewhere, kept.has(3, 8)


def test_under_context_parallelism_only_the_chunks_rank_keeps_it_and_every_rank_knows(roomy_host):
    assert on_ranks(lambda ranks: _keeping(ranks, owner=1)) == [(False, True, True), (True, False, True)]


def test_where_the_chunks_rank_has_no_room_no_rank_counts_on_the_entry(monkeypatch):
    monkeypatch.setattr(host_offload, "host_memory", _host_with(0))
    assert on_ranks(lambda ranks: _keeping(ranks, owner=1)) == [(False, False, False)] * 2


@pytest.mark.parametrize("short_rank, kept_on", [(None, [True, True]), (1, [False, False])])
def test_a_rounds_entries_are_kept_on_every_rank_or_on_none(short_rank, kept_on, monkeypatch):
    monkeypatch.setattr(host_offload, "host_memory", lambda: (0 if this_thread().rank == short_rank else 1 << 40, 1000))

    def keep_round(ranks: ThreadRanks) -> bool:
        kept = HostAttentionOutputs(CPU, ranks)
        kept.keep_round(3, 8 + 4 * ranks.rank, *_entry(ranks.rank))
        return kept.has(3, 8 + 4 * ranks.rank)

    assert on_ranks(keep_round) == kept_on


def test_host_memory_is_read_from_proc_meminfo_in_bytes(monkeypatch):
    meminfo = "MemTotal:       2000 kB\nMemFree:         100 kB\nMemAvailable:    500 kB\n\n"
    monkeypatch.setattr(host_offload, "open", lambda path: io.StringIO(meminfo), raising=False)
    assert host_memory() == (500 * 1024, 2000 * 1024)


def test_without_proc_meminfo_there_is_no_host_memory(monkeypatch):
    def missing(path):
        raise FileNotFoundError(path)

    monkeypatch.setattr(host_offload, "open", missing, raising=False)
    assert host_memory() == (0, 0)


@pytest.mark.gpu
def test_on_cuda_small_copies_share_a_pinned_slab_and_a_large_one_gets_its_own(monkeypatch):
    monkeypatch.setattr(host_offload, "PINNED_SLAB", 4096)
    monkeypatch.setattr(host_offload, "reusable_pinned_bytes", lambda: 0)
    copier = HostCopier(torch.device("cuda"))
    small, large = torch.ones(100, device="cuda"), torch.ones(2000, device="cuda")  # 400 and 8000 bytes
    assert copier.host_bytes_to_take((small, small)) == 4096  # a first copy takes a new slab, the second fits in it
    assert copier.host_bytes_to_take((large,)) == 8000
    landing = copier.to_host((small, small, large))
    assert len(copier.slabs) == 1 and all(t.is_pinned() for t in landing.host)
    assert copier.host_bytes_to_take((small,)) == 0  # room left in the slab
    assert all(torch.equal(b, a) for b, a in zip(copier.to_device(landing).wait(), (small, small, large)))
