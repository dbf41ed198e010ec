"""The memory planner: a step's peak for a prompt length, and the prompt
chunk size and layer-wise recomputation that keep it inside a budget.

    peak = weights + grads + state(P) [+ d(state)(P), exact mode] + activations

Weights, grads and state are counted from the plan (the state buffers are
exact). Activations are what the largest phase of the step holds beyond
them: one branch's replay or one chunk of the reverse pass (or of the
capture), and kernel workspaces. They come from running the planned
runtime over one step (`longstraw.planning.simulation`; of the prompt's chunks the
first and the last two) at the traced sizes on fake tensors (no
memory, no compute) while a dispatch mode samples the bytes of live
storages after every operator; flash attention's backward workspace,
which fake kernels do not allocate, is added where it runs (dK/dV expanded
to the query heads, the float32 dQ accumulator). The activations are
reused for other P and G: neither phase grows with P, but for that
workspace, which grows with the keys a block of the backward reads up to
the kernel's cap, and is read off for P from the bytes live beside it
(`simulation.Peak`; the rank with the largest share under context
parallelism).

Deep models are simulated at two and three periods of their layers (the
smallest run of layers that repeats, `longstraw.planning.depth`: the first, then
the last, then also the second) and each phase's peak is extrapolated to
the full depth: every period between the first and the last adds the
same layer inputs (with recomputation) or activations (without) and the
same parameter gradients.

`MemoryModel.choose` takes the largest chunk that fits without
recomputation (down to `FAST_CHUNK`), then the largest that fits with it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import TYPE_CHECKING

import torch

from longstraw.planning.depth import Depth
from longstraw.runtime.device_memory import available_budget
from longstraw.nodes import tensor_of
from longstraw.options import Options
from longstraw.codegen.graphs import StepGraph
from longstraw.codegen.program import StepProgram
from longstraw.planning.simulation import (
    Peak,
    float_dtype,
    simulate_phases,
    simulate_step,
    step_depth,
    steps_without_middle,
    tensor_bytes,
)
from longstraw.runtime.call_state import GraphSpending
from longstraw.runtime.kept_graphs import kept_in, rows_or_graphs
from longstraw.runtime.schedule import ChunkSchedule
from longstraw.runtime.prompt_state import boundaries_on_host

if TYPE_CHECKING:
    from longstraw.planning.step_time import StepTime

log = logging.getLogger("longstraw.planning.planner")

Simulations = dict[tuple, dict[tuple[int, int, int], Peak]]
"""The activations simulated for one compiled graph's plans: per simulation
key, per traced prompt and branch length and the chunk run (`MemoryModel.activations`)."""

DEFAULT_CHUNK = 8192
"""The chunk when nothing is planned (off CUDA without `memory_budget_gb`)."""
CHUNK_CHOICES = (8192, 4096, 2048, 1024, 512, 256, 128)
FAST_CHUNK = 2048
"""Smaller chunks than this cost more speed (smaller matrix products, more
launches) than recomputing each layer once, so recomputation is preferred."""
EXTRAPOLATE_FROM = 6
"""Periods of layers from which the planner simulates two and three and extrapolates (fewer: it simulates them all)."""


@dataclasses.dataclass(frozen=True)
class KeptGraphs:
    """The schedule a step with this much room beside its peak runs
    (`GroupRunner`, decision 0016): the branch rows each branch step holds
    (`Options.branch_rows`), whether the forward keeps the prompt's
    autograd graph for the backward (exact mode; else the reverse pass runs
    each prompt chunk again) and how many of the G branches' graphs (the
    others are replayed), for the last group of a batch."""

    prompt_chunks: int
    prompt: bool
    branches: int
    G: int
    exact: bool
    rows: int = 1

    @property
    def branch_steps(self) -> int:
        return -(-self.G // self.rows)

    def lines(self) -> list[str]:
        prompt = ("kept" if self.prompt else "recomputed in the reverse pass") if self.exact else "no gradient (detached)"
        again = 0 if self.prompt or not self.exact else 1
        return [f"branch steps: {self.branch_steps} of up to {self.rows} rows for {self.G} branches",
                f"the prompt's graph ({self.prompt_chunks} chunks): {prompt}",
                f"branch graphs kept: {self.branches} of {self.G} (the rest replayed)",
                f"forwards: the prompt {1 + again}x, the branches {self.G + self.G - self.branches} for {self.G}"]


def kept_graphs(room: int, graph_bytes: int, chunks: int, G: int, exact: bool, prompt: bool,
                branches: bool, rows: int = 1, positions: tuple[int, int] = (1, 1), planned_rows: bool = False) -> KeptGraphs:
    """What `GroupRunner` keeps in `room` bytes of the budget, each prompt
    chunk's or branch's graph counted at `graph_bytes`, as its
    `GraphSpending` decides (`kept_graphs.kept_in`): what steps of `rows`
    branch rows take beyond one row is not room for graphs; the prompt's
    graph first (where `prompt`: exact mode, something upstream of the
    state needs a gradient), then branch steps one by one (where
    `branches`: every claiming pass allows it). Rows the planner chose
    (`planned_rows`) fall back to one where they would keep graphs over
    fewer of the `positions` (prompt, branch) than one row does."""
    branch = graph_bytes if branches else None
    wanted = chunks * graph_bytes if prompt else None
    beside = lambda per_step: GraphSpending(room - (per_step - 1) * graph_bytes, 0, 0)  # noqa: E731
    if planned_rows and rows > 1:
        rows = rows_or_graphs(beside, wanted, branch, rows, G, positions)
    keep_prompt, kept = kept_in(beside(rows), wanted, branch, rows, G)
    return KeptGraphs(chunks, keep_prompt, kept, G, exact, rows)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Predicted peak memory of one GRPO step (bytes), and the sizes it was predicted for."""

    P: int
    G: int
    R: int
    prompt_grad: str
    prefix_chunk_size: int
    recompute_layers: bool
    weights: int
    grads: int
    state: int
    state_grad: int
    activations: int  # one branch replay, one prompt chunk, or one reverse chunk, and kernel workspaces
    budget: int | None
    largest_prompt: int | None
    ranks: int = 1  # context parallelism: the peak is one rank's, holding the largest share of the prompt state
    kept: KeptGraphs | None = None  # the schedule in the room beside the peak (`explain().plan` with a budget)
    time: StepTime | None = None  # the step's predicted time (`explain().plan` where a rate is known)

    @property
    def peak(self) -> int:
        return self.weights + self.grads + self.state + self.state_grad + self.activations

    @property
    def fits(self) -> bool | None:
        return None if self.budget is None else self.peak <= self.budget

    def table(self) -> str:
        gb = lambda b: f"{b / 1e9:10.3f} GB"  # noqa: E731
        rows = [
            ("weights", self.weights),
            ("grads (trainable)", self.grads),
            (f"state, {self.P - 1 + self.R} positions" if self.ranks == 1 else
             f"state, the largest share of {self.P - 1} positions over {self.ranks} ranks", self.state),
            ("d(state)" + ("" if self.prompt_grad == "exact" else " (detached: none)"), self.state_grad),
            ("activations" + (", layer-wise recomputation" if self.recompute_layers else ""), self.activations),
        ]
        lines = [f"P={self.P} G={self.G} R={self.R} prompt_grad={self.prompt_grad} "
                 f"prefix_chunk_size={self.prefix_chunk_size} recompute_layers={self.recompute_layers}"]
        lines += [f"  {name:44} {gb(size)}" for name, size in rows]
        lines.append(f"  {'predicted peak (independent of G)' if self.ranks == 1 else 'predicted peak per rank':44} "
                     f"{gb(self.peak)}")
        if self.budget is not None:
            verdict = "fits" if self.fits else "does NOT fit"
            lines.append(f"  {'budget':44} {gb(self.budget)}  -> {verdict}")
            lines.append(f"  {'largest P that fits':44} {self.largest_prompt if self.largest_prompt else 'none'}")
        if self.kept is not None:
            lines.append("  kept for the backward in the room beside the peak:")
            lines += [f"    {line}" for line in self.kept.lines()]
        if self.time is not None:
            lines.append("  predicted time (longstraw.planning.step_time):")
            lines += [f"    {line}" for line in self.time.lines()]
        return "\n".join(lines)


