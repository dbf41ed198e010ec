"""A planned step run on fake tensors, for the memory it would hold.

`simulate_step` runs the planned runtime over one step (prompt capture,
branches, replays, and in exact mode the reverse pass) at the traced sizes
on fake tensors (no memory, no compute) while `_LiveBytes`, a dispatch
mode, samples the bytes of live storages after every operator. Of the
prompt's chunks it runs those whose memory can differ
(`ChunkSchedule.sampled`): the first, and the last two, which see the
most earlier positions; the chunks between hold what those do, so a step
at a million positions costs no more to simulate than one at three
chunks. Under context parallelism (`ranks`) it runs one rank's steps, the
rank with the largest share, with `SimulatedRanks` in place of the group:
the rounds' gathers and partials are allocated as on the device, and
nothing is exchanged; of the rounds it runs the first and the last two.
Flash attention's backward workspace, which fake kernels do not allocate,
is added where it runs (its outputs, allocated before it computes, dK/dV
expanded to the query heads, the float32 dQ accumulator), and kept as a
function of the keys a call reads (`Peak`). The simulation takes its
attention kernels from `longstraw.runtime.kernels.attention.choosing`, as the
device would choose them, and runs fla's Gated DeltaNet and convolution
where a CUDA target would (`fla_families`) through fake entry points that
allocate fla's outputs: `gated_delta_grads` runs on the fake tensors over
the device's spans.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from longstraw.analysis.partition import Partition
from longstraw.codegen.graphs import StepGraph
from longstraw.codegen.program import StepProgram
from longstraw.nodes import tensor_of
from longstraw.options import Options
from longstraw.parallel.ranks import SimulatedRanks
from longstraw.planning.depth import Depth, depth_of, without_middle
from longstraw.runtime.call_state import Group
from longstraw.runtime.carry import shape_only_spans
from longstraw.runtime.phases import around_steps, phase_of
from longstraw.runtime.runner import GroupRunner
from longstraw.runtime.schedule import ChunkSchedule


@dataclasses.dataclass(frozen=True)
class Peak:
    """A simulated peak (bytes), and what it becomes for a longer prompt.

    Flash attention's backward allocates dK/dV for the key block it is
    given (over grouped heads also expanded to the query heads), and the
    blocks over earlier keys grow with the prompt up to the kernel's cap:
    at the traced sizes (a 32K prompt over two ranks gives 8K earlier keys
    a call) the workspace is a fraction of what it is at 1M. `workspaces`
    keeps, per such workspace (bytes per key, the cap of a block), the
    most bytes live beside it, so that `at(keys)` gives the peak had every
    such call had the block a prompt with `keys` earlier positions gives it."""

    held: int
    workspaces: tuple[tuple[int, int, int], ...] = ()  # (bytes per key, block cap, bytes live beside it)

    def at(self, keys: int) -> int:
        return max([self.held, *(live + per_key * min(keys, cap) for per_key, cap, live in self.workspaces)])

    def less(self, nbytes: int) -> Peak:
        """What is held beyond `nbytes`, never below 0."""
        return Peak(max(self.held - nbytes, 0), tuple((k, c, max(live - nbytes, 0)) for k, c, live in self.workspaces))

    @staticmethod
    def largest(peaks: Iterable[Peak]) -> Peak:
        """The peak of several phases: at any `keys`, the largest of theirs."""
        peaks = list(peaks)
        most: dict[tuple[int, int], int] = {}
        for peak in peaks:
            for per_key, cap, live in peak.workspaces:
                most[per_key, cap] = max(most.get((per_key, cap), 0), live)
        return Peak(max(p.held for p in peaks), tuple((k, c, live) for (k, c), live in sorted(most.items())))

    @staticmethod
    def extrapolated(two: Peak, three: Peak, periods: int) -> Peak | None:
        """A peak at `periods` periods of layers from those at two and three
        (each quantity grows by the same amount per period); None where the
        two have different workspaces."""
        if [w[:2] for w in two.workspaces] != [w[:2] for w in three.workspaces]:
            return None
        grown = lambda a, b: a + (b - a) * (periods - 2)  # noqa: E731
        return Peak(grown(two.held, three.held),
                    tuple((k, c, grown(a, b)) for (k, c, a), (_, _, b) in zip(two.workspaces, three.workspaces)))


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages alive while operators run, and their peak.

    Storages are held by weak reference (autograd keeps tensors alive in
    C++, so Python object lifetimes would undercount). Dead ones are
    dropped before every large allocation (where peaks happen; large beside
    the bytes held above the pinned inputs), when a step ends, and every
    `PRUNE_EVERY` operators otherwise; between two prunes, small storages
    freed meanwhile still count."""

    PRUNE_EVERY = 16

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.pinned: set[int] = set()  # storages alive to the end (`pin`): counted, never checked again
        self.pinned_bytes = 0
        self.current = 0
        self.phase = "outside the steps"
        self.peaks: dict[str, int] = {}  # per runtime phase (`runtime.phase_of`)
        self.workspaces: dict[str, dict[tuple[int, int], int]] = {}  # per phase: (bytes per key, cap) -> most live beside
        self.local: int | None = None  # the peak inside `above`
        self.ops = 0

    def _reached(self, nbytes: int) -> None:
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), nbytes)
        if self.local is not None:
            self.local = max(self.local, nbytes)

    def above(self, fn: Callable[[], Any]) -> tuple[Any, int]:
        """`fn()` and the most it held above what was live before it."""
        self._prune()
        start = self.local = self.current
        try:
            return fn(), self.local - start
        finally:
            self.local = None

    @contextlib.contextmanager
    def in_step(self, where: str) -> Iterator[None]:
        """`longstraw.around_steps`: peaks are kept per phase of the runtime.
        What a step freed is dropped as it ends, so that it does not count
        in the next phase (a branch's float32 logits, freed with the step,
        were counted outside the steps until the next prune)."""
        previous, self.phase = self.phase, phase_of(where)
        try:
            yield
        finally:
            gc.collect(0)  # `without_cyclic_gc`: what the step left in reference cycles goes now
            self._prune()
            self.phase = previous

    def transient(self, nbytes: int) -> None:
        """A kernel's workspace that fake tensors do not allocate."""
        self._prune()
        self._reached(self.current + nbytes)

    def workspace(self, fixed: int, per_key: int, keys: int, cap: int) -> None:
        """A kernel's workspace of `fixed` bytes and `per_key` bytes for each
        of `keys` keys (at most `cap` a call): a transient, and what it
        would be for more keys (`Peak`)."""
        self.transient(fixed + per_key * keys)
        most = self.workspaces.setdefault(self.phase, {})
        most[per_key, cap] = max(most.get((per_key, cap), 0), self.current + fixed)

    def phase_peaks(self) -> dict[str, Peak]:
        """The peak of every phase, with the workspaces that ran in it."""
        return {phase: Peak(held, tuple((k, c, live) for (k, c), live in sorted(self.workspaces.get(phase, {}).items())))
                for phase, held in self.peaks.items()}

    def pin(self) -> None:
        """The storages alive now (the step's inputs: at 64 layers thousands
        of weights) stay alive to the end: prunes no longer walk them."""
        self._prune()
        self.pinned.update(self.live)
        self.pinned_bytes = self.current
        self.live.clear()

    def _prune(self) -> None:
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.current -= self.live.pop(key)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        tensors = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        # large beside what the step holds (not the weights: at full depth they would make nothing large)
        large = any(t.untyped_storage().nbytes() * 64 > self.current - self.pinned_bytes for t in tensors)
        if large or self.ops % self.PRUNE_EVERY == 0:  # peaks happen at large allocations: be exact there
            self._prune()
        for t in tensors:
            ref = StorageWeakRef(t.untyped_storage())
            if ref.cdata in self.pinned:  # a view of an input
                continue
            known = self.live.get(ref.cdata)
            if known is None or known[0].expired():  # new, or a freed storage's address reused
                nbytes = t.untyped_storage().nbytes()
                self.current += nbytes - (known[1] if known else 0)
                self.live[ref.cdata] = (ref, nbytes)
        self._reached(self.current)
        return out


