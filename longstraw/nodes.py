"""Predicates over Dynamo FX nodes, shared by the analyses and the passes.

Dynamo records torch-level calls: `call_function` nodes whose target is a
torch function or an `operator` builtin, and `call_method` nodes whose target
is a Tensor method name. `op_name` folds both into one vocabulary.
"""

from __future__ import annotations

from typing import Any, Collection, Iterable

import torch
import torch.fx as fx


def op_name(node: fx.Node) -> str:
    """A single name for the operation a node performs (`linear`, `view`, `mul`...)."""
    if node.op == "call_method":
        return str(node.target)
    if node.op == "call_function":
        name = getattr(node.target, "__name__", str(node.target))
        return name.lstrip("_") if name in ("__and__", "__or__", "__xor__", "__invert__") else name
    return node.op


def is_call(node: fx.Node) -> bool:
    return node.op in ("call_function", "call_method")


def is_sdpa(node: fx.Node) -> bool:
    return node.op == "call_function" and op_name(node) == "scaled_dot_product_attention"


def is_grad_mode_switch(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch._C._set_grad_enabled


def is_side_effect(node: fx.Node) -> bool:
    """Nodes that return nothing but must keep their place in the program."""
    return node.op == "call_function" and node.target in (
        torch._C._set_grad_enabled,
        torch._C._log_api_usage_once,
    )


def tensor_of(node: fx.Node) -> torch.Tensor | None:
    value = node.meta.get("longstraw_value")
    return value if isinstance(value, torch.Tensor) else None


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """Input nodes whose values are tensors, in argument order, without duplicates."""
    seen: dict[fx.Node, None] = {}
    for arg in node.all_input_nodes:
        if tensor_of(arg) is not None:
            seen[arg] = None
    return list(seen)


def arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Positional-or-keyword argument lookup."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def size_args(node: fx.Node) -> list[Any]:
    """The size list of view/reshape/expand-like calls (and `permute`'s
    order), which Dynamo records as varargs `x.view(3, 17, -1)`, one tuple
    `x.view((3, 17, -1))` or a keyword `x.permute(dims=(2, 0, 1))`."""
    rest = node.args[1:]  # the tensor first, as the method's self or the function's input
    if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)):
        return list(rest[0])
    named = next((node.kwargs[k] for k in ("size", "shape", "dims") if k in node.kwargs), None)  # permute: dims
    if not rest and named is not None:
        return list(named)
    return list(rest)


def ancestors(nodes: Iterable[fx.Node], stop: Collection[fx.Node] = ()) -> set[fx.Node]:
    """`nodes` and everything they are computed from, not looking past `stop`."""
    seen: set[fx.Node] = set()
    stack = list(nodes)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            if n not in stop:
                stack.extend(n.all_input_nodes)
    return seen


RANDOM_OPS = frozenset({
    "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout", "native_dropout",
    "rand", "randn", "rand_like", "randn_like", "randint", "randint_like", "randperm", "bernoulli", "bernoulli_",
    "multinomial", "normal", "normal_", "uniform_", "exponential_", "rrelu",
})


def is_random(node: fx.Node) -> bool:
    """Draws from the random number generator (dropout, rand, bernoulli...),
    also as an in-place op turned into `functionalize.updated(x, "normal_")`."""
    if not is_call(node):
        return False
    name = op_name(node)
    return (node.args[1] if name == "updated" else name) in RANDOM_OPS