class MemoryModel:
    """Everything a program's memory depends on (see the module docstring)."""

    def __init__(self, program: StepProgram, options: Options, activations: Simulations | None = None) -> None:
        """`options`: what the simulations run with, but for the chunk size,
        recomputation and mode each asks for. `activations`: the
        simulations of one compiled graph's plans (`CompiledGroupLoss`),
        reused for shorter prompts (see `activations`)."""
        self.program, self.options = program, options
        part = program.partition
        params = [tensor_of(p) for p in part.placeholders if p in part.params and tensor_of(p) is not None]
        self.weights = sum(tensor_bytes(v) for v in params)
        self.grads = sum(tensor_bytes(v) for v in params if v.requires_grad)
        self.float_dtype = float_dtype(part)
        self.prompt_len = program.traced_prefix_len
        self.branch_len = part.end - self.prompt_len
        # (mode, recompute, device, dtype, ranks, context) -> {(simulated P - 1, R, chunk run): activations}
        self._activations: Simulations = {} if activations is None else activations
        # what a simulation depends on besides the key and the lengths, among one graph's plans
        self._context = (self.float_dtype, self.weights, self.grads)

    def state(self, P: int, R: int, mode: str, chunk: int, device: torch.device, scale: float = 1.0,
              chunks: int | None = None, ranks: int = 1) -> tuple[int, int]:
        """(state, d(state)) bytes on `device` for a P-token prompt and
        branches of R positions. Carries: the latest, and in exact mode off
        a GPU every chunk boundary (a GPU keeps those on the host) of the
        `chunks` the capture runs (default: all). Over `ranks` (context
        parallelism) the rank with the largest share of the prompt: its
        buffers hold the share and no branch positions; carries are on
        every rank."""
        slots = self.program.partition.slots
        prompt = max(P - 1, 0)
        chunks = ChunkSchedule(prompt, chunk).count if chunks is None else chunks
        per_position = sum(s.bytes_per_position() * (scale if s.dtype == self.float_dtype else 1) for s in slots)
        fixed = sum(s.fixed_bytes() for s in slots)
        boundaries = chunks + 1 if mode == "exact" and not boundaries_on_host(device) else 1
        held = prompt + R if ranks == 1 else ChunkSchedule(prompt, chunk, ranks).largest_share
        state = int(per_position * held) + fixed * boundaries
        state_grad = int(per_position * (prompt if ranks == 1 else held)) + 2 * fixed if mode == "exact" else 0
        return state, state_grad

    def activations(self, mode: str, chunk: int, recompute: bool, device: torch.device, dtype: torch.dtype | None,
                    ranks: int = 1) -> Peak:
        """A simulated step's peak at the traced sizes, less what the formula
        counts there; `Peak.at` gives it for a longer prompt, whose attention
        workspaces grow until the kernels' key blocks reach their cap.

        One compiled graph's plans share their simulations (a training loop
        plans every new prompt and completion length): a simulation at a
        prompt and branches at least as long as these is reused, since it
        holds at least as much, where it ran the chunk this request would
        have run at its length (a prompt shorter than the chunk runs as one
        chunk of its own length: every chunk asked for at least that long
        shares the simulation). A candidate is simulated again only for a
        prompt or branches longer than every simulated one's. Over `ranks`,
        one rank's (`simulation.simulate_phases`), less its share of the state."""
        key = (mode, recompute, str(device), dtype, ranks, self._context)
        simulated = self._activations.setdefault(key, {})
        # (P - 1, R, the chunk run) of each simulation: a longer chunk runs the prompt as one chunk of its length
        covering = [(p, r, run) for p, r, run in simulated
                    if p >= self.prompt_len and r >= self.branch_len and run == min(chunk, max(p, 1))]
        if covering:
            return simulated[min(covering)]
        run_chunk = min(chunk, max(self.prompt_len, 1))
        peak = self.simulated_peak(mode, run_chunk, recompute, device, dtype, ranks)
        scale = _scale(self.float_dtype, dtype)
        known = int((self.weights + self.grads) * scale)
        run = ChunkSchedule(self.prompt_len, run_chunk, ranks).sampled(self.program.runs_rounds)
        known += sum(self.state(self.prompt_len + 1, self.branch_len, mode, run_chunk, device, scale, len(run), ranks))
        simulated[self.prompt_len, self.branch_len, run_chunk] = peak.less(known)
        return simulated[self.prompt_len, self.branch_len, run_chunk]

    def simulated_peak(self, mode: str, chunk: int, recompute: bool, device: torch.device,
                       dtype: torch.dtype | None, ranks: int = 1) -> Peak:
        """The simulated step's peak (over `ranks`, one rank's): extrapolated
        from two and three periods of layers where there are at least
        `EXTRAPOLATE_FROM` periods."""
        cut = extrapolation_cuts(self.program, self.depth)
        if cut is not None:
            two, three = (simulate_phases(self.program, self.options, mode, chunk, recompute, device, dtype, steps,
                                          ranks) for steps in cut)
            if two.keys() == three.keys():
                grown = [Peak.extrapolated(two[p], three[p], self.depth.periods) for p in two]
                if None not in grown:
                    return Peak.largest(grown)
        return simulate_step(self.program, self.options, mode, chunk, recompute, device, dtype, ranks)

    @functools.cached_property
    def depth(self) -> Depth | None:
        """The steps' layers and their period (`longstraw.planning.depth`)."""
        return step_depth(self.program)

    def predict(
        self, P: int, G: int, R: int, mode: str, chunk: int, recompute: bool, device: torch.device,
        dtype: torch.dtype | None = None, budget: int | None = None, ranks: int = 1,
    ) -> MemoryPlan:
        """The peak for these sizes; over `ranks`, the peak of the rank with
        the largest share (its steps simulated with their rounds' gathers)."""
        scale = _scale(self.float_dtype, dtype)
        activations = self.activations(mode, chunk, recompute, device, dtype, ranks)
        chunk = min(chunk, max(P - 1, 1))  # a longer chunk runs the prompt as one
        fixed = int(self.weights * scale), int(self.grads * scale)
        state = lambda p: self.state(p, R, mode, chunk, device, scale, ranks=ranks)  # noqa: E731
        at = lambda p: activations.at(earlier_keys(p, chunk, ranks))  # noqa: E731
        fits = lambda p: sum(fixed) + sum(state(p)) + at(p) <= budget  # noqa: E731
        largest = None if budget is None else _largest(fits)
        return MemoryPlan(P, G, R, mode, chunk, recompute, *fixed, *state(P), at(P), budget, largest, ranks)

    def choose(self, P: int, R: int, mode: str, device: torch.device, budget: int, chunk: int | None = None,
               recompute: bool | None = None, dtype: torch.dtype | None = None, ranks: int = 1) -> MemoryPlan:
        """The fastest (chunk, recompute) whose predicted peak fits `budget`;
        a given `chunk` or `recompute` is kept. When nothing fits, the
        smallest predicted peak (and a warning: the step may run out of memory)."""
        prompt = max(P - 1, 1)
        if chunk is not None:
            chunks = [chunk]
        else:  # the largest chunk asked for of each chunk run: a prompt shorter than a chunk runs as one
            runs = [min(c, prompt) for c in CHUNK_CHOICES]
            chunks = [c for i, c in enumerate(CHUNK_CHOICES) if i == 0 or runs[i] < runs[i - 1]]
        candidates = []
        if recompute is not True:
            fast = min(FAST_CHUNK, prompt)  # a chunk of the whole prompt is as fast as it gets
            candidates += [(c, False) for c in chunks if chunk is not None or recompute is False or c >= fast]
        if recompute is not False:
            candidates += [(c, True) for c in chunks]
        if recompute is None and chunk is None:
            candidates += [(c, False) for c in chunks if c < fast]
        plans = []
        for c, r in candidates:
            plan = self.predict(P, 1, R, mode, c, r, device, dtype, budget, ranks)
            if plan.fits:
                return plan
            plans.append(plan)
        best = min(plans, key=lambda p: p.peak)
        log.warning("longstraw: no prompt chunk fits the memory budget of %.1f GB (P=%d, %s mode); the smallest "
                    "predicted peak is %.1f GB at prefix_chunk_size=%d, recompute_layers=%s. The step may run out "
                    "of memory: shorten the prompt, use prompt_grad='detached', or raise memory_budget_gb.",
                    budget / 1e9, P, mode, best.peak / 1e9, best.prefix_chunk_size, best.recompute_layers)
        return best


