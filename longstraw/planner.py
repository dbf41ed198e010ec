"""The memory planner: a step's peak for a prompt length, and the prompt
chunk size and layer-wise recomputation that keep it inside a budget.

    peak = weights + grads + state(P) [+ d(state)(P), exact mode] + activations

Weights, grads and state are counted from the plan (the state buffers are
exact). Activations are what the largest phase of the step holds beyond
them: one branch's replay or one chunk of the reverse pass (or of the
capture), and kernel workspaces. They come from running the planned
runtime over the whole step at the traced sizes on fake tensors (no
memory, no compute) while a dispatch mode samples the bytes of live
storages after every operator; flash attention's backward workspace,
which fake kernels do not allocate, is added where it runs (dK/dV expanded
to the query heads, the float32 dQ accumulator). The activations are
reused for other P and G: neither phase grows with P.

`MemoryModel.choose` takes the largest chunk that fits without
recomputation (down to `FAST_CHUNK`), then the largest that fits with it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from .nodes import tensor_of
from .runtime import GroupRunner
from .state import boundaries_on_host

log = logging.getLogger("longstraw.planner")

DEFAULT_CHUNK = 8192
"""The chunk when nothing is planned (no `memory_budget_gb`)."""
CHUNK_CHOICES = (8192, 4096, 2048, 1024, 512, 256, 128)
FAST_CHUNK = 2048
"""Smaller chunks than this cost more speed (smaller matrix products, more
launches) than recomputing each layer once, so recomputation is preferred."""
BUDGET_MARGIN = 0.05
"""Kept free of the device's memory when capping a budget (allocator fragmentation)."""


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
            (f"state, {self.P - 1 + self.R} positions", self.state),
            ("d(state)" + ("" if self.prompt_grad == "exact" else " (detached: none)"), self.state_grad),
            ("activations" + (", layer-wise recomputation" if self.recompute_layers else ""), self.activations),
        ]
        lines = [f"P={self.P} G={self.G} R={self.R} prompt_grad={self.prompt_grad} "
                 f"prefix_chunk_size={self.prefix_chunk_size} recompute_layers={self.recompute_layers}"]
        lines += [f"  {name:44} {gb(size)}" for name, size in rows]
        lines.append(f"  {'predicted peak (independent of G)':44} {gb(self.peak)}")
        if self.budget is not None:
            verdict = "fits" if self.fits else "does NOT fit"
            lines.append(f"  {'budget':44} {gb(self.budget)}  -> {verdict}")
            lines.append(f"  {'largest P that fits':44} {self.largest_prompt if self.largest_prompt else 'none'}")
        return "\n".join(lines)


