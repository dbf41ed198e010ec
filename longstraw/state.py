"""Captured prompt state: what later tokens need, where it lives at run time.

Two kinds of `StateSlot` are decided at compile time:

- `sequence`: one tensor per position (attention K/V), the cut chosen by
  `boundary.py`. At run time it gets one buffer holding the prompt
  positions `[0, s)` followed by scratch room for the positions of the step
  being run, so a step attends to `buffer[:o + n]` without copying. The
  prompt region is written once, during capture; branch replays only write
  the scratch region.
- `carry`: a fixed-size state carried from one position range to the next
  (a recurrent matrix, a convolution's last inputs), produced by a claimed
  operator. At run time the capture keeps the latest on the device; in
  exact mode the earlier chunk boundaries are kept too, for the reverse
  pass restarts each chunk from its own (on a GPU in pinned host memory:
  at Qwen3.5-27B shapes they are 151 MB per boundary, 7 GB for 393K
  positions in chunks of 8192). Branches read the one at `s` and never
  write it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import logging
import math
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

from .errors import LongStrawError, module_path

if TYPE_CHECKING:
    from .carry import SpanGraphs

log = logging.getLogger("longstraw.state")


class SlotKind(enum.StrEnum):
    """How a slot's state grows: per prompt position, or a fixed-size carry."""

    SEQUENCE = "sequence"
    CARRY = "carry"


@dataclasses.dataclass(frozen=True)
class StateSlot:
    """One captured tensor: a graph node and the layout of its state."""

    index: int
    kind: SlotKind
    node: fx.Node  # sequence: the captured node; carry: the claimed operator
    token_dim: int | None  # sequence slots only
    batch_dim: int | None
    shape: tuple[int, ...]  # with batch 1; a sequence slot's token dim holds the traced length
    dtype: torch.dtype
    reason: str  # which operator needs it, for summaries and reports

    def bytes_per_position(self) -> int:
        if self.kind != SlotKind.SEQUENCE:
            return 0
        return math.prod(s for i, s in enumerate(self.shape) if i != self.token_dim) * self.dtype.itemsize

    def fixed_bytes(self) -> int:
        if self.kind != SlotKind.CARRY:
            return 0
        return math.prod(self.shape) * self.dtype.itemsize

    def label(self) -> str:
        """The slot and the layer it belongs to, for messages."""
        return f"state slot {self.index} ({self.reason}) of `{module_path(self.node) or self.node.name}`"


