"""A step's predicted time: its arithmetic over the device's rate, plus a cost per operator.

    seconds = FLOPs / rate + operators x seconds per operator

The FLOPs are PyTorch's own count (`torch.utils.flop_counter.flop_registry`:
matrix products, fused attention, convolutions, and the formulas
LongStraw's operators register beside their definitions) of every operator
a step runs; the operators are those that launch work (no views). Both
come from one exact-mode step simulated on fake tensors at the traced
sizes (`simulation.simulate_phases` with a `WorkRecorder`), and are
written as functions of a step's span, so that one simulation predicts
every P, G and R:

    FLOPs(a step over positions [o, o + n)) = h + a * n + b * n * o + c * n * n

`b` is what a query costs per earlier key over all layers (whatever the
attention is: fused, MLA's absorbed; a carried operator adds nothing to
it), `c` per key of its own step, `a` what each position costs besides
(the layers' matrix products), `h` a branch's LM head over the positions
the loss reads. The prompt chunks (two lengths, three offsets) give those
of a capture and of the reverse pass (a chunk recomputed and
differentiated); three groups of one branch, after three prompt lengths,
those of a branch and of its replay, with the chunks' `b` (branches all
end at one position, so their own counts cannot tell `b` from `a` and
`c`) plus the attention per earlier key they run and the chunks do not:
the attention operators' FLOPs are counted apart, and their own `b` is
fitted on each side (the prompt chunks skip the last layer's attention
output, which nothing reads; on a hybrid slice whose one attention layer
is its last, that is all of a branch's). A kept graph's backward is the
replay, or the reverse pass, less the forward it does not run again. A
step's operator count is taken as constant (the attention kernels' walk
over key blocks adds a few per block of thousands of keys). The chunked
rules of the carried operators (Gated DeltaNet, Kimi Delta Attention,
Mamba-2's scan) count their own arithmetic (`CarryKernel.flops`), per
position: their PyTorch forms compute in chunks of 64 positions (Gated
DeltaNet's pads a span to whole chunks, the others' products grow as the
square of a span up to a chunk and linearly beyond, which no polynomial
fitted over short traced chunks follows), and fla's forms launch no
operator. The short convolution counts its own too: fla's form of it is
no operator either.

The rate and the cost per operator are measured, not datasheet figures
(`RATES`). Below about 8K positions the dense slice's step is bound by
launching operators, above it by arithmetic: the prediction is a guide to
where the time goes and how it grows with P, within tens of percent, not
a benchmark.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from longstraw.codegen.program import StepProgram
from longstraw.options import Options
from longstraw.planning.planner import KeptGraphs, extrapolation_cuts
from longstraw.planning.simulation import simulate_phases, step_depth
from longstraw.runtime.call_state import Group
from longstraw.runtime.kernels import work
from longstraw.runtime.schedule import ChunkSchedule

RATES: dict[str, tuple[float, float]] = {"cuda": (596e12, 25e-6)}
"""Per device type, for 16-bit floats: (FLOP/s a step achieves, seconds per
operator), fitted to two measured steps on an H200 (the H100 has the same
arithmetic rate): the dense slice's exact step at 4K and 16K, 2 prompts x
G = 8, R = 1024, the prompt's graph kept and the branches replayed, 0.88 s
and 1.20 s (`benchmarks/results/step_profile_dense_b_h200.json`;
`tests/planning/test_step_time.py` predicts them again). No rate is known
for other devices or float32: pass `tflops` and `op_us`."""

_NO_LAUNCH = {"empty", "empty_like", "empty_strided", "new_empty", "detach", "alias", "lift_fresh", "_unsafe_view",
              "sym_size", "sym_stride", "sym_numel", "_local_scalar_dense", "item", "set_"}
"""Operators that launch no device work (besides views, `OpOverload.is_view`, and `prim` operators)."""


@dataclasses.dataclass(frozen=True)
class StepCount:
    """What one step the runtime ran (`around_steps`' `where`) did; of its
    FLOPs, `attention_flops` are the attention operators' (`_is_attention`)."""

    where: str
    flops: float
    ops: int
    attention_flops: float = 0.0


class WorkRecorder(TorchDispatchMode):
    """FLOPs and launched operators of each step the runtime runs: enter it
    as a dispatch mode and give `in_step` to `around_steps`. A kernel that
    counts its own arithmetic (`kernels.work.counted_as`) adds that in place
    of the FLOPs of what it dispatches; its operators still count."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[StepCount] = []
        self._open: list[list] = []  # [where, flops, ops, attention flops] of the steps running, innermost last
        self._own_count = 0  # depth of kernels counting their own arithmetic

    def __enter__(self):
        self._listening = work.listening(self)
        self._listening.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._listening.__exit__(None, None, None)

    @contextlib.contextmanager
    def counted_as(self, flops: float) -> Iterator[None]:
        if self._open and not self._own_count:  # a kernel inside one that counts itself is part of its count
            self._open[-1][1] += flops
        self._own_count += 1
        try:
            yield
        finally:
            self._own_count -= 1

    @contextlib.contextmanager
    def in_step(self, where: str) -> Iterator[None]:
        self._open.append([where, 0.0, 0, 0.0])
        try:
            yield
        finally:
            self.steps.append(StepCount(*self._open.pop()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._open:
            packet = func.overloadpacket
            counted = self._open[-1]
            if packet in flop_registry and not self._own_count:
                flops = flop_registry[packet](*args, **kwargs, out_val=out)
                counted[1] += flops
                if _is_attention(packet):
                    counted[3] += flops
            if not func.is_view and func.namespace != "prim" and packet.__name__ not in _NO_LAUNCH:
                counted[2] += 1
        return out


@dataclasses.dataclass(frozen=True)
class StepCost:
    """A step over positions `[o, o + n)`: `fixed + per_position * n +
    per_earlier_key * n * o + per_own_key * n * n` FLOPs (`fixed`: a
    branch's LM head, over the positions the loss reads; the queries over
    the earlier keys, and over the step's own, whose count depends on the
    kernel: a block over them is counted whole) and `ops` operators."""

    fixed: float
    per_position: float
    per_earlier_key: float
    per_own_key: float
    ops: float

    def flops(self, o: int, n: int) -> float:
        return self.fixed + self.per_position * n + self.per_earlier_key * n * o + self.per_own_key * n * n

    def less(self, other: StepCost) -> StepCost:
        return StepCost(*(a - b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    def grown(self, three: StepCost, periods: int) -> StepCost:
        """At `periods` periods of layers, `self` at two and `three` at three."""
        pairs = zip(dataclasses.astuple(self), dataclasses.astuple(three))
        return StepCost(*(a + (b - a) * (periods - 2) for a, b in pairs))


@dataclasses.dataclass(frozen=True)
class StepWork:
    """The steps' costs (`StepCost`): a prompt chunk's capture and its
    reverse pass (exact mode; None where nothing trainable reaches the
    prompt's state, so none runs), a branch's forward and its replay."""

    capture: StepCost
    reverse: StepCost | None
    branch: StepCost
    replay: StepCost

    @staticmethod
    def fitted(steps: Sequence[StepCount]) -> StepWork:
        """From an exact-mode step's counts (`WorkRecorder.steps`) over
        three groups of one branch each, whose prompts differ in length: the
        prompt chunks' (three spans, not all of one length) give the
        capture's and the reverse pass's costs, the three branches' (after
        three prompt lengths, all ending where the loss's positions end)
        those of a branch and of its replay, their LM head included. A
        branch's cost per earlier key is the prompt chunks', plus the
        attention per earlier key the branches run and the chunks do not
        (`_skipped_attention`: where the last layer's attention output over
        the prompt is read by nothing, the prompt chunks skip it; on a
        hybrid slice whose only attention layer is its last, that is all of
        a branch's)."""
        captures = _spans(steps, "capturing prompt chunk")
        capture = _fit(captures)
        chunks = _spans(steps, "in the reverse pass over prompt chunk")
        reverse = _fit(chunks) if chunks else None
        branches = _spans(steps, "running branch")
        branch = _fit(branches, capture.per_earlier_key + _skipped_attention(branches, captures))
        replays = _spans(steps, "replaying branch")
        under, under_spans = (reverse, chunks) if reverse is not None else (capture, captures)
        replay = _fit(replays, under.per_earlier_key + _skipped_attention(replays, under_spans))
        return StepWork(capture, reverse, branch, replay)

    def grown(self, three: StepWork, periods: int) -> StepWork:
        """At `periods` periods of layers, `self` at two and `three` at three."""
        reverse = None if self.reverse is None or three.reverse is None else self.reverse.grown(three.reverse, periods)
        return StepWork(self.capture.grown(three.capture, periods), reverse, self.branch.grown(three.branch, periods),
                        self.replay.grown(three.replay, periods))


@dataclasses.dataclass(frozen=True)
class StepTime:
    """A step's predicted FLOPs, operators and seconds, by phase."""

    phases: tuple[tuple[str, float, float], ...]  # (phase, FLOPs, operators)
    rate: float  # FLOP/s
    op_seconds: float

    @property
    def flops(self) -> float:
        return sum(f for _, f, _ in self.phases)

    @property
    def ops(self) -> float:
        return sum(o for _, _, o in self.phases)

    @property
    def seconds(self) -> float:
        return self.seconds_of(self.flops, self.ops)

    def seconds_of(self, flops: float, ops: float) -> float:
        return flops / self.rate + ops * self.op_seconds

    def lines(self) -> list[str]:
        out = []
        for phase, flops, ops in self.phases:
            out.append(f"{phase:40} {self.seconds_of(flops, ops):8.3f} s  ({flops / 1e12:9.2f} TFLOP, "
                       f"{ops:9,.0f} operators)")
        out.append(f"{'predicted step':40} {self.seconds:8.3f} s  at {self.rate / 1e12:.0f} TFLOP/s and "
                   f"{self.op_seconds * 1e6:.0f} us per operator")
        return out


def simulate_work(program: StepProgram, options: Options, recompute: bool, device: torch.device,
                  dtype: torch.dtype | None) -> StepWork:
    """The program's `StepWork`: an exact-mode step simulated at the traced
    sizes with the prompt in three chunks, the last shorter, over three
    groups of one branch each (the traced prompt, and prompts a quarter and
    a half shorter: the branches run at three offsets); for a deep program,
    two and three periods of layers grown to the full depth
    (`planner.extrapolation_cuts`), as the memory planner does."""
    prompt = program.traced_prefix_len
    if prompt < 8 or program.partition.group_size < 3:
        raise ValueError("a step's time is fitted from a traced prompt of 8 positions or more and 3 branches or more "
                         f"(traced: {prompt} positions, {program.partition.group_size} branches)")
    chunk, shift = prompt // 3 + 1, prompt // 4
    groups = [Group((row,), prompt - row * shift) for row in range(3)]

    def simulated(steps=None) -> StepWork:
        recorder = WorkRecorder()
        simulate_phases(program, options, "exact", chunk, recompute, device, dtype, steps=steps, work=recorder,
                        groups=groups)
        return StepWork.fitted(recorder.steps)

    depth = step_depth(program)
    cut = extrapolation_cuts(program, depth)
    if cut is None:
        return simulated()
    two, three = (simulated(steps) for steps in cut)
    return two.grown(three, depth.periods)


def predict(work: StepWork, P: int, G: int, R: int, exact: bool, chunk: int, kept: KeptGraphs | None, rate: float,
            op_seconds: float) -> StepTime:
    """The time of one group's step: the prompt's `P - 1` positions captured
    in chunks of `chunk`, G branches of R positions in steps of `kept.rows`
    rows, and the backward the kept graphs (`kept`, else none) leave: kept
    branches differentiated, the others replayed; in exact mode the
    prompt's graph differentiated if kept, else its reverse pass. A step
    of several rows is counted at one row's operators: the attention's
    per-row calls (a few operators per layer and row) are not counted.
    Costs that come out negative at these sizes raise ValueError (the fit
    does not hold for this program: see the message)."""
    prompt = max(P - 1, 0)
    chunks = ChunkSchedule(prompt, chunk).chunks if prompt else ()
    kept_branches = 0 if kept is None else kept.branches
    prompt_kept = kept is not None and kept.prompt
    rows = 1 if kept is None else kept.rows

    def total(cost: StepCost, spans, per_step: int = 1) -> tuple[float, float]:
        spans = list(spans)
        return sum(cost.flops(o, n) for o, n in spans), cost.ops * -(-len(spans) // per_step)

    on_prompt = [("capturing the prompt", *total(work.capture, chunks))]
    if exact and work.reverse is not None:
        if prompt_kept:
            on_prompt.append(("differentiating the kept prompt", *total(work.reverse.less(work.capture), chunks)))
        else:
            on_prompt.append(("the reverse pass over the prompt", *total(work.reverse, chunks)))
    backward = work.replay.less(work.branch)
    on_branches = [("running the branches", *total(work.branch, [(prompt, R)] * G, rows)),
                   ("differentiating the kept branches", *total(backward, [(prompt, R)] * kept_branches, rows)),
                   ("replaying the branches", *total(work.replay, [(prompt, R)] * (G - kept_branches), rows))]
    phases = [on_prompt[0], *on_branches, *on_prompt[1:]]
    negative = [phase for phase, flops, _ in phases if flops < 0]
    if negative:
        why = _why_negative(any(flops < 0 for _, flops, _ in on_prompt))
        raise ValueError(f"the costs fitted from the simulated step give {', '.join(negative)} negative FLOPs at "
                         f"P={P}, R={R}: {why}")
    return StepTime(tuple(p for p in phases if p[2] > 0), rate, op_seconds)


def _why_negative(on_prompt: bool) -> str:
    """The cause of negative fitted costs, by whether they reach the prompt chunks' phases."""
    if on_prompt:
        return ("the prompt chunks' counted FLOPs do not grow with a chunk's length and offset as the fit assumes "
                "(an operator that works in whole blocks and does not count its own arithmetic, "
                "`CarryKernel.flops`, counts a short chunk as a block), so a term fitted from the traced prompt's "
                "chunks comes out negative and outgrows the others at long prompts; explain with a longer traced "
                "prompt, which moves the length where it does out")
    return ("the branches' fit does not hold at this length: their cost per earlier key is the prompt chunks' plus "
            "what the attention operators count beyond them, so attention the chunks skip that runs outside an "
            "attention operator (MLA's absorbed products, say) goes uncounted, and the branches' other terms make "
            "up for it only near the traced sizes; the plan's peak stands, and a prediction near the traced "
            "lengths holds")


def _is_attention(packet) -> bool:
    """An operator whose registered FLOPs grow with the keys each query
    reads: the fused attentions (SDPA's, flash's, LongStraw's attention over
    state and with sinks), each named for it."""
    return "attention" in packet.__name__


_SPAN = re.compile(r"\[(\d+), (\d+)\)")


class _Span(NamedTuple):
    """A step over positions `[o, o + n)` and what it counted."""

    o: int
    n: int
    flops: float
    ops: int
    attention_flops: float


def _spans(steps: Sequence[StepCount], phase: str) -> list[_Span]:
    out = []
    for step in steps:
        if step.where.startswith(phase):
            start, stop = (int(x) for x in _SPAN.search(step.where).groups())
            out.append(_Span(start, stop - start, step.flops, step.ops, step.attention_flops))
    return out


def _skipped_attention(branches: Sequence[_Span], chunks: Sequence[_Span]) -> float:
    """The attention FLOPs per earlier key the branches count beyond the
    prompt chunks: each side's attention FLOPs fitted as `b * n * o + c *
    n * n` (the branches' offsets differ, so `b` is told from `c`)."""

    def per_earlier_key(spans: Sequence[_Span]) -> float:
        if not any(s.attention_flops for s in spans):
            return 0.0
        return _solve([[s.n * s.o, s.n * s.n] for s in spans], [s.attention_flops for s in spans])[0]

    return per_earlier_key(branches) - per_earlier_key(chunks)


def _fit(spans: Sequence[_Span], per_earlier_key: float | None = None) -> StepCost:
    """A `StepCost` by least squares over the steps' spans and FLOPs: of
    prompt chunks (no fixed part), or, given `per_earlier_key`, of
    branches, which all end at one position, so that their own counts
    cannot tell it from the other terms. Operators: their mean."""
    spans = list(spans)
    if per_earlier_key is None:
        features = [[s.n, s.n * s.o, s.n * s.n] for s in spans]
        values = [s.flops for s in spans]
    else:
        features = [[1, s.n, s.n * s.n] for s in spans]
        values = [s.flops - per_earlier_key * s.n * s.o for s in spans]
    if torch.linalg.matrix_rank(torch.tensor(features, dtype=torch.float64)) < 3:
        raise ValueError("a step's time is fitted from prompt chunks of two lengths at three offsets, and from "
                         "branches after three prompt lengths")
    flops = _solve(features, values)
    ops = sum(s.ops for s in spans) / len(spans)
    if per_earlier_key is None:
        return StepCost(0.0, *flops, ops)
    h, a, c = flops
    return StepCost(h, a, per_earlier_key, c, ops)


def _solve(rows: list[list[float]], values: list[float]) -> list[float]:
    x = torch.linalg.lstsq(torch.tensor(rows, dtype=torch.float64), torch.tensor(values, dtype=torch.float64)[:, None])
    return x.solution.flatten().tolist()
