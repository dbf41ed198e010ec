"""Errors the backend raises on purpose, each naming the node that caused it."""

from __future__ import annotations

import torch.fx as fx


class LongStrawError(RuntimeError):
    """Base class of every error LongStraw raises deliberately."""


class UnsupportedGraphError(LongStrawError):
    """The loss graph cannot be rewritten into prompt capture plus branch replay."""


class InputError(LongStrawError):
    """The runtime inputs break an assumption the compiled plan relies on."""


def describe_node(node: fx.Node) -> str:
    """Operator, module path and user source line of a node, for error messages."""
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
    return _clean_module_path(list(stack.values())[-1][0]) if stack else None


def _clean_module_path(path: str) -> str:
    """`L['model']._modules['model'].layers[0]` -> `model.model.layers.0`."""
    out = path.replace("L['", "").replace("']", "").replace("._modules['", ".").replace("['", ".")
    return out.replace("[", ".").replace("]", "")


def source_line(node: fx.Node) -> str | None:
    """Last `File "...", line N` entry of the recorded user stack trace."""
    trace = node.meta.get("stack_trace")
    if not trace:
        return None
    lines = [line.strip() for line in trace.strip().splitlines() if line.strip().startswith("File ")]
    if not lines:
        return None
    # 'File "/x/y.py", line 12, in forward' -> 'y.py:12 (forward)'
    last = lines[-1]
    try:
        path = last.split('"')[1]
        lineno = last.split("line ")[1].split(",")[0]
        func = last.rsplit("in ", 1)[1]
        return f"{path}:{lineno} ({func})"
    except IndexError:
        return last


# HF layers whose operators LongStraw claims only after a model module binds
# them (class name -> the module whose `bound()` does it).
_NEEDS_BINDING = {"Qwen3_5GatedDeltaNet": "longstraw.models.qwen3_5"}


def binding_hint(node: fx.Node) -> str:
    """What to bind when `node` sits in an HF layer that needs it, else ''."""
    for _, cls in (node.meta.get("nn_module_stack") or {}).values():
        name = (cls if isinstance(cls, str) else getattr(cls, "__qualname__", "")).rsplit(".", 1)[-1]
        if name in _NEEDS_BINDING:
            module = _NEEDS_BINDING[name]
            return (f" HF's `{name}` runs through LongStraw's operators only when bound: `from {module.rsplit('.', 1)[0]} "
                    f"import {module.rsplit('.', 1)[1]}` and call the model inside `with {module.rsplit('.', 1)[1]}.bound():` "
                    f"(or `{module.rsplit('.', 1)[1]}.bind()` once).")
    return ""