@contextlib.contextmanager
def without_cyclic_gc() -> Iterator[None]:
    """Python's cyclic garbage collector off.

    Fake tensors and the simulation's own objects (graph modules built
    for it, closures) form reference cycles that keep storages alive until
    a collection, and the collector runs when its allocation counters say
    so: the same simulation, run first or again in one process, peaked
    1.5 GB apart in the reverse pass at 27B shapes, and the planner's
    extrapolation over depth turned that into gigabytes. The runtime
    leaves nothing of a step in a cycle (`test_context_parallel`'s
    `test_a_step_leaves_nothing_in_reference_cycles`: one it had, in
    `carry._round_forward`, was found this way), so the simulation
    collects at every step's end (`_LiveBytes.in_step`) and never in
    between: what a cycle would hold counts until then. With the
    collector off, what the step allocated is all in the youngest
    generation: collecting that one alone finds the step's cycles without
    walking the heap Dynamo left (a full collection at every step's end
    doubled the planner tests' time). Nothing is collected on entry: cycles
    left from before hold no storage the simulation counts, and a full
    collection walked the half-million objects Dynamo leaves in a process
    (0.24 s of a 1.3 s simulation at 64K on a 2-core CPU)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class _SpansOnce:
    """Span gradients of carried operators on fake tensors (`carry.shape_only_spans`):
    each signature (the operator's graph key, shapes, dtypes, which
    gradients) runs once; later spans of it, in every layer and chunk,
    hold what it held for an instant and return gradients of the right
    shapes. At full depth most of a simulated step was Gated DeltaNet's
    spans recomputed under autograd, each one the same."""

    def __init__(self, tracker: _LiveBytes) -> None:
        self.tracker = tracker
        self.held: dict[tuple, tuple[int, list[bool]]] = {}  # bytes held, which gradients exist

    def __call__(self, key, grads_of, fn, inputs, grad_outputs, wanted) -> list[torch.Tensor | None]:
        """`grads_of(fn, inputs, grad_outputs, wanted)` (`recompute_grads`, or
        a fused kernel's backward: fla's, through its fake entry points)."""
        signature = (key, *(_signature(x) for x in (*inputs, *grad_outputs)), tuple(wanted))
        if signature in self.held:
            held, present = self.held[signature]
            self.tracker.transient(held)
            return [torch.empty_like(x) if there else None for x, there in zip(inputs, present)]
        grads, held = self.tracker.above(lambda: grads_of(fn, inputs, grad_outputs, wanted))
        self.held[signature] = held, [g is not None for g in grads]
        return grads


def _signature(x: torch.Tensor | None) -> tuple | None:
    return None if x is None else (tuple(x.shape), x.dtype, x.stride())


def simulate_step(program: StepProgram, options: Options, mode: str, chunk: int, recompute: bool,
                  device: torch.device, dtype: torch.dtype | None, ranks: int = 1) -> Peak:
    """Peak of one step at the traced sizes (at most two branches, per rank: the
    second replay adds its parameter gradients into the first's; the prompt
    chunks of `ChunkSchedule.sampled`), run on fake tensors of the example's
    device with the attention kernels `device` would choose; over `ranks`,
    one rank's."""
    return Peak.largest(simulate_phases(program, options, mode, chunk, recompute, device, dtype, ranks=ranks).values())


