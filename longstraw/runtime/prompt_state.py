"""Captured prompt state at run time: the buffers of a `StateSlot`, and each step's view of them.

A `sequence` slot gets one buffer holding the prompt positions `[0, s)`
followed by scratch room for the positions of the step being run, so a step
attends to `buffer[:o + n]` without copying. The prompt region is written
once, during capture; branch replays only write the scratch region.

A `carry` slot: the capture keeps the latest on the device; in exact mode
the earlier chunk boundaries are kept too, for the reverse pass restarts
each chunk from its own (on a GPU in pinned host memory: at Qwen3.5-27B
shapes they are 151 MB per boundary, 7 GB for 393K positions in chunks of
8192). Branches read the one at `s` and never write it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import TYPE_CHECKING

import torch
from torch._subclasses.fake_tensor import FakeTensor

from longstraw.errors import InputError, LongStrawError, module_path

if TYPE_CHECKING:
    from longstraw.analysis.slots import StateSlot
    from longstraw.parallel.shards import PromptShard
    from longstraw.runtime.carry import SpanGraphs
    from longstraw.runtime.host_offload import HostAttentionOutputs

from longstraw.analysis.slots import SlotKind


@dataclasses.dataclass(frozen=True)
class FiniteCheck:
    """Whether each of a captured state's tensors (of `slots`) is finite, on
    the device: launched after a capture, read by `nonfinite` once for every
    capture of a forward, so that a call waits on the device once for them."""

    slots: tuple[StateSlot, ...]
    finite: torch.Tensor  # [len(slots)] bool


def nonfinite(checks: list[FiniteCheck]) -> InputError | None:
    """NaN or Inf in a captured state would poison every branch: the error
    naming the first such slot's layer, or None. One device sync for all `checks`."""
    if not checks:
        return None
    finite = torch.cat([check.finite for check in checks])
    if bool(finite.all()):
        return None
    first = int((~finite).nonzero()[0, 0])
    slot = [slot for check in checks for slot in check.slots][first]
    return InputError(
        f"the captured prompt state {slot.index} ({slot.reason}) in `{module_path(slot.node) or slot.node.name}` "
        "holds NaN or Inf: the prompt's forward overflowed or the weights are not finite. Every branch would "
        "read it; check the inputs and weights (or set options={'check_finite': False} to skip this check)."
    )


