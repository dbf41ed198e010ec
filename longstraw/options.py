"""Backend options: one frozen dataclass, validated once."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Mapping

from longstraw.errors import LongStrawError
from longstraw.runtime.kernels import KernelPolicy


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    prompt_grad: Literal["exact", "detached"] = "exact"
    """`exact`: gradients flow through the captured prompt state, as in eager.
    `detached`: the state of prompt positions 0..P-2 is a constant (the
    reference system's objective); the last prompt token runs in every branch."""

    prefix_chunk_size: int | None = None
    """Prompt positions evaluated per chunk during capture and the reverse
    pass. None: planned (`longstraw.planning.planner`) for `memory_budget_gb`, or on
    CUDA for the device's free memory; elsewhere 8192."""

    on_unsupported: Literal["error", "eager"] = "error"
    """`error`: raise, naming the operator, module and source line.
    `eager`: warn once and run the graph unchanged (no memory savings)."""

    progress: bool | None = None
    """Progress bars (tqdm, tokens/s) for the prompt capture and the reverse
    pass. None: shown when stderr is a terminal and the prompt spans at
    least four chunks."""

    check_finite: bool = True
    """Check the captured prompt state for NaN/Inf and name the layer: one
    reduction over each group's state after its capture, read once a call,
    after the last group's branches (one device sync)."""

    plan_cache_size: int = 8
    """Plans kept per compiled graph, least recently used dropped first. A
    plan is made per input signature (shapes, dtypes, ...); a training loop
    over many prompt lengths would otherwise keep one for each."""

    verify_state: bool = False
    """Debugging: fill the state buffers with NaN and check that the capture
    writes every prompt position exactly once (each write lands on unwritten
    positions, none is left unwritten), and that replays and the reverse
    pass never change a captured value. Costs a pass over the state per write."""

    recompute_layers: bool | None = None
    """Run each branch replay and reverse-pass chunk layer by layer under
    `torch.utils.checkpoint`: what one step holds under autograd no longer
    grows with depth (the layers' inputs stay), for one more forward of the
    replayed positions. None: planned with the chunk size (off where nothing is planned)."""

    keep_group_states: bool | None = None
    """A batch of several prompts (groups): keep every group's prompt state
    from the forward for the backward, instead of freeing it after the
    group's branches and capturing it again there (one prompt forward per
    group but the last). Costs the states' memory together. None: planned,
    kept while the memory budget has room for them beside the planned peak
    (nothing is kept where nothing is planned, or under context parallelism)."""

    keep_graphs: bool | None = None
    """Keep the autograd graphs of the forward's steps for the backward,
    which then differentiates them instead of running their forward again:
    the prompt capture's chunks in exact mode (the reverse pass's forward)
    and the branches in both modes (the replays' forward). Costs their
    activations, what eager keeps for one row of the prompt and for each
    completion. None: planned, kept (prompt first, then branch by branch)
    while the memory budget has room beside the planned peak; nothing is
    kept where nothing is planned. Layer-wise recomputation, attention
    outputs on the host, frozen stages, random operators and context
    parallelism run the replays as before, and so do the branches of
    passes that do not allow it (`ArchitecturePass.branch_graphs_kept`:
    MLA, DSA and sliding windows for now)."""

    branch_rows: int | None = None
    """Branches of a group run as one step: the layers' matrix multiplies
    and the LM head see that many rows at once (fewer, larger kernels),
    each row's attention still reads the prompt's state alone. Costs a
    branch's activations per row. None: planned, as many rows as the
    memory budget has room for beside the planned peak (one where nothing
    is planned). Exact either way. Plans with a pass that reads its state
    one row at a time (`ArchitecturePass.branches_batched`: MLA and DSA for
    now), a frozen scoring stage or context parallelism run one row per
    step."""

    head_chunk_size: int | None = 256
    """Positions per chunk of a branch step's LM head and per-token loss
    (`longstraw/codegen/head.py`): the `[R, vocab]` logits never exist whole. At a
    248K vocabulary one float32 `[256, vocab]` tensor is 254 MB (1 GB at
    R = 1024), and 256 rows keep the head's matrix multiply efficient.
    None: run the head over all positions at once."""

    cuda_graphs: bool = True
    """On a GPU, replay the backward of carried operators (Gated DeltaNet,
    causal convolutions) span by span as CUDA graphs: their reference
    kernels dispatch hundreds of small operators per span. False: run them
    eagerly (debugging, or a custom carried operator that cannot be captured)."""

    attention_outputs_on_host: bool = False
    """Exact mode: keep each causal attention layer's output and log-sum-exp
    over the prompt, from the capture, in host memory, so the reverse pass
    reads them instead of running attention's forward over all earlier
    positions again (its share of the reverse pass grows with P). Host
    memory: the output's bytes per position per attention layer plus 4 per
    head (12 KB at Qwen3.5-27B shapes: 72 GB for 393K positions and 15
    layers); entries that would leave less than 10% of the host's memory
    available are not kept (their chunks recompute the forward)."""

    passes: tuple[Any, ...] = ()
    """Architecture passes (`longstraw.passes.ArchitecturePass` subclasses or
    instances) used after the built-in, installed and registered ones
    (`longstraw.register_pass`)."""

    disable_passes: tuple[str, ...] = ()
    """Names of passes the backend leaves out (`ArchitecturePass.name`, e.g.
    `"sliding_window_attention"`: sliding-window layers then keep every
    position's K/V through the causal attention pass). A name no pass has is
    an error listing the passes."""

    kernels: KernelPolicy | Mapping[str, str] = KernelPolicy()
    """Which kernels the steps run (`longstraw.runtime.kernels.KernelPolicy`), e.g.
    `{"attention": "cudnn"}` or `{"gated_delta": "torch"}`. Default:
    PyTorch's SDPA rules for attention, fla for Gated DeltaNet and the short
    causal convolution where it applies."""

    memory_budget_gb: float | None = None
    """Peak allocated device memory (GB, 1e9 bytes) the step may reach, this
    process's other tensors included: the chunk size and recomputation left
    None are planned for it (on CUDA at most what is allocated at planning
    time plus the device's free memory, less 5% of it). None: on CUDA that
    cap itself (the device's free memory); elsewhere nothing is planned (8192,
    no recomputation). Setting both `prefix_chunk_size` and
    `recompute_layers` skips planning."""

    context_parallel: Any = None
    """A `torch.distributed` process group (e.g. `dist.group.WORLD`): shard
    the prompt's per-position state (attention K/V, and its gradient in
    exact mode) over its ranks, whole prompt chunks dealt so that
    positions and attention work balance. Every rank calls the compiled
    loss with the same inputs and weights (checked), and gets the whole
    gradient: none is to be reduced across the group. The ranks divide the
    prompt's chunks and the branches among them in rounds, one each. The
    planner plans one rank's peak (the largest share of the state). Every
    built-in state kind: causal attention (padding masks over one run of
    keys), MLA, DSA and carries (`longstraw/parallel/`)."""

    def __post_init__(self) -> None:
        from longstraw.pass_registry import as_pass  # the passes import the runtime, which imports this module

        if isinstance(self.passes, (str, bytes)) or not isinstance(self.passes, (list, tuple)):
            raise LongStrawError(f"passes must be a list or tuple of architecture passes, got {self.passes!r}")
        object.__setattr__(self, "passes", tuple(as_pass(p, "options['passes']") for p in self.passes))
        if isinstance(self.disable_passes, str) or not all(isinstance(n, str) for n in self.disable_passes):
            raise LongStrawError(f"disable_passes must be a list of pass names, got {self.disable_passes!r}")
        object.__setattr__(self, "disable_passes", tuple(self.disable_passes))
        if isinstance(self.kernels, Mapping):
            unknown = set(self.kernels) - {f.name for f in dataclasses.fields(KernelPolicy)}
            if unknown:
                raise LongStrawError(f"unknown kernels option(s) {sorted(unknown)}; valid: {[f.name for f in dataclasses.fields(KernelPolicy)]}")
            object.__setattr__(self, "kernels", KernelPolicy(**self.kernels))
        if not isinstance(self.kernels, KernelPolicy):
            raise LongStrawError(f"kernels must be a longstraw.runtime.kernels.KernelPolicy or a dict, got {self.kernels!r}")
        if self.prompt_grad not in ("exact", "detached"):
            raise LongStrawError(f"prompt_grad must be 'exact' or 'detached', got {self.prompt_grad!r}")
        if self.prefix_chunk_size is not None and (not _is_int(self.prefix_chunk_size) or self.prefix_chunk_size < 1):
            raise LongStrawError(f"prefix_chunk_size must be a positive int or None, got {self.prefix_chunk_size!r}")
        budget = self.memory_budget_gb
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0):
            raise LongStrawError(f"memory_budget_gb must be a positive number or None, got {budget!r}")
        if not _is_int(self.plan_cache_size) or self.plan_cache_size < 1:
            raise LongStrawError(f"plan_cache_size must be a positive int, got {self.plan_cache_size!r}")
        if not isinstance(self.verify_state, bool):
            raise LongStrawError(f"verify_state must be a bool, got {self.verify_state!r}")
        if self.recompute_layers is not None and not isinstance(self.recompute_layers, bool):
            raise LongStrawError(f"recompute_layers must be a bool or None, got {self.recompute_layers!r}")
        if self.keep_group_states is not None and not isinstance(self.keep_group_states, bool):
            raise LongStrawError(f"keep_group_states must be a bool or None, got {self.keep_group_states!r}")
        if self.keep_graphs is not None and not isinstance(self.keep_graphs, bool):
            raise LongStrawError(f"keep_graphs must be a bool or None, got {self.keep_graphs!r}")
        if not isinstance(self.attention_outputs_on_host, bool):
            raise LongStrawError(f"attention_outputs_on_host must be a bool, got {self.attention_outputs_on_host!r}")
        if self.branch_rows is not None and (not _is_int(self.branch_rows) or self.branch_rows < 1):
            raise LongStrawError(f"branch_rows must be a positive int or None, got {self.branch_rows!r}")
        if self.head_chunk_size is not None and (not _is_int(self.head_chunk_size) or self.head_chunk_size < 1):
            raise LongStrawError(f"head_chunk_size must be a positive int or None, got {self.head_chunk_size!r}")
        if not isinstance(self.cuda_graphs, bool):
            raise LongStrawError(f"cuda_graphs must be a bool, got {self.cuda_graphs!r}")
        if not isinstance(self.check_finite, bool):
            raise LongStrawError(f"check_finite must be a bool, got {self.check_finite!r}")
        if self.progress is not None and not isinstance(self.progress, bool):
            raise LongStrawError(f"progress must be None, True or False, got {self.progress!r}")
        if self.context_parallel is not None:
            import torch.distributed as dist

            if not (dist.is_available() and isinstance(self.context_parallel, dist.ProcessGroup)):
                raise LongStrawError(f"context_parallel must be a torch.distributed ProcessGroup or None, got {self.context_parallel!r}")
        if self.on_unsupported not in ("error", "eager"):
            raise LongStrawError(f"on_unsupported must be 'error' or 'eager', got {self.on_unsupported!r}")

    @classmethod
    def from_any(cls, options: "Options | Mapping[str, Any] | None") -> "Options":
        if options is None:
            return cls()
        if isinstance(options, Options):
            return options
        unknown = set(options) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise LongStrawError(f"unknown longstraw option(s) {sorted(unknown)}; valid: {[f.name for f in dataclasses.fields(cls)]}")
        return cls(**options)


def _is_int(value: object) -> bool:
    """An int that is not a bool (`True` is an int to Python, not a size to a user)."""
    return isinstance(value, int) and not isinstance(value, bool)
