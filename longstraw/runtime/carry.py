"""Running an operator from a carried state, and differentiating it.

A carried state (a recurrent matrix, a convolution's last inputs) enters a
step from `StepContext.carry_in` and leaves through `carry_out`; it is not
an autograd input of the step, so `CarryStep` is: its backward recomputes
the operator with autograd (or calls the kernel's own backward, where it
has one: `CarryKernel.grads`), returns the gradients of the step's own
inputs, and adds the gradient of the incoming carry into d(state) (exact
mode). Forward saves only the step's inputs.

On a GPU the recomputation of each span, forward and backward, runs as one
CUDA graph (`SpanGraphs`): a carried operator's reference kernel loops over
small blocks (Gated DeltaNet's over 64-position chunks), several hundred
small kernels per span, and a graph launches them without Python and the
dispatcher in between (at full depth the exact 32K reverse pass went from
32.5 to 27.5 s; what remains is the kernels' own GPU time).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from typing import Callable, Hashable, Sequence

import torch

from longstraw.parallel.shards import gather_round
from longstraw.errors import LongStrawError
from longstraw.runtime.kernels import work
from longstraw.runtime.prompt_state import StepContext, has_values

CarryFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def recompute_grads(
    fn: Callable[..., Sequence[torch.Tensor]],
    inputs: Sequence[torch.Tensor | None],
    grad_outputs: Sequence[torch.Tensor | None],
    wanted: Sequence[bool],
) -> list[torch.Tensor | None]:
    """Gradients of `fn(*inputs)` with respect to the inputs flagged in `wanted`."""
    with torch.enable_grad():
        leaves = [
            x.detach().requires_grad_(True) if w and x is not None else (None if x is None else x.detach())
            for x, w in zip(inputs, wanted)
        ]
        outputs = fn(*leaves)
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if g is not None and o.requires_grad]
        targets = [x for x in leaves if x is not None and x.requires_grad]
        if not pairs or not targets:
            return [None] * len(inputs)
        grads = iter(torch.autograd.grad([o for o, _ in pairs], targets, [g for _, g in pairs], allow_unused=True))
    return [next(grads) if x is not None and x.requires_grad else None for x in leaves]


RECOMPUTE_SPAN = 1024
"""Positions recomputed at once in `CarryStep.backward`: the operator's own
intermediates under autograd grow with the positions it sees (Gated
DeltaNet's chunked rule holds about 0.76 MB per position at Qwen3.5-27B
shapes), so a long step is differentiated span by span from the carry."""


@dataclasses.dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor | None]  # static copies of [carry, *inputs] and the outputs' gradients
    grads: list[torch.Tensor | None]


class SpanGraphs:
    """One span's recomputation under autograd and its backward, captured
    as one CUDA graph per signature (the operator's `graph_key`, the
    shapes and dtypes, which gradients flow) and replayed from static
    copies of the inputs. A reverse pass sees a handful of signatures: the
    full spans, a chunk's last span, the first chunk's (no carry gradient),
    a branch's. The graphs share one memory pool: they replay one at a
    time and their outputs are copied out before the next replay.

    `fn` must be capturable: no host synchronisation, shapes that depend
    on the inputs' shapes only, and the same computation for the same key."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.captured: dict[Hashable, _Captured] = {}

    def grads(
        self, key: Hashable, fn: CarryFn, inputs: Sequence[torch.Tensor | None],
        grad_outputs: Sequence[torch.Tensor | None], wanted: Sequence[bool],
    ) -> list[torch.Tensor | None]:
        """`recompute_grads(fn, inputs, grad_outputs, wanted)`, replayed."""
        values = [*inputs, *grad_outputs]
        signature = (key, tuple(wanted), *((None,) if x is None else (tuple(x.shape), x.dtype) for x in values))
        entry = self.captured.get(signature)
        if entry is None:
            try:
                entry = self.captured[signature] = self._capture(fn, values, len(inputs), wanted)
            except torch.OutOfMemoryError:
                raise
            except Exception as e:
                raise LongStrawError(
                    f"capturing the backward of a carried operator ({key!r}) as a CUDA graph failed: {e}. "
                    "Its kernel must run without host synchronisation; pass options={'cuda_graphs': False} "
                    "to run it eagerly."
                ) from e
        for static, x in zip(entry.inputs, values):
            if static is not None:
                static.copy_(x)
        entry.graph.replay()
        return [None if g is None else g.clone() for g in entry.grads]

    def _capture(self, fn: CarryFn, values: list[torch.Tensor | None], n_inputs: int, wanted: Sequence[bool]) -> _Captured:
        static = [None if x is None else x.detach().clone(memory_format=torch.contiguous_format) for x in values]
        run = lambda: recompute_grads(fn, static[:n_inputs], static[n_inputs:], wanted)  # noqa: E731
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up off the graph: library handles, workspaces, lazy initialisation
                run()
        torch.cuda.current_stream().wait_stream(side)
        generator = torch.cuda.default_generators[torch.cuda.current_device()]
        before = generator.clone_state()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                grads = run()
        except BaseException:
            # a capture that fails ends before the device's generator leaves its capture state,
            # and every later random draw on the device would then be refused
            generator.graphsafe_set_state(before)
            raise
        return _Captured(graph, static, grads)