class MemoryModel:
    """Everything a plan's memory depends on, from the plan (see the module docstring)."""

    def __init__(self, plan: Any) -> None:
        self.plan = plan
        part = plan.partition
        params = [tensor_of(p) for p in part.placeholders if p in part.params and tensor_of(p) is not None]
        self.weights = sum(_nbytes(v) for v in params)
        self.grads = sum(_nbytes(v) for v in params if v.requires_grad)
        self.float_dtype = float_dtype(part)
        self.prompt_len = traced_prefix_len(plan)
        self.branch_len = part.end - self.prompt_len
        self._activations: dict[tuple, int] = {}

    def state(self, P: int, R: int, mode: str, chunk: int, device: torch.device, scale: float = 1.0) -> tuple[int, int]:
        """(state, d(state)) bytes on `device` for a P-token prompt and
        branches of R positions. Carries: the latest, and in exact mode off
        a GPU every chunk boundary (a GPU keeps those on the host)."""
        slots = self.plan.partition.slots
        chunks = math.ceil(max(P - 1, 0) / chunk)
        per_position = sum(s.bytes_per_position() * (scale if s.dtype == self.float_dtype else 1) for s in slots)
        fixed = sum(s.fixed_bytes() for s in slots)
        boundaries = chunks + 1 if mode == "exact" and not boundaries_on_host(device) else 1
        state = int(per_position * (P - 1 + R)) + fixed * boundaries
        state_grad = int(per_position * (P - 1)) + 2 * fixed if mode == "exact" else 0
        return state, state_grad

    def activations(self, mode: str, chunk: int, recompute: bool, device: torch.device, dtype: torch.dtype | None) -> int:
        """A simulated step's peak at the traced sizes, less what the formula counts there."""
        chunk = min(chunk, max(self.prompt_len, 1))  # longer chunks run the traced prompt as one: the same step
        key = (mode, chunk, recompute, str(device), dtype)
        if key not in self._activations:
            peak = simulate_step(self.plan, mode, chunk, recompute, device, dtype)
            scale = _scale(self.float_dtype, dtype)
            known = int((self.weights + self.grads) * scale)
            known += sum(self.state(self.prompt_len + 1, self.branch_len, mode, chunk, device, scale))
            self._activations[key] = max(peak - known, 0)
        return self._activations[key]

    def predict(
        self, P: int, G: int, R: int, mode: str, chunk: int, recompute: bool, device: torch.device,
        dtype: torch.dtype | None = None, budget: int | None = None,
    ) -> MemoryPlan:
        scale = _scale(self.float_dtype, dtype)
        chunk = min(chunk, max(P - 1, 1))
        activations = self.activations(mode, chunk, recompute, device, dtype)
        fixed = int(self.weights * scale), int(self.grads * scale)
        fits = lambda p: sum(fixed) + sum(self.state(p, R, mode, chunk, device, scale)) + activations <= budget  # noqa: E731
        largest = None if budget is None else _largest(fits)
        return MemoryPlan(P, G, R, mode, chunk, recompute, *fixed, *self.state(P, R, mode, chunk, device, scale),
                          activations, budget, largest)

    def choose(self, P: int, R: int, mode: str, device: torch.device, budget: int, chunk: int | None = None,
               recompute: bool | None = None, dtype: torch.dtype | None = None) -> MemoryPlan:
        """The fastest (chunk, recompute) whose predicted peak fits `budget`;
        a given `chunk` or `recompute` is kept. When nothing fits, the
        smallest predicted peak (and a warning: the step may run out of memory)."""
        prompt = max(P - 1, 1)
        chunks = [chunk] if chunk is not None else sorted({min(c, prompt) for c in CHUNK_CHOICES}, reverse=True)
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
            plan = self.predict(P, 1, R, mode, c, r, device, dtype, budget)
            if plan.fits:
                return plan
            plans.append(plan)
        best = min(plans, key=lambda p: p.peak)
        log.warning("longstraw: no prompt chunk fits the memory budget of %.1f GB (P=%d, %s mode); the smallest "
                    "predicted peak is %.1f GB at prefix_chunk_size=%d, recompute_layers=%s. The step may run out "
                    "of memory: shorten the prompt, use prompt_grad='detached', or raise memory_budget_gb.",
                    budget / 1e9, P, mode, best.peak / 1e9, best.prefix_chunk_size, best.recompute_layers)
        return best


def available_budget(device: torch.device) -> int:
    """The most a step may hold: on CUDA what is allocated now plus free, less a margin; elsewhere no limit."""
    if device.type != "cuda":
        return 1 << 62
    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(torch.cuda.memory_allocated(device) + free + cached - BUDGET_MARGIN * total)