class PromptState:
    """Buffers and carries for all slots of one call, and (exact mode) their gradients."""

    def __init__(
        self, slots: list[StateSlot], capacity: int, prefix_len: int, device: torch.device, verify: bool = False,
        boundaries: bool = True, span_graphs: "SpanGraphs | None" = None,
        attention_outputs: "HostAttentionOutputs | None" = None,
    ) -> None:
        self.slots = slots
        self.span_graphs = span_graphs  # CUDA graphs of carried operators' spanwise backward (carry.py)
        self.attention_outputs = attention_outputs  # exact mode: the capture's attention outputs, for the reverse pass
        self.prefix_len = prefix_len
        self.verify = verify
        self.device = device
        self.boundaries = boundaries  # keep the carries at every chunk boundary (exact mode's reverse pass)
        self.offload = boundaries and boundaries_on_host(device)
        self.buffers: dict[int, torch.Tensor] = {}
        self.carries: dict[int, dict[int, torch.Tensor]] = {}
        for slot in slots:
            if slot.kind == SlotKind.SEQUENCE:
                shape = list(slot.shape)
                shape[slot.token_dim] = capacity
                if verify and slot.dtype.is_floating_point:
                    buffer = torch.full(shape, float("nan"), dtype=slot.dtype, device=device)
                else:
                    buffer = torch.empty(shape, dtype=slot.dtype, device=device)
                self.buffers[slot.index] = buffer
            else:
                self.carries[slot.index] = {0: torch.zeros(slot.shape, dtype=slot.dtype, device=device)}
        self.grads: dict[int, torch.Tensor] | None = None
        self.carry_grads: dict[int, dict[int, torch.Tensor]] | None = None

    def allocate_grads(self) -> None:
        """d(state) of the prompt, accumulated by replays in backward."""
        self.grads = {
            i: torch.zeros_like(buf.narrow(self.slots[i].token_dim, 0, self.prefix_len))
            for i, buf in self.buffers.items()
        }
        self.carry_grads = {i: {} for i in self.carries}

    def keep_carry(self, slot: int, position: int, value: torch.Tensor) -> None:
        """Keep a carry the capture produced at `position` (a copy: it is often
        a slice of a chunk-sized tensor, a conv tail, and a view would keep
        that storage alive). The one it supersedes is dropped, or kept as a
        boundary (on the host on a GPU)."""
        carries = self.carries[slot]
        latest = max(carries)
        if not self.boundaries:
            del carries[latest]
        elif self.offload:
            carries[latest] = _on_host(carries[latest])
        carries[position] = value.detach().clone()

    def carry_at(self, slot: int, position: int) -> torch.Tensor:
        """The carry at a chunk boundary, on the device (a host copy comes back asynchronously)."""
        carries = self.carries[slot]
        if position not in carries and not has_values(next(iter(carries.values()))):
            # the planner's simulation skips chunks (`simulation.sampled_chunks`): the latest carry has the shape
            position = max(carries)
        value = carries[position]
        if value.device != self.device and not has_values(value):  # a simulation: the shape is all there is
            return torch.empty(value.shape, dtype=value.dtype, device=self.device)
        return value.to(self.device, non_blocking=True)

    def seed(self, slot: StateSlot, offset: int, length: int) -> torch.Tensor | None:
        """The accumulated gradient of what a prompt chunk `[offset, offset+length)`
        produced. A carry's gradient is handed over once: the reverse pass
        reaches each chunk once, and keeping them all would grow with P."""
        if slot.kind == SlotKind.SEQUENCE:
            return self.grads[slot.index].narrow(slot.token_dim, offset, length)
        return self.carry_grads[slot.index].pop(offset + length, None)

    def unwritten(self) -> StateSlot | None:
        """`Options.verify_state`: a slot with a prompt position the capture never wrote."""
        for slot in self.slots:
            buffer = self.buffers.get(slot.index)
            if buffer is not None and buffer.is_floating_point():
                if bool(buffer.narrow(slot.token_dim, 0, self.prefix_len).isnan().any()):
                    return slot
        return None

    def release(self) -> None:
        if self.attention_outputs is not None:
            self.attention_outputs.close()
        self.buffers, self.carries, self.span_graphs, self.attention_outputs = {}, {}, None, None
        self.grads = self.carry_grads = None


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

    Copies run in `HostCopier`'s worker, off the compute stream: the capture
    hands each entry over and goes on, and the reverse pass `prefetch`es a
    chunk's entries when it starts the chunk, so they arrive while the
    chunk's first layers run."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copier = HostCopier(device)
        self.entries: dict[tuple[int, int], Future] = {}  # -> the host copies (out, lse)
        self.layouts: dict[tuple[int, int], tuple[tuple[torch.Size, torch.dtype], ...]] = {}
        self.arriving: dict[tuple[int, int], Arrival] = {}  # prefetched for the reverse chunk about to run
        # fetched for the reverse chunk being run: the forward's, for its recomputation
        self.fetched: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self.refused = False

    def keep(self, slot: int, offset: int, out: torch.Tensor, lse: torch.Tensor) -> None:
        nbytes = out.numel() * out.element_size() + lse.numel() * lse.element_size()
        available, total = host_memory()
        if available - nbytes - self.copier.pending_bytes < HOST_RESERVE * total:
            if not self.refused:
                log.warning("longstraw: host memory is short (%.1f of %.1f GB available): attention outputs from "
                            "position %d on are recomputed in the reverse pass", available / 1e9, total / 1e9, offset)
                self.refused = True
            return
        # pageable memory, exact sizes: pinned blocks are rounded up to a power of two (72 GB would pin 92)
        self.entries[slot, offset] = self.copier.to_host((out, lse))
        self.layouts[slot, offset] = ((out.shape, out.dtype), (lse.shape, lse.dtype))

    def prefetch(self, offset: int) -> None:
        """Start bringing a prompt chunk's entries back to the device."""
        for key in [k for k in self.entries if k[1] == offset and k not in self.fetched]:
            self.arriving[key] = self.copier.to_device(self.entries[key], self.layouts[key])

    def get(self, slot: int, offset: int) -> tuple[torch.Tensor, ...] | None:
        """The kept entry on the device; asked again (layer-wise
        recomputation), a copy of the same, by the same operator as the
        first time (selective checkpointing checks that recomputation
        dispatches what the forward did)."""
        key = (slot, offset)
        if key in self.fetched:
            return tuple(t.to(self.device, copy=True) for t in self.fetched.pop(key))
        if key not in self.entries:
            return None
        arrival = self.arriving.pop(key, None) or self.copier.to_device(self.entries[key], self.layouts[key])
        self.fetched[key] = arrival.wait()
        return tuple(t.to(self.device, copy=True) for t in self.fetched[key])

    def drop(self, offset: int) -> None:
        """Forget a chunk's entries once the reverse pass is done with it."""
        for key in [k for k in self.arriving if k[1] == offset]:
            self.arriving.pop(key).wait()  # the worker may still be filling them: free them after it
        for table in (self.entries, self.layouts, self.fetched):
            for key in [k for k in table if k[1] == offset]:
                del table[key]

    def close(self) -> None:
        for arrival in self.arriving.values():
            arrival.wait()
        self.entries, self.layouts, self.arriving, self.fetched = {}, {}, {}, {}
        self.copier.close()