def step_depth(program: StepProgram) -> Depth | None:
    """The layers of the program's steps, where the prompt's and the branch's agree."""
    prefix, branch = (depth_of(step.module.graph) for step in (program.prefix, program.branch))
    return prefix if prefix is not None and prefix == branch else None


def steps_without_middle(program: StepProgram, depth: Depth, periods: int) -> tuple[StepGraph, StepGraph] | None:
    """The program's prompt and branch steps with `periods` periods of layers
    (`longstraw.planning.depth.without_middle`), or None where they cannot be cut."""
    steps = (program.prefix, program.branch)
    cut = [without_middle(step.module, depth, periods) for step in steps]
    if any(module is None for module in cut):
        return None
    prefix, branch = (dataclasses.replace(step, module=module) for step, module in zip(steps, cut))
    return prefix, branch


def simulate_phases(program: StepProgram, options: Options, mode: str, chunk: int, recompute: bool,
                    device: torch.device, dtype: torch.dtype | None,
                    steps: tuple[StepGraph, StepGraph] | None = None, ranks: int = 1,
                    work: TorchDispatchMode | None = None, groups: list[Group] | None = None) -> dict[str, Peak]:
    """`simulate_step`'s peak per runtime phase (`longstraw.runtime.runner.phase_of`;
    "outside the steps" for the rest), under `options` but for the mode,
    the chunk and recomputation asked for, running `steps` (the prompt's
    and the branch's, e.g. `steps_without_middle`) in place of the program's;
    over `ranks` > 1, the steps of the rank with the largest share
    (`ChunkSchedule.largest_rank`); `groups` in place of one group of two
    branches. `work` (`step_time.WorkRecorder`) records every step's FLOPs
    and operators, each carried span then differentiated in full (not once
    per signature, `_SpansOnce`)."""
    from longstraw.runtime.kernels import attention

    part = program.partition
    # the group (if any) is simulated: `SimulatedRanks` below
    options = dataclasses.replace(options, prompt_grad=mode, prefix_chunk_size=chunk, recompute_layers=recompute,
                                  progress=False, check_finite=False, verify_state=False, context_parallel=None)
    if steps is not None:  # cut to a few layers: the frozen scoring stage (`stages.py`), if any, is left out
        program = dataclasses.replace(program, stages=(dataclasses.replace(program.stages[-1], prefix=steps[0],
                                                                            branch=steps[1]),))
    prompt = program.traced_prefix_len
    simulated = None if ranks == 1 else SimulatedRanks(ChunkSchedule(prompt, chunk, ranks).largest_rank, ranks)
    runner = GroupRunner(program, options, ranks=simulated, sampled=True)
    tracker = _LiveBytes()
    cuda = torch.device(device).type == "cuda"
    class _FlashWithWorkspace(attention.FlashKernel):
        def backward(self, grad_out, q, keys, values, out, lse, mask, scale, q_start, k_start):
            # the real kernel allocates its outputs with a float32 dQ accumulator and,
            # for grouped heads, dK/dV expanded to the query heads
            (hq, n, d), hkv, size = q.shape[-3:], keys.shape[-3], q.element_size()
            per_key = 2 * d * size * (hkv + (hq if hkv != hq else 0))
            tracker.workspace(n * hq * d * (4 + size), per_key, keys.shape[-2], attention.FLASH_KEY_BLOCK)
            return super().backward(grad_out, q, keys, values, out, lse, mask, scale, q_start, k_start)

    flash = _FlashWithWorkspace()

    def kernel_for(q, mask):
        half = q.dtype in (torch.float16, torch.bfloat16)
        if cuda and half and mask is None and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0:
            return flash
        return attention.choose(q, mask)

    floating = float_dtype(part)
    scalars: dict[fx.Node, torch.Tensor] = {}

    def fake(node: fx.Node) -> Any:
        value = tensor_of(node)
        if not isinstance(value, torch.Tensor):
            return value
        if node in scalars:
            return scalars[node]
        cast = dtype if dtype is not None and value.dtype == floating else value.dtype
        requires_grad = node in part.params and value.requires_grad
        return torch.empty(value.shape, dtype=cast, device=value.device, requires_grad=requires_grad)

    # the options' kernel policy, with fla where the target runs it (`fla_families`);
    # attention's memory is modelled as flash's where a fused kernel applies
    spans = shape_only_spans(_SpansOnce(tracker)) if work is None else contextlib.nullcontext()
    with options.kernels.active(), attention.choosing(kernel_for), around_steps(tracker.in_step), spans, \
            contextlib.ExitStack() as fla, without_cyclic_gc(), FakeTensorMode(allow_non_fake_inputs=True), tracker, \
            contextlib.ExitStack() as counting:
        if work is not None:  # innermost: it sees the operators before the tracker and the fake mode
            counting.enter_context(work)
            counting.enter_context(around_steps(work.in_step))
        for family in fla_families(device):
            fla.enter_context(family.SWITCH.simulating())
        scalars.update(read_scalars(part))
        inputs = [fake(p) for p in part.placeholders]
        tracker.pin()
        values = dict(zip(runner.imports, runner.outer.module(*inputs)))
        # two branches (two rounds of them): the second replay adds its gradients into the first's
        groups = groups or [Group(tuple(range(min(part.group_size, 2 * ranks))), prompt)]
        outputs, call = runner.run(inputs, values, groups, part.end)
        grad_outputs = [torch.ones_like(o) if o.is_floating_point() else None for o in outputs]
        grads = runner.backward(call, inputs, grad_outputs)
        del call, outputs, grad_outputs, grads
    return tracker.phase_peaks()