def extrapolation_cuts(program: StepProgram, depth: Depth | None) -> list[tuple[StepGraph, StepGraph]] | None:
    """The program's steps cut to two and to three periods of layers, where
    it has at least `EXTRAPOLATE_FROM` periods and both cuts can be made:
    what a simulation runs instead of the full depth, to extrapolate from."""
    if depth is None or depth.periods < EXTRAPOLATE_FROM:
        return None
    cut = [steps_without_middle(program, depth, k) for k in (2, 3)]
    return None if None in cut else cut


def context_ranks(options: Options) -> int:
    """Ranks the prompt state is sharded over (`Options.context_parallel`)."""
    group = options.context_parallel
    return 1 if group is None else torch.distributed.get_world_size(group)


def earlier_keys(P: int, chunk: int, ranks: int) -> int:
    """The most prompt positions one rank's attention reads before a step's
    own: the prompt, or over `ranks` the largest share (`Peak.at`)."""
    prompt = max(P - 1, 0)
    return prompt if ranks == 1 else ChunkSchedule(prompt, chunk, ranks).largest_share


def default_budget(device: torch.device) -> int | None:
    """The budget when `memory_budget_gb` is None: on CUDA the device's free
    memory (`available_budget`); elsewhere none, and nothing is planned
    (host memory is not what a long prompt runs out of, and a plan
    simulates the step)."""
    if device.type == "cuda" and torch.cuda.is_available():
        return available_budget(device)
    return None


def _scale(traced: torch.dtype, target: torch.dtype | None) -> float:
    return 1.0 if target is None else target.itemsize / traced.itemsize


def _largest(fits) -> int | None:
    """The largest P with fits(P), by doubling then bisection (fits is monotone)."""
    if not fits(2):
        return None
    lo, hi = 2, 4
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > 1 << 40:
            return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