HOST_COPIES_IN_FLIGHT = 2 << 30
"""Device bytes `HostCopier` lets wait for their copy to the host before the caller waits."""


@dataclasses.dataclass
class Arrival:
    """Device tensors a `HostCopier` worker is filling; `wait` makes the
    caller's stream wait for them."""

    tensors: tuple[torch.Tensor, ...]
    done: Future  # the worker's copy, resolved to its event (None off CUDA)

    def wait(self) -> tuple[torch.Tensor, ...]:
        event = self.done.result()
        if event is not None:
            torch.cuda.current_stream(self.tensors[0].device).wait_event(event)
        return self.tensors


class HostCopier:
    """Copies between the device and pageable host memory in one worker
    thread on a side stream. A pageable copy blocks the thread that issues
    it until it is done; issued from the compute thread, each copy of a
    100 MB attention output stalled the GPU for 38 ms. Device tensors handed
    to the host stay referenced by the worker until their copy is done, so
    the caching allocator cannot reuse them early; `HOST_COPIES_IN_FLIGHT`
    bounds what they hold."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="longstraw-host-copy")
        self.in_flight: collections.deque[tuple[Future, int]] = collections.deque()  # (copy, bytes), oldest first

    @property
    def pending_bytes(self) -> int:
        """Bytes handed to the host and not yet copied there."""
        return sum(nbytes for future, nbytes in self.in_flight if not future.done())

    def to_host(self, tensors: tuple[torch.Tensor, ...]) -> Future:
        """Host copies of `tensors` as they are now (the worker copies a
        device copy, so later in-place writes cannot reach it)."""
        tensors = tuple(t.detach().clone() for t in tensors)
        ready = self._event()

        def copy() -> tuple[torch.Tensor, ...]:
            with self._on_side_stream(ready):
                return tuple(t.to("cpu", copy=True) for t in tensors)

        future = self.worker.submit(copy)
        self.in_flight.append((future, sum(t.numel() * t.element_size() for t in tensors)))
        while self.in_flight and (self.in_flight[0][0].done() or self.pending_bytes > HOST_COPIES_IN_FLIGHT):
            self.in_flight.popleft()[0].result()  # waits for the oldest, and raises a failed copy's error here
        return future

    def to_device(self, source: Future, layouts: tuple[tuple[torch.Size, torch.dtype], ...]) -> Arrival:
        """Device tensors, allocated on the caller's stream, that the worker
        fills from `source`'s host tensors once they are there."""
        tensors = tuple(torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in layouts)
        allocated = self._event()

        def copy() -> "torch.cuda.Event | None":
            with self._on_side_stream(allocated):
                for target, host in zip(tensors, source.result()):
                    target.copy_(host)
                return self._event()

        return Arrival(tensors, self.worker.submit(copy))

    def close(self) -> None:
        self.worker.shutdown(wait=False, cancel_futures=True)

    def _event(self) -> "torch.cuda.Event | None":
        """An event at the current stream's position (None off CUDA)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    @contextlib.contextmanager
    def _on_side_stream(self, after: "torch.cuda.Event | None") -> Iterator[None]:
        if self.stream is None:
            yield
            return
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(after)
            yield


def host_memory() -> tuple[int, int]:
    """(available, total) bytes of host memory from /proc/meminfo; (0, 0) where there is none."""
    try:
        with open("/proc/meminfo") as f:
            fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()}
    except (OSError, ValueError, IndexError):
        return 0, 0
    return fields.get("MemAvailable", 0), fields.get("MemTotal", 0)


@dataclasses.dataclass
class StepContext:
    """What a step graph needs besides tensors: where its positions start,
    how many there are, and the state it reads and writes."""

    state: PromptState
    offset: int
    length: int
    grad_enabled: bool

    # sequence slots

    def write(self, slot: int, value: torch.Tensor) -> torch.Tensor:
        """Store the step's new positions of a slot; returns `value` unchanged."""
        token_dim = self.state.slots[slot].token_dim
        region = self.state.buffers[slot].narrow(token_dim, self.offset, self.length)
        if self.state.verify and self.offset < self.state.prefix_len:
            self._verify_write(slot, region, value)
        region.copy_(value.detach())
        return value

    def _verify_write(self, slot: int, region: torch.Tensor, value: torch.Tensor) -> None:
        """`Options.verify_state`: the capture writes only unwritten (NaN)
        positions; a replay of a prompt chunk writes exactly what is there."""
        where = f"{self.state.slots[slot].label()}, positions [{self.offset}, {self.offset + self.length})"
        if not self.grad_enabled and not bool(region.isnan().all()):
            raise LongStrawError(f"verify_state: the prompt capture wrote {where} twice")
        if self.grad_enabled and not torch.equal(region, value.detach()):
            raise LongStrawError(f"verify_state: the reverse pass recomputed {where} with other values than the capture")

    def visible(self, slot: int) -> torch.Tensor:
        """All positions up to the end of this step: `[0, offset + length)`."""
        token_dim = self.state.slots[slot].token_dim
        return self.state.buffers[slot].narrow(token_dim, 0, self.offset + self.length)

    def accumulate_grad(self, slot: int, grad: torch.Tensor, start: int = 0) -> None:
        """Add the gradient of positions `[start, start + len)` into d(state);
        the part at or after this step's own positions is not state."""
        grads = self.state.grads
        token_dim = self.state.slots[slot].token_dim
        length = min(grad.shape[token_dim], self.offset - start)
        if grads is None or length <= 0:
            return
        grads[slot].narrow(token_dim, start, length).add_(grad.narrow(token_dim, 0, length))

    # carry slots

    def carry_in(self, slot: int) -> torch.Tensor:
        """The carry at the start of this step (the prompt's, for a branch)."""
        return self.state.carry_at(slot, min(self.offset, self.state.prefix_len))

    def carry_out(self, slot: int, value: torch.Tensor) -> None:
        """Keep the carry at the end of a prompt chunk during the capture;
        branches keep nothing, and the reverse pass recomputes what the
        capture kept."""
        end = self.offset + self.length
        if end <= self.state.prefix_len and not self.grad_enabled:
            self.state.keep_carry(slot, end, value)

    def accumulate_carry_grad(self, slot: int, grad: torch.Tensor | None) -> None:
        """Add the gradient of the carry this step started from. Kept as a
        copy, like the carry: it is often a slice of the gradient of a
        chunk-sized tensor (a conv tail's, of `cat([tail, x])`)."""
        grads = self.state.carry_grads
        if grads is None or grad is None or self.offset == 0:
            return
        at = grads[slot]
        at[self.offset] = grad.clone() if self.offset not in at else at[self.offset] + grad