CarryGradsFn = Callable[..., Sequence[torch.Tensor | None]]


@dataclasses.dataclass(frozen=True)
class CarryKernel:
    """What `CarryStep` runs for one carried operator.

    `forward(carry, *inputs) -> (out, new_carry)` must be causal through the
    carry: running it over positions `[a, c)` equals running it over
    `[a, b)` and then over `[b, c)` from the carry it returned.
    `token_dims[0]` is the output's position dimension, `token_dims[1:]`
    the inputs' (None: not per position, such as a weight).

    The backward recomputes a span with autograd by default. `grads`, when
    set, computes a span's gradients directly instead:
    `grads(carry, *inputs, grad_out, grad_carry) -> (d_carry, *d_inputs)`
    (a fused kernel's own backward; `span` positions at a time, since it
    holds less per position than autograd through the forward).
    `graph_key` names what `forward` computes (the operator and the
    constants it closes over): autograd recomputations with the same key
    and input shapes share one CUDA graph (`SpanGraphs`). None: never graphed.
    `flops(*inputs)`, when set, is the forward's arithmetic over these
    inputs' positions, which the planner's work count takes in place of
    what the kernel dispatches (`kernels.work`): for a kernel that launches
    no operator (fla's) or computes in whole blocks (the chunked PyTorch
    rules). A span's backward counts `BACKWARD_FORWARDS` forwards."""

    forward: CarryFn
    token_dims: tuple[int | None, ...]
    graph_key: Hashable | None = None
    grads: CarryGradsFn | None = None
    span: int | None = None
    flops: Callable[..., float] | None = None


BACKWARD_FORWARDS = 3
"""A carried operator's backward, in forwards of its arithmetic: it computes
the forward again (the PyTorch kernel under autograd; fla's backward its
chunk states), and its gradients take about two forwards' products."""


def _counted(kernel: CarryKernel, inputs: Sequence[torch.Tensor], forwards: int):
    """Where `kernel` counts its own arithmetic (`CarryKernel.flops`), its
    `forwards` forwards over `inputs` in place of what it dispatches."""
    if kernel.flops is None:
        return contextlib.nullcontext()
    return work.counted_as(lambda: forwards * kernel.flops(*inputs))


class CarryStep(torch.autograd.Function):
    """`kernel.forward(carry, *inputs)` with the carry taken from and kept in
    the step's `StepContext`; the backward adds the gradient of the
    incoming carry into d(state) (exact mode)."""

    @staticmethod
    def forward(ctx, step: StepContext, slot: int, kernel: CarryKernel, *inputs):
        with _counted(kernel, inputs, 1):
            if step.prompt_round is not None:
                out, new_carry, ctx.round_carries = _round_forward(step, slot, kernel, inputs)
            else:
                out, new_carry = kernel.forward(_carry_of_rows(step, slot), *inputs)
                step.carry_out(slot, new_carry)
        if new_carry._base is not None:
            # a view (a conv's last inputs, sliced from the whole chunk's) would keep
            # the chunk-sized storage alive as long as the step's outputs, which under
            # layer-wise recomputation is the whole reverse chunk: every layer's
            new_carry = new_carry.clone()
        ctx.step, ctx.slot, ctx.kernel = step, slot, kernel
        ctx.save_for_backward(*inputs)
        return out, new_carry

    @staticmethod
    def backward(ctx, grad_out, grad_carry):
        step: StepContext = ctx.step
        kernel: CarryKernel = ctx.kernel
        inputs = ctx.saved_tensors
        if step.prompt_round is not None:  # the carry the round started from (`_round_grads`)
            start, carry = step.round.start, ctx.round_carries[0]
        else:
            start, carry = step.offset, _carry_of_rows(step, ctx.slot)
        wanted = [step.state.carry_grads is not None and start > 0] + list(ctx.needs_input_grad[3:])
        graphs = step.state.span_graphs
        span_grads, span = recompute_grads, None
        if kernel.grads is not None:  # a fused kernel's backward (in a simulation, its fake entry points)
            span_grads, span = _direct_grads(kernel.grads), kernel.span
        elif graphs is not None and kernel.graph_key is not None and has_values(carry):
            span_grads = lambda *a: graphs.grads(kernel.graph_key, *a)  # noqa: E731
        if _SHAPE_ONLY_SPANS and not has_values(carry) and kernel.graph_key is not None:
            span_grads = functools.partial(_SHAPE_ONLY_SPANS[-1], kernel.graph_key, span_grads)
        with _counted(kernel, inputs, BACKWARD_FORWARDS):
            if step.prompt_round is not None:
                grads = _round_grads(step, kernel, inputs, grad_out, grad_carry, wanted, span_grads, span,
                                     ctx.round_carries)
            else:
                grads = _spanwise_grads(
                    kernel.forward, kernel.token_dims, carry, inputs, grad_out, grad_carry, wanted, span_grads, span
                )
        d_carry = grads[0]
        if d_carry is not None and step.rows > 1:  # every row of the step started from the prompt's carry
            d_carry = d_carry.sum(_rows_dim(step, ctx.slot), keepdim=True)
        step.accumulate_carry_grad(ctx.slot, d_carry)
        return (None, None, None, *grads[1:])


