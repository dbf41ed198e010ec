"""Errors the backend raises on purpose, each naming the node that caused it."""

from __future__ import annotations

import os

import torch
import torch.fx as fx


class LongStrawError(RuntimeError):
    """Base class of every error LongStraw raises deliberately."""


class UnsupportedGraphError(LongStrawError):
    """The loss graph cannot be rewritten into prompt capture plus branch replay.
    `node`: the graph node at fault, where there is one."""

    def __init__(self, message: str, node: fx.Node | None = None) -> None:
        super().__init__(message)
        self.node = node


class InputError(LongStrawError):
    """The runtime inputs break an assumption the compiled plan relies on."""


USE_SDPA = "load the model with attn_implementation='sdpa' (or call model.set_attn_implementation('sdpa'))"
"""The fix for attention LongStraw does not claim (eager, flex)."""


def describe_node(node: fx.Node) -> str:
    """Operator, module path and user source line of a node, for error messages."""
    if isinstance(node.target, torch._ops.OpOverload):
        target = node.target.name()  # `namespace::name`: where a custom operator comes from
    else:
        target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    parts = [f"operator `{target}` (node `{node.name}`)"]
    module = module_path(node)
    if module:
        parts.append(f"in module `{module}`")
    frame = source_line(node)
    if frame:
        parts.append(f"at {frame}")
    return " ".join(parts)


def module_path(node: fx.Node) -> str | None:
    """The innermost module the node was traced in (`model.layers.0.self_attn`)."""
    stack = node.meta.get("nn_module_stack")
    return clean_module_path(list(stack.values())[-1][0]) if stack else None


def name_arguments(gm: fx.GraphModule) -> None:
    """Record the user's name of each graph input (`offset`,
    `model.lm_head.weight`) from Dynamo's source while it is there: Dynamo
    drops `grapharg` once compilation returns, before the first call plans."""
    for node in gm.graph.find_nodes(op="placeholder"):
        source = getattr(node.meta.get("grapharg"), "source", None)
        if source is not None:
            node.meta["longstraw_argument"] = clean_module_path(source.name)


def argument_name(node: fx.Node) -> str:
    """The user's name of a graph input, else the node's name."""
    return node.meta.get("longstraw_argument", node.name)


def clean_module_path(path: str) -> str:
    """`L['model']._modules['model'].layers[0]` -> `model.model.layers.0`."""
    out = path.replace("L['", "").replace("']", "")
    for attr in ("._modules['", "._parameters['", "._buffers['"):
        out = out.replace(attr, ".")
    out = out.replace("['", ".")
    return out.replace("[", ".").replace("]", "")


def source_line(node: fx.Node) -> str | None:
    """`file:line (function)` of the recorded stack trace's innermost frame
    outside PyTorch itself (a node traced inside `flex_attention` or `vmap`
    is named by the user's line that called it)."""
    trace = node.meta.get("stack_trace")
    if not trace:
        return None
    frames = [line.strip() for line in trace.strip().splitlines() if line.strip().startswith("File ")]
    if not frames:
        return None
    outside = [f for f in frames if not _in_torch(f)]
    # 'File "/x/y.py", line 12, in forward' -> '/x/y.py:12 (forward)'
    last = (outside or frames)[-1]
    try:
        path = last.split('"')[1]
        lineno = last.split("line ")[1].split(",")[0]
        func = last.rsplit("in ", 1)[1]
        return f"{path}:{lineno} ({func})"
    except IndexError:
        return last


TORCH_DIR = os.path.dirname(torch.__file__)


def _in_torch(frame: str) -> bool:
    parts = frame.split('"')
    return len(parts) > 1 and os.path.normpath(parts[1]).startswith(TORCH_DIR + os.sep)


def experts_hint(node: fx.Node) -> str:
    """What to do when `node` sits in an HF experts module, else ''."""
    for _, cls in (node.meta.get("nn_module_stack") or {}).values():
        name = (cls if isinstance(cls, str) else getattr(cls, "__qualname__", "")).rsplit(".", 1)[-1]
        if name.endswith("Experts"):
            return (f" It is in HF's experts module `{name}`, whose experts implementation reorders token rows in a way "
                    f"LongStraw does not prove per position (grouped_mm sorts them by expert). LongStraw runs HF's "
                    f"grouped_mm as one per-position operator (`longstraw::moe_experts`) only for experts modules that "
                    f"are not expert-parallel, have no post-expert norm, and use HF's default gate and the activation "
                    f"class their config's `hidden_act` names; {USE_BATCHED_MM}.")
    return ""


def positions_hint(node: fx.Node) -> str:
    """What to do when `node` is a cumsum over an integer or boolean input
    (position ids computed from the attention mask), else ''."""
    if getattr(node.target, "__name__", node.target) != "cumsum":
        return ""
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        value = n.meta.get("longstraw_value")
        if n.op == "placeholder" and isinstance(value, torch.Tensor) and not value.is_floating_point():
            return (" It counts along an input (position ids from the attention mask, `mask.cumsum(-1) - 1`, as "
                    "HF's `generate` computes them), which the steps do not compute position by position: compute the "
                    "position ids outside the compiled loss and pass them in as a [G, L] input (the same over the "
                    "prompt for every row), or pass none (HF then numbers positions 0..L-1, as TRL's training forward "
                    "does).")
        stack.extend(n.all_input_nodes)
    return ""


USE_BATCHED_MM = (
    "LongStraw proves HF's batched_mm experts per position (each token's rows are its own): call "
    "`model.set_experts_implementation('batched_mm')` before compiling"
)


# HF layers whose operators LongStraw claims only after a model module binds
# them (class name -> the module whose `bound()` does it).
_NEEDS_BINDING = {"Qwen3_5GatedDeltaNet": "longstraw.models.qwen3_5", "Qwen3NextGatedDeltaNet": "longstraw.models.qwen3_5"}


def binding_hint(node: fx.Node) -> str:
    """What to bind when `node` sits in an HF layer that needs it, else ''."""
    for _, cls in (node.meta.get("nn_module_stack") or {}).values():
        name = (cls if isinstance(cls, str) else getattr(cls, "__qualname__", "")).rsplit(".", 1)[-1]
        if name in _NEEDS_BINDING:
            package, _, module = _NEEDS_BINDING[name].rpartition(".")
            return (f" HF's `{name}` reaches LongStraw's operators through `{package}.{module}`, which stands them in "
                    f"for HF's functions in every trace once longstraw is imported, except inside `{module}.unbound()`; "
                    f"`from {package} import {module}` and `{module}.bind()` routes eager calls as well.")
    return ""
