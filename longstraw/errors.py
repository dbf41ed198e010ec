"""Errors the backend raises on purpose, each naming the node that caused it."""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
import torch.fx as fx

from longstraw.nodes import ancestors, is_random, op_name


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


NO_FIX = "LongStraw has no fix for this yet"
"""What a refusal says when nothing the user can do makes the model compile;
every other refusal names a fix (the families suite follows each one)."""

USE_SDPA = "load the model with attn_implementation='sdpa' (or call model.set_attn_implementation('sdpa'))"
"""The fix for attention LongStraw does not claim (eager, flex), where HF runs the model with SDPA."""


def module_classes(node: fx.Node) -> list[type | str]:
    """The classes of the modules `node` was traced in, outermost first."""
    return [cls for _, cls in (node.meta.get("nn_module_stack") or {}).values()]


def class_name(cls: type | str) -> str:
    """`Qwen3MoeExperts`, from a class or the qualified name Dynamo may record instead."""
    return (cls if isinstance(cls, str) else getattr(cls, "__qualname__", str(cls))).rsplit(".", 1)[-1]


USE_EAGER = ("load the model with attn_implementation='eager' (or call model.set_attn_implementation('eager')): "
             "LongStraw runs its eager attention with sinks (`longstraw.models.sinks`)")
"""The fix for other attention of a model whose eager sink attention LongStraw runs (gpt-oss, MiMo-V2-Flash)."""


def sdpa_advice(classes: Iterable[type | str]) -> str:
    """USE_SDPA, unless the innermost HF model among `classes` refuses SDPA
    (`_supports_sdpa = False`: HF raises on attn_implementation='sdpa'),
    where advising it would send the user to an error: USE_EAGER where a
    model binding runs its eager attention."""
    from longstraw.models import BINDINGS

    for cls in reversed(list(classes)):
        supports = getattr(cls, "_supports_sdpa", None) if isinstance(cls, type) else None
        if supports is False and BINDINGS.get(cls.__module__) == "longstraw.models.sinks":
            return USE_EAGER
        if supports is False:
            return (f"HF does not run `{cls.__name__}` with SDPA (`_supports_sdpa = False`; attn_implementation='sdpa' "
                    f"raises), so this family is not supported. {NO_FIX}")
        if supports is True:
            break
    return USE_SDPA


def describe_node(node: fx.Node) -> str:
    """Operator, module path and user source line of a node, for error messages."""
    if isinstance(node.target, torch._ops.OpOverload):
        target = node.target.name()  # `namespace::name`: where a custom operator comes from
    else:
        target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    if target == "updated" and len(node.args) > 1 and isinstance(node.args[1], str):
        parts = [f"operator `{node.args[1]}` (in place, node `{node.name}`)"]  # `functionalize.updated(x, op)`
    else:
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


HF_EXPERTS_DISPATCH = os.path.join("transformers", "integrations", "moe.py")
"""HF's `use_experts_implementation` dispatcher, the frame between an experts module and its eager loop."""


def uses_hf_experts_dispatch(cls: type | str) -> bool:
    """Whether HF's `set_experts_implementation` reaches this experts class:
    only classes decorated with `use_experts_implementation` (whose forward is
    the dispatcher in `transformers/integrations/moe.py`) read it."""
    forward = getattr(cls, "forward", None)
    code = getattr(forward, "__code__", None)
    return code is not None and code.co_filename.endswith(HF_EXPERTS_DISPATCH)


def experts_hint(node: fx.Node) -> str:
    """What to do when `node` sits in an HF experts module that HF's experts
    implementations reach, else ''."""
    for cls in module_classes(node):
        name = class_name(cls)
        if name.endswith("Experts") and uses_hf_experts_dispatch(cls):
            return (f" It is in HF's experts module `{name}`, whose experts implementation reorders token rows in a way "
                    f"LongStraw does not prove per position (grouped_mm sorts them by expert). LongStraw runs HF's "
                    f"grouped_mm as one per-position operator (`longstraw::moe_experts`) only for experts modules that "
                    f"are not expert-parallel, have no post-expert norm, and use HF's default gate and the activation "
                    f"class their config's `hidden_act` names; {USE_BATCHED_MM}.")
    return ""


def random_hint(node: fx.Node) -> str:
    """Why a random draw over the sequence cannot run once for the group, and
    what applies: a router that samples its experts in train mode routes
    deterministically in eval mode; other draws have no fix."""
    if not is_random(node):
        return ""
    draw = node.args[1] if op_name(node) == "updated" else op_name(node)
    why = (f" It draws random numbers (`{draw}`) for every position: in eager each row of the group draws its own for "
           "its copy of the prompt, so the rows' prompts differ and there is no shared prompt to compute once.")
    classes = module_classes(node)
    router = class_name(classes[-1]) if classes else ""
    if router.endswith("Router"):
        return (f"{why} It is in HF's `{router}`, which samples the experts each token goes to in train mode: call "
                f"`.eval()` on every `{router}` (or `model.eval()`) before the compiled call, and each token goes to "
                "its top-k experts, as HF routes at inference (`model.train()` turns the sampling back on).")
    return f"{why} {NO_FIX}."


def positions_hint(node: fx.Node) -> str:
    """What to do when `node` is a cumsum that numbers positions (it reads
    no float input: a mask, or a mask of ones the model builds), else ''.
    Inside the model, the model numbers positions because it was given none
    (HF's OPT); in the loss, the loss computes them from the mask."""
    if op_name(node) != "cumsum":
        return ""
    inputs = [n.meta.get("longstraw_value") for n in ancestors([node]) if n.op == "placeholder"]
    if not all(isinstance(v, torch.Tensor) and not v.is_floating_point() for v in inputs):
        return ""
    if module_path(node) is not None:
        return (" The model numbers positions itself (as HF's OPT counts the attention mask, or a mask of ones, when "
                "it is given no position ids), which the steps do not compute position by position: pass the "
                "position ids to the model, `position_ids=torch.arange(L).expand(G, -1)` for [G, L] input ids "
                "without padding (built in the loss or outside it), else computed from the mask outside the compiled "
                "loss and passed in as a [G, L] input.")
    return (" It counts along an input (position ids from the attention mask, `mask.cumsum(-1) - 1`, as "
            "HF's `generate` computes them), which the steps do not compute position by position: compute the "
            "position ids outside the compiled loss and pass them in as a [G, L] input (the same over the "
            "prompt for every row), or pass none (HF then numbers positions 0..L-1, as TRL's training forward "
            "does).")


USE_BATCHED_MM = (
    "LongStraw proves HF's batched_mm experts per position (each token's rows are its own): call "
    "`model.set_experts_implementation('batched_mm')` before compiling"
)


# HF layers whose operators LongStraw claims only after a model module binds
# them (class name -> the module whose `bound()` does it).
_NEEDS_BINDING = {
    "Qwen3_5GatedDeltaNet": "longstraw.models.qwen3_5",
    "Qwen3_5MoeGatedDeltaNet": "longstraw.models.qwen3_5",
    "Qwen3NextGatedDeltaNet": "longstraw.models.qwen3_5",
    "OlmoHybridGatedDeltaNet": "longstraw.models.qwen3_5",
}


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
