"""Whether Dynamo handed the backend the whole loss or a piece of it.

LongStraw needs the loss as one graph: the model's forward over the group
and the reduction to the loss. Dynamo hands a backend pieces when the
traced code breaks the graph (`.item()`, a function Dynamo skips, DDP's or
FSDP2's hooks) and when DDP's optimizer splits the graph at gradient
buckets. The analysis of a piece fails for reasons that have nothing to do
with the piece ("no attention", "returned with its full sequence axis"),
so the backend looks at where the graph came from while Dynamo compiles it
and reports that instead:

- `gm.compile_subgraph_reason` (Dynamo's `GraphCompileReason`): the reason
  and user frame of a graph break that ended this graph, or DDPOptimizer's
  split;
- the code Dynamo traced: a `torch_dynamo_resume_in_...` frame is the rest
  of a function after a break;
- the Python stack: a frame up the stack running code Dynamo compiled
  means this graph is a function called from the middle of a compiled
  one, which broke there (a DDP- or FSDP2-wrapped model called inside the
  loss).

A break inside DDP's forward or FSDP2's hooks, and DDPOptimizer's split,
get the recipe that avoids them (`DDP_RECIPE`, `FSDP_RECIPE`).
"""

from __future__ import annotations

import inspect
import os
import re
import sys
import types

import torch
import torch.fx as fx

from longstraw.errors import HF_EXPERTS_DISPATCH, NO_FIX, TORCH_DIR, USE_BATCHED_MM, sdpa_advice

_HOW = (
    "LongStraw needs the whole loss in one graph; `torch._dynamo.explain(loss_fn)(*args)` lists every graph break, "
    "and compiling with fullgraph=True stops at the first."
)
DDP_RECIPE = (
    "add `torch._dynamo.config.optimize_ddp = False` before the first call and compile DDP around the model and "
    "the loss together: `torch.compile(DDP(longstraw.LossModule(model, loss_fn)), backend=\"longstraw\")`, called "
    "with the loss's other arguments"
)
FSDP_RECIPE = (
    "apply `fully_shard` only to the module whose forward returns the loss, not to its layers, and compile that "
    "module: `module = longstraw.LossModule(model, loss_fn)`, `fully_shard(module)`, "
    "`torch.compile(module, backend=\"longstraw\")`"
)
DDP_SPLIT = (
    "Dynamo's DDP optimizer split the loss at DDP's gradient buckets before LongStraw saw it "
    "(`torch._dynamo.config.optimize_ddp`, on by default; a backend cannot turn it off). To use DDP, "
    f"{DDP_RECIPE}. DDP then reduces the gradients LongStraw returns exactly as in eager (after the backward, "
    "without overlap)."
)
# HF's eager experts loop runs only the experts some token routes to (`nonzero`, then a Python loop over them).
_EXPERTS_LOOP = (
    "This is HF's eager experts loop (`experts_implementation='eager'`), which iterates over the experts the "
    f"tokens route to, a number Dynamo cannot trace into one graph. {USE_BATCHED_MM} (or 'grouped_mm', HF's "
    "default, which LongStraw runs as one per-position operator, `longstraw::moe_experts`)"
)
# A model's own loop (DBRX, JetMoE, LongCat-Flash): HF's experts implementations do not replace it.
_OWN_EXPERTS_LOOP = (
    "This is the model's own experts loop, which iterates over the experts the tokens route to, a number Dynamo "
    "cannot trace into one graph. HF's `set_experts_implementation` does not replace it (only experts classes "
    f"decorated with HF's `use_experts_implementation` dispatch on it), so this family is not supported. {NO_FIX}"
)
_HF_OUTPUT_CAPTURING = os.path.join("transformers", "utils", "output_capturing.py")
_ROUTER_LOGITS = (
    "HF collects `output_router_logits` (and `output_attentions`, `output_hidden_states`) through hooks Dynamo "
    "cannot trace: leave them off. A router's load-balancing loss averages routing over every position of the "
    "group, so LongStraw cannot run it per position anyway; compute it in a separate eager pass if you need it."
)
_EVAL_FRAME = os.path.join(TORCH_DIR, "_dynamo", "eval_frame.py")
_RAISED = re.compile(r"raised exception (?P<exception>\w+\(.*\))\s*$", re.MULTILINE)
_LOGGER_CALL = re.compile(r"method: <Logger (?P<name>\S+) \(\w+\)>\.(?P<method>\w+)")
# HF's flex path breaks in create_block_mask before any flex_attention node is traced.
_FLEX_ATTENTION = os.path.join(TORCH_DIR, "nn", "attention", "flex_attention.py")
# PEFT's LoRA on a parameter it wraps directly (`ParamWrapper`: a MoE's 3-D expert weights, which
# `target_modules="all-linear"` reaches) registers a parametrization at every forward, which Dynamo does not trace.
_PARAMETRIZE = os.path.join(TORCH_DIR, "nn", "utils", "parametrize.py")
_PARAMETRIZED_ADAPTER = (
    "The break is in torch.nn.utils.parametrize, which PEFT uses for a LoRA adapter on a parameter it wraps "
    "directly (`ParamWrapper`, e.g. a mixture of experts' expert weights, which `target_modules=\"all-linear\"` "
    "reaches); Dynamo does not trace it. Leave those parameters out of the adapter: name the modules, e.g. "
    "`target_modules=[\"q_proj\", \"k_proj\", \"v_proj\", \"o_proj\"]`"
)
# Graph breaks inside these files, and what to do: in DDP's forward or FSDP2's hooks, the wrapper ran inside
# the compiled function (Dynamo's own hints there are about torch's internals).
_BREAK_FIXES = (
    (
        os.path.join(TORCH_DIR, "nn", "parallel", "distributed.py"),
        "A DistributedDataParallel module called inside the compiled function breaks the graph. To use DDP, "
        f"{DDP_RECIPE}.",
    ),
    (
        os.path.join(TORCH_DIR, "distributed", "fsdp", "_fully_shard", ""),
        "FSDP2 (`fully_shard`) runs its hooks outside the graph around every sharded module the compiled function "
        f"calls, which breaks the graph there. To use FSDP2, {FSDP_RECIPE}.",
    ),
)


