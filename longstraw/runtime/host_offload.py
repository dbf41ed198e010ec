"""Exact mode's attention outputs in pinned host memory
(`Options.attention_outputs_on_host`): kept through the capture, fetched
back chunk by chunk for the reverse pass, and the pinned slabs they live in.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from longstraw.parallel.ranks import Ranks

log = logging.getLogger("longstraw.runtime.host_offload")


HOST_RESERVE = 0.1
"""Fraction of the host's memory `HostAttentionOutputs` leaves available."""


class HostAttentionOutputs:
    """`Options.attention_outputs_on_host`: the output and log-sum-exp of
    each causal attention layer over each prompt chunk, from the capture,
    kept in host memory by (state slot, chunk offset). The reverse pass
    recomputes a chunk with the same inputs, so it reads them instead of
    running attention's forward over every earlier position again. An entry
    that would leave less than `HOST_RESERVE` of the host's memory available
    is not kept: its chunk runs the forward as without the option.

    Copies go through `HostCopier`, off the compute stream. The device holds
    the entry being read and the next one only: with layer-wise
    recomputation every entry is read twice per reverse chunk (the forward,
    then the layer's recomputation in the backward), and holding each from
    its first read to its second held every attention layer's output for the
    chunk (1.5 GB at Qwen3.5-27B's depth and 8,192 positions). The order of
    reads is the same in every chunk: it is learned from the first chunk the
    reverse pass reads, and each read starts the copy of the next.

    Under context parallelism (`ranks`) the outputs are the same on every
    rank, so only the rank that holds a chunk keeps its entries; the others
    note that it did (`elsewhere`), and the reverse pass broadcasts them
    from there (`partials.kept_or_merged`). In a round only the
    chunk's rank computes them, keeps them (`keep_round`) and reads them."""

    def __init__(self, device: torch.device, ranks: Ranks | None = None) -> None:
        self.device = device
        self.ranks = ranks
        self.copier = HostCopier(device)
        self.entries: dict[tuple[int, int], Landing] = {}
        self.elsewhere: set[tuple[int, int]] = set()  # entries the chunk's rank keeps (context parallelism)
        self.arriving: dict[tuple[int, int], Arrival] = {}  # the next reads' entries, on their way
        self.order: list[int] = []  # slots in the order a reverse chunk reads them (learned)
        self.learned = False
        self.reads = 0  # in the chunk being run
        self.refused = False

    def keep(self, slot: int, offset: int, out: torch.Tensor, lse: torch.Tensor, owner: int = 0) -> None:
        """Keep an entry; under context parallelism on `owner` only (the
        chunk's rank), which tells the others whether it did: a rank that
        read an entry where another recomputed it would skip collectives
        the other calls."""
        here = self.ranks is None or self.ranks.rank == owner
        fits = here and self._room_for((out, lse), offset)
        if self.ranks is not None:
            fits = bool(self.ranks.ints([fits], self.device)[owner][0])
        if fits and here:
            self.entries[slot, offset] = self.copier.to_host((out, lse))
        elif fits:
            self.elsewhere.add((slot, offset))

    def keep_round(self, slot: int, offset: int, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Keep this rank's entry of a round (context parallelism), where
        every rank of the round has room for its own: all or none, so that
        the reverse pass's round reads them, or attends, on every rank alike."""
        if all(room for (room,) in self.ranks.ints([self._room_for((out, lse), offset)], self.device)):
            self.entries[slot, offset] = self.copier.to_host((out, lse))

    def _room_for(self, tensors: tuple[torch.Tensor, ...], offset: int) -> bool:
        """Whether copying `tensors` leaves `HOST_RESERVE` of the host's memory available (warns once when not)."""
        new_bytes = self.copier.host_bytes_to_take(tensors)
        available, total = host_memory()
        if new_bytes and available - new_bytes < HOST_RESERVE * total:
            if not self.refused:
                log.warning("longstraw: host memory is short (%.1f of %.1f GB available): attention outputs from "
                            "position %d on are recomputed in the reverse pass", available / 1e9, total / 1e9, offset)
                self.refused = True
            return False
        return True

    def has(self, slot: int, offset: int) -> bool:
        """Whether the capture kept the entry, here or on its chunk's rank."""
        return (slot, offset) in self.entries or (slot, offset) in self.elsewhere

    def prefetch(self, offset: int) -> None:
        """The reverse pass starts the chunk at `offset`: start bringing its first read back."""
        self.reads = 0
        self._start(offset)

    def get(self, slot: int, offset: int) -> tuple[torch.Tensor, ...] | None:
        """The kept entry, in new device memory (each read its own copy),
        or None where nothing was kept."""
        key = (slot, offset)
        if key not in self.entries:
            return None
        if not self.learned:
            self.order.append(slot)
        arrival = self.arriving.pop(key, None) or self.copier.to_device(self.entries[key])
        self.reads += 1
        self._start(offset)
        return arrival.wait()

    def drop(self, offset: int, length: int) -> None:
        """Forget the entries of the chunk `[offset, offset+length)` once the
        reverse pass is done with it (a chunk that ends the left padding keys
        its entries by the first real position, `_attention_after_padding`)."""
        self.learned = self.learned or bool(self.order)

        def ours(key: tuple[int, int]) -> bool:
            return offset <= key[1] < offset + length

        for key in [k for k in self.arriving if ours(k)]:
            self.arriving.pop(key).wait()  # never read: its memory is reused only after the copy into it
        for key in [k for k in self.entries if ours(k)]:
            del self.entries[key]
        self.elsewhere = {k for k in self.elsewhere if not ours(k)}

    def close(self) -> None:
        self.entries, self.arriving, self.elsewhere = {}, {}, set()
        self.copier.close()

    def _start(self, offset: int) -> None:
        """Start copying the entry of the chunk's next read, where the order is known."""
        if not self.learned or self.reads >= len(self.order):
            return
        key = (self.order[self.reads], offset)
        if key in self.entries and key not in self.arriving:
            self.arriving[key] = self.copier.to_device(self.entries[key])


PINNED_SLAB = 1 << 30
"""Bytes of pinned host memory `HostCopier` asks for at a time: PyTorch's
pinned allocator rounds every block up to a power of two, so one block per
100 MB attention output would take 128 MB."""


_ALIGN = 512


@dataclasses.dataclass
class Landing:
    """Host copies of device tensors (on CUDA, written by the copier's side
    stream, so a copy back issued there later reads them complete)."""

    host: tuple[torch.Tensor, ...]


@dataclasses.dataclass
class Arrival:
    """Device tensors being filled from a `Landing`; `wait` makes the caller's stream wait for them."""

    tensors: tuple[torch.Tensor, ...]
    done: "torch.cuda.Event | None"

    def wait(self) -> tuple[torch.Tensor, ...]:
        if self.done is not None:
            torch.cuda.current_stream(self.tensors[0].device).wait_event(self.done)
        return self.tensors


class HostCopier:
    """Copies between the device and host memory that do not hold up the
    compute stream. On CUDA the host side is pinned memory, handed out of
    `PINNED_SLAB`-sized blocks, and the copies run on a side stream ordered
    by events. A pageable copy instead blocks the thread that issues it and,
    issued from a worker thread, still held up the compute thread's launches:
    each 100 MB attention output stalled an H200 for ~38 ms. Off CUDA, plain copies."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.slabs: list[torch.Tensor] = []
        self.used = PINNED_SLAB  # bytes handed out of the last slab: a first copy takes a new one

    def host_bytes_to_take(self, tensors: tuple[torch.Tensor, ...]) -> int:
        """New host memory copies of `tensors` would take (whole slabs on CUDA)."""
        sizes = [t.numel() * t.element_size() for t in tensors]
        if self.stream is None:
            return sum(sizes)
        taken, used = 0, self.used
        for nbytes in sizes:
            if nbytes > PINNED_SLAB:
                taken += nbytes
            elif _aligned(used) + nbytes > PINNED_SLAB:
                taken, used = taken + PINNED_SLAB, nbytes
            else:
                used = _aligned(used) + nbytes
        return max(taken - reusable_pinned_bytes(), 0)

    def to_host(self, tensors: tuple[torch.Tensor, ...]) -> Landing:
        """Host copies of `tensors` as they are now (the side stream copies
        a device copy, so later in-place writes cannot reach it), with
        their strides: flash attention's output is a transposed layout, and
        the backward kernels are handed the kept output in place of it."""
        tensors = tuple(t.detach().clone() for t in tensors)
        if self.stream is None:
            return Landing(tensors)
        ready = _event()
        host = tuple(self._pinned(t) for t in tensors)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            for target, source in zip(host, tensors):
                target.copy_(source, non_blocking=True)
                source.record_stream(self.stream)  # its memory is not reused before the copy is done
            return Landing(host)

    def to_device(self, landing: Landing) -> Arrival:
        """Device tensors, allocated on the caller's stream, that the side
        stream fills from `landing` (after its copy to the host: the same stream)."""
        if self.stream is None:
            return Arrival(tuple(t.clone() for t in landing.host), None)
        tensors = tuple(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=self.device) for t in landing.host)
        allocated = _event()
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(allocated)
            for target, source in zip(tensors, landing.host):
                target.copy_(source, non_blocking=True)
            return Arrival(tensors, _event())

    def close(self) -> None:
        """Give the slabs back (to PyTorch's pinned cache, which keeps them for the next step)."""
        self.slabs, self.used = [], PINNED_SLAB

    def _pinned(self, like: torch.Tensor) -> torch.Tensor:
        """Pinned memory laid out like `like` (dense: a clone's layout)."""
        nbytes = like.numel() * like.element_size()
        if nbytes > PINNED_SLAB:
            return torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, pin_memory=True)
        start = _aligned(self.used)
        if start + nbytes > PINNED_SLAB:
            self.slabs.append(torch.empty(PINNED_SLAB, dtype=torch.uint8, pin_memory=True))
            start = 0
        self.used = start + nbytes
        return self.slabs[-1][start:start + nbytes].view(like.dtype).as_strided(like.shape, like.stride())


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _event() -> "torch.cuda.Event":
    """An event at the current stream's position."""
    event = torch.cuda.Event()
    event.record()
    return event


def reusable_pinned_bytes() -> int:
    """Pinned host memory PyTorch's allocator holds cached and free (host
    memory that is not available to the system, but is to a new slab)."""
    if not torch.cuda.is_available():
        return 0
    stats = torch.cuda.host_memory_stats()
    return max(stats.get("allocated_bytes.current", 0) - stats.get("active_bytes.current", 0), 0)


def host_memory() -> tuple[int, int]:
    """(available, total) bytes of host memory from /proc/meminfo; (0, 0) where there is none."""
    try:
        with open("/proc/meminfo") as f:
            fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()}
    except (OSError, ValueError, IndexError):
        return 0, 0
    return fields.get("MemAvailable", 0), fields.get("MemTotal", 0)