class PromptState:
    """Buffers and carries for all slots of one call, and (exact mode) their gradients."""

    def __init__(
        self, slots: list[StateSlot], capacity: int, prefix_len: int, device: torch.device, verify: bool = False,
        boundaries: bool = True, span_graphs: "SpanGraphs | None" = None,
        attention_outputs: "HostAttentionOutputs | None" = None, active: Collection[int] | None = None,
        shard: "PromptShard | None" = None,
    ) -> None:
        self.slots = slots  # every slot of the plan, indexed by `StateSlot.index`; `active` ones get memory
        self.span_graphs = span_graphs  # CUDA graphs of carried operators' spanwise backward (carry.py)
        self.attention_outputs = attention_outputs  # exact mode: the capture's attention outputs, for the reverse pass
        self.prefix_len = prefix_len
        self.shard = shard  # context parallelism: the sequence buffers hold this rank's share of the prompt only
        self.verify = verify
        self.device = device
        self.boundaries = boundaries  # keep the carries at every chunk boundary (exact mode's reverse pass)
        self.offload = boundaries and boundaries_on_host(device)
        self.buffers: dict[int, torch.Tensor] = {}
        self.carries: dict[int, dict[int, torch.Tensor]] = {}
        for slot in slots:
            if active is not None and slot.index not in active:
                continue
            if slot.kind == SlotKind.SEQUENCE:
                shape = list(slot.shape)
                shape[slot.token_dim] = capacity if shard is None else shard.size
                if verify and slot.dtype.is_floating_point:
                    buffer = torch.full(shape, float("nan"), dtype=slot.dtype, device=device)
                else:
                    buffer = torch.empty(shape, dtype=slot.dtype, device=device)
                self.buffers[slot.index] = buffer
            else:
                self.carries[slot.index] = {0: torch.zeros(slot.shape, dtype=slot.dtype, device=device)}
        self.grads: dict[int, torch.Tensor] | None = None
        self.carry_grads: dict[int, dict[int, torch.Tensor]] | None = None
        # context parallelism: a `verify_state` failure on this rank's share, raised on every rank together
        # (`context_parallel.raise_together`) where the runtime checks, not mid-step, where the others would wait
        self.failure: LongStrawError | None = None

    def allocate_grads(self) -> None:
        """d(state) of the prompt, accumulated by replays in backward."""
        self.grads = {i: torch.zeros_like(self.prompt_part(self.slots[i])) for i in self.buffers}
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
            # the planner's simulation skips chunks (`ChunkSchedule.sampled`): the latest carry has the shape
            position = max(carries)
        value = carries[position]
        if value.device != self.device and not has_values(value):  # a simulation: the shape is all there is
            return torch.empty(value.shape, dtype=value.dtype, device=self.device)
        return value.to(self.device, non_blocking=True)

    def prompt_part(self, slot: StateSlot) -> torch.Tensor:
        """The prompt positions of a sequence slot held here: `[0, prefix_len)`,
        or this rank's share under context parallelism."""
        length = self.prefix_len if self.shard is None else self.shard.size
        return self.buffers[slot.index].narrow(slot.token_dim, 0, length)

    def seed(self, slot: StateSlot, offset: int, length: int) -> torch.Tensor | None:
        """The accumulated gradient of what a prompt chunk `[offset, offset+length)`
        produced. A carry's gradient is handed over once: the reverse pass
        reaches each chunk once, and keeping them all would grow with P.
        Under context parallelism every rank replays the chunk: its owner
        broadcasts the chunk's d(state) (in a round only the owner replays
        it: `round_seed`)."""
        if slot.kind == SlotKind.CARRY:
            return self.carry_grads[slot.index].pop(offset + length, None)
        if self.shard is None:
            return self.grads[slot.index].narrow(slot.token_dim, offset, length)
        return self.shard.broadcast_chunk(self.grads[slot.index], slot.token_dim, offset, length)

    def round_seed(self, slot: StateSlot, round_: ChunkRound) -> torch.Tensor | None:
        """`seed` for this rank's chunk of a reverse-pass round: its d(state)
        is its own; the carry's gradient at the round's end (every rank has
        it) seeds the last chunk's carry, and zeros the others' (theirs
        pass on inside the round, `carry._round_grads`): a seed on one rank
        and none on another would run the carried operator's backward, and
        its collectives, on one rank alone (a last layer's carry that
        nothing in the step reads)."""
        offset, length = round_.chunks[round_.index]
        if slot.kind == SlotKind.CARRY:
            last = self.carry_grads[slot.index].pop(round_.chunks[-1][0] + round_.chunks[-1][1], None)
            return last if last is None or round_.index == len(round_.chunks) - 1 else torch.zeros_like(last)
        return self.grads[slot.index].narrow(slot.token_dim, self.shard.held_before(offset), length)

    def unwritten(self) -> StateSlot | None:
        """`Options.verify_state`: a slot with a prompt position the capture never wrote."""
        for slot in self.slots:
            buffer = self.buffers.get(slot.index)
            if buffer is not None and buffer.is_floating_point():
                if bool(self.prompt_part(slot).isnan().any()):
                    return slot
        return None

    def finite_check(self) -> FiniteCheck | None:
        """`Options.check_finite`, launched: whether the captured state (the
        prompt part of the buffers, the carries at the prompt's end that
        branches read) is finite, read later (`nonfinite`); None without values."""
        tensors = [(slot, self.prompt_part(slot)) for slot in self.slots if slot.index in self.buffers]
        # the carries branches read (a non-finite earlier boundary reaches the state after it)
        tensors += [(slot, self.carries[slot.index][self.prefix_len]) for slot in self.slots if slot.index in self.carries]
        if not tensors or not has_values(tensors[0][1]):
            return None
        return FiniteCheck(tuple(slot for slot, _ in tensors), torch.stack([t.isfinite().all() for _, t in tensors]))

    def device_bytes(self) -> int:
        """Bytes of the buffers and carries held on the state's device (not
        the chunk-boundary carries offloaded to the host)."""
        tensors = [*self.buffers.values(), *(c for carries in self.carries.values() for c in carries.values())]
        return sum(t.numel() * t.element_size() for t in tensors if t.device == self.device)

    def release(self) -> None:
        if self.attention_outputs is not None:
            self.attention_outputs.close()
        self.buffers, self.carries, self.span_graphs, self.attention_outputs = {}, {}, None, None
        self.grads = self.carry_grads = None