def is_ddp_split(gm: fx.GraphModule) -> bool:
    reason = getattr(gm, "compile_subgraph_reason", None)
    return reason is not None and reason.reason.startswith("DDPOptimizer")


def partial_graph_reason(gm: fx.GraphModule) -> str | None:
    """Why `gm` is only part of the compiled function, or None. Call while
    Dynamo compiles (from the backend's `__call__`)."""
    if is_ddp_split(gm):
        return DDP_SPLIT
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is not None and reason.graph_break:
        return f"Dynamo broke the graph {_describe(reason)}. {_HOW}"
    context = torch._guards.TracingContext.try_get()
    code = context.traced_code[0].co_name if context is not None and context.traced_code else ""
    if code.startswith("torch_dynamo_resume_in_"):
        breaks = [r for r in torch._dynamo.utils.graph_break_reasons if r.graph_break]
        last = f": Dynamo broke the graph {_describe(breaks[-1])}" if breaks else ""
        return f"this graph is the rest of a function after a graph break (`{code}`){last}. {_HOW}"
    skipped = _skipped_compiled_function(context.traced_code[0] if context is not None and context.traced_code else None)
    if skipped is not None:
        return skipped
    caller = _compiled_caller()
    if caller is not None:
        return (
            f"this graph is `{code or 'a function'}`, compiled on its own because the compiled function {caller} "
            "broke the graph where it calls it. A model wrapped by DDP or FSDP2 called inside the loss does this: "
            f"to use DDP, {DDP_RECIPE}; to use FSDP2, {FSDP_RECIPE}. {_HOW}"
        )
    return None


def _describe(reason) -> str:
    """`at file:line (function)[, called from ...]: reason [hints]` of a GraphCompileReason."""
    stack = reason.user_stack
    where = f"at {_frame(stack[-1])}" if stack else "at an unknown line"
    if len(stack) > 1:
        where += f", called from {_frame(stack[0])}"
    lines = [line.strip() for line in reason.reason.strip().splitlines() if line.strip()]
    hints = [line for line in lines[1:] if line.startswith("Hint:")]
    # In flex attention and in an experts loop, Dynamo's hints (skip a logging call, capture the dynamic shape or
    # the scalar) only move the break: what applies replaces them.
    if any(os.path.normpath(f.filename) == _FLEX_ATTENTION for f in stack):
        advice = sdpa_advice(_hf_model_bases(stack))
        hints = [f"The break is inside flex attention, which LongStraw does not claim: {advice}."]
    if any(os.path.normpath(f.filename) == _PARAMETRIZE for f in stack):
        hints = [_PARAMETRIZED_ADAPTER]  # Dynamo's hints (move a context manager out) do not apply to PEFT's
    hints += [fix for prefix, fix in _BREAK_FIXES if any(os.path.normpath(f.filename).startswith(prefix) for f in stack)]
    if stack and "expert" in (stack[-1].line or ""):
        loop = _EXPERTS_LOOP if any(f.filename.endswith(HF_EXPERTS_DISPATCH) for f in stack) else _OWN_EXPERTS_LOOP
        hints = [h for h in hints if not h.startswith("Hint:")] + [loop]
    if stack and stack[-1].filename.endswith(_HF_OUTPUT_CAPTURING):
        hints.append(_ROUTER_LOGITS)
    logger_call = _LOGGER_CALL.search(reason.reason)
    if logger_call is not None:
        call = f"logging.getLogger({logger_call['name']!r}).{logger_call['method']}"
        lines, hints = [f"a logging call, `{call}(...)`, which Dynamo does not trace."], [_logger_fix(call)]
    return f"{where}: {' '.join(lines[:1] + hints)}".rstrip(".")  # the caller ends the sentence