def boundaries_on_host(device: torch.device) -> bool:
    """Where exact mode keeps its earlier chunk-boundary carries: in pinned
    host memory on a GPU (the runtime and the memory planner both ask)."""
    return torch.device(device).type == "cuda"


def _on_host(value: torch.Tensor) -> torch.Tensor:
    """An asynchronous copy in pinned host memory (plain memory for shape-only tensors)."""
    pinned = has_values(value) and torch.cuda.is_available()
    host = torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=pinned)
    return host.copy_(value, non_blocking=pinned)


def chunk_schedule(prefix_len: int, size: int) -> list[tuple[int, int]]:
    """The prompt chunks `(offset, length)` that capture and the reverse pass
    run (the runtime) and whose boundaries keep carries (the planner)."""
    return [(o, min(size, prefix_len - o)) for o in range(0, prefix_len, size)]


def chunk_count(prefix_len: int, size: int) -> int:
    """`len(chunk_schedule(prefix_len, size))` without building it (the
    planner asks for prompts of any length)."""
    return -(-prefix_len // size)


def has_values(tensor: torch.Tensor) -> bool:
    """False on meta and fake tensors: shape-only runs (meta models,
    `longstraw.explain`'s simulation), where value checks cannot run."""
    return tensor.device.type != "meta" and not isinstance(tensor, FakeTensor)


def write_state(ctx: StepContext, slot: int, value: torch.Tensor) -> torch.Tensor:
    """Graph-level call emitted after every captured node (see stepgraph.py)."""
    return ctx.write(slot, value)