def _rows_dim(step: StepContext, slot: int) -> int:
    dim = step.state.slots[slot].batch_dim
    return 0 if dim is None else dim


def _carry_of_rows(step: StepContext, slot: int) -> torch.Tensor:
    """The carry a step starts from: for a step of several branch rows
    (`StepContext.rows`), the prompt's, one copy per row."""
    carry = step.carry_in(slot)
    if step.rows == 1:
        return carry
    sizes = list(carry.shape)
    sizes[_rows_dim(step, slot)] = step.rows
    return carry.expand(sizes).contiguous()


def _round_forward(
    step: StepContext, slot: int, kernel: CarryKernel, inputs: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor] | None]:
    """A carried operator in a round (context parallelism): the round's
    inputs are gathered and every rank runs the operator over every chunk
    of the round from the carry at its start, keeping each chunk's carry
    as the capture would, and returns its own chunk's output and carry.
    The carry passes from chunk to chunk without leaving the rank, at the
    price of running the operator W times; what feeds it (the projections
    around it) is computed once, by the chunk's rank. Under autograd (the
    reverse pass) also the carry at each chunk's start, for `_round_grads`."""
    round_, ranks = step.round, step.state.shard.ranks
    gathered = [None if dim is None else gather_round(x, dim, round_, ranks) for x, dim in zip(inputs, kernel.token_dims[1:])]
    carries = [step.state.carry_at(slot, round_.start)]
    mine = None
    for j, (offset, length) in enumerate(round_.chunks):
        out, carry = kernel.forward(carries[-1], *[x if g is None else g[j] for x, g in zip(inputs, gathered)])
        if not step.grad_enabled:
            step.state.keep_carry(slot, offset + length, carry)  # what `carry_out` keeps in a capture
        carries.append(carry)
        if j == round_.index:
            mine = out, carry
    if not step.grad_enabled:
        return *mine, None
    # Kept on the autograd context through the chunk's backward, so: copies of views (a conv's tail,
    # sliced from the chunk's concatenated inputs), else a view would keep a chunk-sized storage per
    # layer; and aliases of the rest. This rank's carry, when another chunk follows it, is also the
    # Function's output (fla's final state is a tensor of its own), and autograd gives that tensor
    # its grad_fn: kept as is, it closes a reference cycle (node -> ctx -> carry -> node) that only
    # Python's cyclic collector breaks, and under layer-wise recomputation the cycle held the
    # recomputed layer's whole graph (a Gated DeltaNet layer's convolution output and more: about
    # 1 GB per four layers of Qwen3.5-27B at chunks of 4096).
    return *mine, [c.clone() if c._base is not None else c.detach() for c in carries[:-1]]