@dataclasses.dataclass(frozen=True)
class ChunkRound:
    """Under context parallelism, steps the ranks run at once, one each,
    meeting in collectives: prompt chunks in the capture and the reverse
    pass, `chunks` (offset, length) in position order, one run of
    positions; or (`branches`) the group's branches, each rank its own row
    over the same positions (every chunk `(s, R)`), none reading another's
    keys. `owners` the rank of each chunk; `index` this rank's."""

    chunks: tuple[tuple[int, int], ...]
    owners: tuple[int, ...]
    index: int
    branches: bool = False

    @property
    def before(self) -> int:
        """How many of the round's chunks this rank's queries see whole:
        those before its own in a prompt round, none among branches."""
        return 0 if self.branches else self.index

    def sees(self, j: int) -> bool:
        """Whether chunk `j`'s queries see this rank's own keys: its own
        chunk, and in a prompt round the later chunks."""
        return j == self.index or (not self.branches and j > self.index)

    @property
    def start(self) -> int:
        """The round's first position."""
        return self.chunks[0][0]

    @property
    def longest(self) -> int:
        """The longest chunk's length: what the round's gathers pad to."""
        return max(n for _, n in self.chunks)


@dataclasses.dataclass
class StepContext:
    """What a step graph needs besides tensors: where its positions start,
    how many there are, and the state it reads and writes; under context
    parallelism's rounds, the `round` it is one step of."""

    state: PromptState
    offset: int
    length: int
    grad_enabled: bool
    round: ChunkRound | None = None
    rows: int = 1
    """The branch rows the step holds (`Options.branch_rows`): each reads the
    prompt's state, and the claimed operators store their own positions
    row by row (`ArchitecturePass.branches_batched`)."""
    unread_from: tuple[int, ...] | None = None
    """Per row of a branch step, the position from which the loss provably
    reads nothing (`analysis/read_cut.py`); None where nothing is proved.
    An operator may compute those positions in any finite way: no output
    the loss reads depends on them, and their gradient is zero."""

    # sequence slots

    def write(self, slot: int, value: torch.Tensor) -> torch.Tensor:
        """Store the step's new positions of a slot; returns `value` unchanged.
        Under context parallelism only the owner of a prompt chunk stores it
        (the sharded attention reads a step's own keys from its arguments);
        a step of several branch rows stores nothing here (the scratch room
        holds one row), its claimed operators store each row before reading."""
        if self.rows > 1:
            return value
        token_dim = self.state.slots[slot].token_dim
        offset, shard = self.offset, self.state.shard
        if shard is not None:
            if offset >= self.state.prefix_len or shard.owner(offset) != shard.rank:
                return value
            offset = shard.held_before(offset)
        region = self.state.buffers[slot].narrow(token_dim, offset, self.length)
        if self.state.verify and self.offset < self.state.prefix_len:
            self._verify_write(slot, region, value)
        region.copy_(value.detach())
        return value

    def _verify_write(self, slot: int, region: torch.Tensor, value: torch.Tensor) -> None:
        """`Options.verify_state`: the capture writes only unwritten (NaN)
        positions; a replay of a prompt chunk writes exactly what is there."""
        where = f"{self.state.slots[slot].label()}, positions [{self.offset}, {self.offset + self.length})"
        failure = None
        if not self.grad_enabled and not bool(region.isnan().all()):
            failure = LongStrawError(f"verify_state: the prompt capture wrote {where} twice")
        if self.grad_enabled and not torch.equal(region, value.detach()):
            failure = LongStrawError(f"verify_state: the reverse pass recomputed {where} with other values than the capture")
        if failure is not None and self.state.shard is None:
            raise failure
        self.state.failure = self.state.failure or failure

    def visible(self, slot: int) -> torch.Tensor:
        """All positions up to the end of this step: `[0, offset + length)`."""
        self._refuse_on_a_shard(slot)
        token_dim = self.state.slots[slot].token_dim
        return self.state.buffers[slot].narrow(token_dim, 0, self.offset + self.length)

    def accumulate_grad(self, slot: int, grad: torch.Tensor, start: int = 0) -> None:
        """Add the gradient of positions `[start, start + len)` into d(state);
        the part at or after this step's own positions is not state."""
        self._refuse_on_a_shard(slot)  # a position is not a buffer index there (`accumulate_shard_grad`)
        grads = self.state.grads
        token_dim = self.state.slots[slot].token_dim
        length = min(grad.shape[token_dim], self.offset - start)
        if grads is None or length <= 0:
            return
        grads[slot].narrow(token_dim, start, length).add_(grad.narrow(token_dim, 0, length))

    def _refuse_on_a_shard(self, slot: int) -> None:
        """Reading or differentiating the state by prompt position needs every
        earlier position on this rank, which context parallelism does not keep."""
        if self.state.shard is not None:
            raise LongStrawError(
                f"context parallelism: {self.state.slots[slot].label()} is read by an operator that needs every "
                "earlier position on this rank, but a sharded prompt holds only this rank's share; the built-in "
                "passes read it through longstraw.parallel.context_parallel's sharded attention. Run this model without "
                "context_parallel, or make the pass's step merge partials over the shards as those do."
            )

    def accumulate_shard_grad(self, slot: int, grad: torch.Tensor, local: int) -> None:
        """Context parallelism: add the gradient of this rank's share at
        buffer indices `[local, local + len)` (positions before the step)
        into d(state), which is sharded like the state."""
        if self.state.grads is not None:
            token_dim = self.state.slots[slot].token_dim
            self.state.grads[slot].narrow(token_dim, local, grad.shape[token_dim]).add_(grad)

    # carry slots

    @property
    def prompt_round(self) -> ChunkRound | None:
        """`round` where it is one of prompt chunks (whose carried operators
        pass the carry from chunk to chunk); None among branches, which
        each start from the prompt's carry."""
        return self.round if self.round is not None and not self.round.branches else None

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
        """Add the gradient of the carry this step started from (in a round,
        the round's: `carry._round_grads`). Kept as a copy, like the carry:
        it is often a slice of the gradient of a chunk-sized tensor (a conv
        tail's, of `cat([tail, x])`)."""
        grads = self.state.carry_grads
        start = self.offset if self.prompt_round is None else self.round.start
        if grads is None or grad is None or start == 0:
            return
        at = grads[slot]
        at[start] = grad.clone() if start not in at else at[start] + grad


def boundaries_on_host(device: torch.device) -> bool:
    """Where exact mode keeps its earlier chunk-boundary carries: in pinned
    host memory on a GPU (the runtime and the memory planner both ask)."""
    return torch.device(device).type == "cuda"


def _on_host(value: torch.Tensor) -> torch.Tensor:
    """An asynchronous copy in pinned host memory (plain memory for shape-only tensors)."""
    pinned = has_values(value) and torch.cuda.is_available()
    host = torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=pinned)
    return host.copy_(value, non_blocking=pinned)


def has_values(tensor: torch.Tensor) -> bool:
    """False on meta and fake tensors: shape-only runs (meta models,
    `longstraw.explain`'s simulation), where value checks cannot run."""
    return tensor.device.type != "meta" and not isinstance(tensor, FakeTensor)


def write_state(ctx: StepContext, slot: int, value: torch.Tensor) -> torch.Tensor:
    """Graph-level call emitted after every captured node (see stepgraph.py)."""
    return ctx.write(slot, value)