def read_scalars(part: Partition) -> dict[fx.Node, torch.Tensor]:
    """Real one-element tensors for the inputs the steps read with `.item()`
    (a float Dynamo made an input: `dynamic=True` does it to modules'
    `variance_epsilon`), with the value specialisation recorded: a fake
    tensor has no value to read. Made inside the fake mode, as its
    constants, whose `.item()` it answers."""
    out = {}
    for p in part.placeholders:
        items = [u for u in p.users if u.op == "call_method" and u.target == "item"]
        value = tensor_of(p)
        if items and value is not None and value.numel() == 1:
            out[p] = torch.tensor(items[0].meta["longstraw_value"], dtype=value.dtype).reshape(value.shape)
    return out


def fla_families(device: torch.device) -> list[Any]:
    """The fla kernel families (`longstraw.runtime.kernels.fla_*`) a step on
    `device` runs where they apply (CUDA, 16-bit, the policy's "auto"): on
    CUDA, those installed here where this process has a GPU (it plans the
    steps it runs), every one where it has none (a plan for another
    machine: the policy's default, fla where installed, assumes it there;
    the H200 runs had it)."""
    from longstraw.runtime.kernels import fla_causal_conv, fla_gated_delta

    if torch.device(device).type != "cuda":
        return []
    return [f for f in (fla_gated_delta, fla_causal_conv) if f.fla_ops() is not None or not torch.cuda.is_available()]


def float_dtype(part: Partition) -> torch.dtype:
    floats = [tensor_of(p) for p in part.params if tensor_of(p) is not None and tensor_of(p).is_floating_point()]
    return floats[0].dtype if floats else torch.float32


def tensor_bytes(value: torch.Tensor) -> int:
    """Bytes of the tensor's elements (not of its storage)."""
    return value.numel() * value.element_size()