def _round_grads(
    step: StepContext, kernel: CarryKernel, inputs: Sequence[torch.Tensor], grad_out: torch.Tensor,
    grad_carry: torch.Tensor, wanted: list[bool], span_grads: Callable[..., list[torch.Tensor | None]],
    span: int | None, carries: list[torch.Tensor],
) -> list[torch.Tensor | None]:
    """`_spanwise_grads` of this rank's chunk of a round: the inputs (again:
    kept from the forward, W chunks' inputs of every carried layer would
    stay through the whole chunk's backward), the output gradients and the
    carry gradients of every chunk are gathered, and every rank walks the
    round's chunks last to first as the forward ran them, passing the
    carry's gradient back through each; it keeps its own chunk's input
    gradients (a weight's too: the other chunks' parts are theirs, summed
    over the ranks with the parameters) and returns the gradient of the
    carry at the round's start, the same on every rank."""
    round_, ranks = step.round, step.state.shard.ranks
    gathered = [None if dim is None else gather_round(x, dim, round_, ranks) for x, dim in zip(inputs, kernel.token_dims[1:])]
    outs = gather_round(grad_out, kernel.token_dims[0], round_, ranks)
    ends = [torch.empty_like(grad_carry) for _ in round_.chunks]
    ranks.all_gather(ends, grad_carry.contiguous())
    d_carry, mine = None, [None] * len(inputs)
    for j in reversed(range(len(round_.chunks))):
        end = ends[round_.owners[j]] if d_carry is None else ends[round_.owners[j]] + d_carry
        want = [j > 0 or wanted[0], *(w and j == round_.index for w in wanted[1:])]
        if not any(want):
            continue
        chunk = [x if g is None else g[j] for x, g in zip(inputs, gathered)]
        got = _spanwise_grads(kernel.forward, kernel.token_dims, carries[j], chunk, outs[j], end, want, span_grads, span)
        d_carry = got[0]
        if j == round_.index:
            mine = got[1:]
    return [d_carry if wanted[0] else None, *mine]


ShapeOnlySpans = Callable[..., list[torch.Tensor | None]]
_SHAPE_ONLY_SPANS: list[ShapeOnlySpans] = []


@contextlib.contextmanager
def shape_only_spans(span_grads: ShapeOnlySpans) -> Iterator[None]:
    """Shape-only runs (the planner's simulation) differentiate spans of
    operators with a `graph_key` by `span_grads(graph_key, grads, fn,
    inputs, grad_outputs, wanted)`, where `grads(fn, inputs, grad_outputs,
    wanted)` is what the backward would call (`recompute_grads`, or the
    kernel's own backward): the simulation runs one span of each
    signature and accounts for the others without running them."""
    _SHAPE_ONLY_SPANS.append(span_grads)
    try:
        yield
    finally:
        _SHAPE_ONLY_SPANS.remove(span_grads)


def _direct_grads(grads: CarryGradsFn) -> Callable[..., list[torch.Tensor | None]]:
    """A kernel's `grads` called like `recompute_grads`."""

    def span_grads(fn, inputs, grad_outputs, wanted):
        with torch.no_grad():
            got = grads(*inputs, *grad_outputs)
        return [g if w else None for g, w in zip(got, wanted)]

    return span_grads


def _spanwise_grads(
    fn: CarryFn,
    token_dims: tuple[int | None, ...],
    carry: torch.Tensor,
    inputs: Sequence[torch.Tensor],
    grad_out: torch.Tensor | None,
    grad_carry: torch.Tensor | None,
    wanted: list[bool],
    span_grads: Callable[..., list[torch.Tensor | None]] = recompute_grads,
    span: int | None = None,
) -> list[torch.Tensor | None]:
    """Gradients of `fn(carry, *inputs)` for `[carry, *inputs]`, recomputed
    `span` positions at a time (default `RECOMPUTE_SPAN`): a forward without autograd keeps
    the carry at each span's start, then the spans are differentiated last
    to first (`span_grads`, called like `recompute_grads`), each passing
    the gradient of its incoming carry to the span before (as the reverse
    pass does with prompt chunks)."""
    out_dim, in_dims = token_dims[0], token_dims[1:]
    length = next(x.shape[d] for x, d in zip(inputs, in_dims) if d is not None)
    span = span or RECOMPUTE_SPAN
    spans = [(s, min(span, length - s)) for s in range(0, length, span)]
    if len(spans) == 1:
        return span_grads(fn, [carry, *inputs], [grad_out, grad_carry], wanted)

    def piece(start: int, size: int) -> list[torch.Tensor]:
        return [x if d is None else x.narrow(d, start, size) for x, d in zip(inputs, in_dims)]

    carries = [carry]
    with torch.no_grad():
        for start, size in spans[:-1]:
            carries.append(fn(carries[-1], *piece(start, size))[1])
    pieces: list[list[torch.Tensor | None]] = []
    d_carry = grad_carry
    for i in reversed(range(len(spans))):
        start, size = spans[i]
        g_out = None if grad_out is None else grad_out.narrow(out_dim, start, size)
        g = span_grads(fn, [carries[i], *piece(start, size)], [g_out, d_carry], [i > 0 or wanted[0], *wanted[1:]])
        d_carry = g[0]
        pieces.append(g[1:])
    pieces.reverse()
    out: list[torch.Tensor | None] = [d_carry if wanted[0] else None]
    for j, d in enumerate(in_dims):
        parts = [p[j] for p in pieces if p[j] is not None]
        if not parts:
            out.append(None)
        elif d is None:
            out.append(torch.stack(parts).sum(0))
        else:
            out.append(torch.cat(parts, dim=d))
    return out