def _logger_fix(call: str) -> str:
    """The working form of Dynamo's hint for a logger call inside the loss."""
    return (
        f"Make it a no-op in traces before the first call, `torch._dynamo.config.ignore_logging_functions"
        f".add({call})`, or move it out of the compiled function "
        "(LongStraw already ignores transformers' `warning_once`, `info_once` and `warning_advice`)."
    )


def _hf_model_bases(stack) -> list[type]:
    """The `...PreTrainedModel` classes defined in the files the break's
    frames ran, outermost frame first: a graph break has no module stack,
    and HF's flags (`_supports_sdpa`) sit on its modeling file's base class."""
    modules = {os.path.normpath(m.__file__): m for m in list(sys.modules.values()) if getattr(m, "__file__", None)}
    found = [modules[f] for f in (os.path.normpath(f.filename) for f in stack) if f in modules]
    return [c for m in found for c in vars(m).values()
            if isinstance(c, type) and c.__module__ == m.__name__ and c.__name__.endswith("PreTrainedModel")]


def _frame(summary) -> str:
    return f"{os.path.basename(summary.filename)}:{summary.lineno} ({summary.name})"


def _skipped_compiled_function(traced: types.CodeType | None) -> str | None:
    """Why Dynamo hands over a function the compiled function calls, not
    the compiled function itself, or None. Dynamo gives up on a frame it
    cannot trace (an exception the code raises in eager too, such as
    indexing a Python list with `[:, None]`), runs it uncompiled and
    compiles the functions it calls (the model's forward): the graph is
    then not the loss, and the user's own error is the thing to show."""
    frame = inspect.currentframe()
    while frame is not None:
        compiled = frame.f_locals.get("fn") if frame.f_code.co_filename == _EVAL_FRAME else None
        if inspect.isfunction(compiled) and compiled.__code__ is not traced:
            failure = _failed_compile(compiled.__code__)
            if failure is not None:
                code, callee = compiled.__code__, traced.co_name if traced else "a function"
                where = f"`{code.co_name}` ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"
                return (
                    f"Dynamo could not trace the compiled function {where}: {failure} Dynamo then runs "
                    f"`{code.co_name}` uncompiled and hands LongStraw only `{callee}`, which it calls, so this "
                    "graph is not the loss. Fix the loss as you would in eager (run it without torch.compile to see "
                    "the traceback)"
                )
        frame = frame.f_back
    return None


def _failed_compile(code: types.CodeType) -> str | None:
    """Dynamo's reason for the latest failed compile of `code`, the
    exception its code raised first where that was the cause."""
    from torch._dynamo.utils import get_compilation_metrics

    for metrics in reversed(get_compilation_metrics()):
        if (metrics.co_name, metrics.co_filename, metrics.co_firstlineno) != (
            code.co_name, code.co_filename, code.co_firstlineno
        ):
            continue
        if not metrics.fail_reason:
            return None
        raised = _RAISED.search(metrics.fail_reason)
        if raised is not None:
            return f"the loss raises {raised['exception']} in eager too."
        return f"{metrics.fail_reason.strip().splitlines()[0].rstrip('.')}."
    return None


def _compiled_caller() -> str | None:
    """A user function up the Python stack that runs code Dynamo compiled."""
    frame = inspect.currentframe()
    while frame is not None:
        original = torch._dynamo.utils.orig_code_map.get(frame.f_code)
        if original is not None and not original.co_filename.startswith(TORCH_DIR):
            return f"`{original.co_name}` ({os.path.basename(original.co_filename)}:{original.co_firstlineno})"
        frame = frame.f_back
    return None