# simulation ---------------------------------------------------------------------


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages alive while operators run, and their peak.

    Storages are held by weak reference (autograd keeps tensors alive in
    C++, so Python object lifetimes would undercount). Dead ones are
    dropped before every large allocation (where peaks happen) and every
    `PRUNE_EVERY` operators otherwise; between two prunes, small storages
    freed meanwhile still count."""

    PRUNE_EVERY = 16

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0
        self.ops = 0

    def transient(self, nbytes: int) -> None:
        """A kernel's workspace that fake tensors do not allocate."""
        self._prune()
        self.peak = max(self.peak, self.current + nbytes)

    def _prune(self) -> None:
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.current -= self.live.pop(key)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        tensors = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        large = any(t.untyped_storage().nbytes() * 64 > self.current for t in tensors)
        if large or self.ops % self.PRUNE_EVERY == 0:  # peaks happen at large allocations: be exact there
            self._prune()
        for t in tensors:
            ref = StorageWeakRef(t.untyped_storage())
            known = self.live.get(ref.cdata)
            if known is None or known[0].expired():  # new, or a freed storage's address reused
                nbytes = t.untyped_storage().nbytes()
                self.current += nbytes - (known[1] if known else 0)
                self.live[ref.cdata] = (ref, nbytes)
        self.peak = max(self.peak, self.current)
        return out


def traced_prefix_len(plan: Any) -> int:
    """The traced example's captured prompt positions. Where they depend on
    values the example does not have (token ids on the meta device), every
    position before the first the loss reads: the shared prompt of any real
    group of these shapes, since the responses' own logits start there."""
    return plan.prefix_len if plan.prefix_len >= 0 else plan.partition.first_consumed


def simulate_step(plan: Any, mode: str, chunk: int, recompute: bool, device: torch.device,
                  dtype: torch.dtype | None) -> int:
    """Peak bytes of one step at the traced sizes (at most two branches: the
    second replay adds its parameter gradients into the first's), run on
    fake tensors of the example's device with the attention kernels
    `device` would choose."""
    from longstraw.kernels import attention

    part = plan.partition
    options = dataclasses.replace(plan.options, prompt_grad=mode, prefix_chunk_size=chunk, recompute_layers=recompute,
                                  progress=False, check_finite=False, verify_state=False)
    runner = GroupRunner(part, options, plan.runner.outer, plan.runner.prefix, plan.runner.branch)
    tracker = _LiveBytes()
    cuda = torch.device(device).type == "cuda"
    class _FlashWithWorkspace(attention.FlashKernel):
        def backward(self, grad_out, q, keys, values, out, lse, mask, scale, q_start, k_start):
            # the real kernel expands dK/dV to the query heads and accumulates dQ in float32
            hq, n, d = q.shape[-3], q.shape[-2], q.shape[-1]
            expanded = 2 * keys.shape[-2] * hq * d * q.element_size() if keys.shape[-3] != hq else 0
            tracker.transient(expanded + n * hq * d * 4)
            return super().backward(grad_out, q, keys, values, out, lse, mask, scale, q_start, k_start)

    flash = _FlashWithWorkspace()

    def kernel_for(q, mask):
        half = q.dtype in (torch.float16, torch.bfloat16)
        if cuda and half and mask is None and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0:
            return flash
        return attention.choose(q, mask)

    floating = float_dtype(part)

    def fake(value: Any, requires_grad: bool = False) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        cast = dtype if dtype is not None and value.dtype == floating else value.dtype
        return torch.empty(value.shape, dtype=cast, device=value.device, requires_grad=requires_grad)

    with attention.choosing(kernel_for), FakeTensorMode(allow_non_fake_inputs=True), tracker:
        inputs = [fake(tensor_of(p), p in part.params and tensor_of(p).requires_grad) for p in part.placeholders]
        values = dict(zip(runner.imports, runner.outer.module(*inputs)))
        outputs, call = runner.run(inputs, values, traced_prefix_len(plan), part.end, min(part.group_size, 2))
        grad_outputs = [torch.ones_like(o) if o.is_floating_point() else None for o in outputs]
        grads = runner.backward(call, inputs, grad_outputs)
        del call, outputs, grad_outputs, grads
    return tracker.peak


def float_dtype(part: Any) -> torch.dtype:
    floats = [tensor_of(p) for p in part.params if tensor_of(p) is not None and tensor_of(p).is_floating_point()]
    return floats[0].dtype if floats else torch.float32


def _nbytes(value: torch.Tensor) -> int:
    return value.numel() * value.element_size()


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
