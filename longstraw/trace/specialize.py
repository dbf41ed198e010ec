"""Prepare Dynamo's graph for analysis, for one input signature.

`specialize(gm, args)` returns a copy of the graph that the later stages can
reason about by values flowing along edges:

1. regions inlined: activation checkpointing (`tag_activation_checkpoint`,
   what `gradient_checkpointing_enable()` and `torch.utils.checkpoint`
   trace to) and plain `wrap` regions become ordinary nodes. The prompt is
   captured without autograd and branches are replayed anyway, so
   checkpointing buys nothing here, and gradients are the same. Functorch
   transforms (`torch.vmap`, which flex attention's block mask uses) are
   refused: their batched values have no storage and their level
   bookkeeping calls return integers, which step 3 would fold away;
2. values recorded: FakeTensor propagation at these argument sizes, or,
   for a graph Dynamo traced with dynamic shapes and planned before, its
   symbolic example values evaluated at these sizes (`symbolic_values.py`);
3. sizes folded: every integer the graph computes, and every tuple of them
   (a shape read whole, `x.size()[:-1] + (n,)`), becomes a constant, so
   graphs traced with `dynamic=True` plan like static ones. An integer that
   comes from an argument's *value* (`n.item()` of a tensor argument) is
   folded too, and the plan is keyed on that value (`Specialization.guards`).
   Float values (`beta.item()`, the form Dynamo gives a Python float it made
   dynamic) are never folded: they stay nodes computed at every call;
4. writes removed (`functionalize.py`);
5. common subexpressions merged within each grad-mode region (a loss that
   builds the same `cat([prompt.expand(G, -1), responses])` twice, once
   per model, has one sequence);
6. dead code removed.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

from longstraw.errors import UnsupportedGraphError, describe_node, module_classes, sdpa_advice
from longstraw.trace.functionalize import StorageOwners, functionalize
from longstraw.trace.symbolic_values import ValueTemplates, agree, remember, same_value, templates_of
from longstraw.analysis.dim_types import ELEMENTWISE
from longstraw.nodes import ancestors, is_call, is_random, is_side_effect, op_name

log = logging.getLogger("longstraw.trace.specialize")


@dataclasses.dataclass(frozen=True)
class Specialization:
    """A specialised graph and the argument values its plan is valid for."""

    gm: fx.GraphModule
    guards: tuple[tuple[int, Any], ...]
    """(argument index, value) for every argument whose value the plan folded."""


def scalar_of(value: Any) -> Any:
    """What a guard compares: the Python value of a one-element tensor, else the value."""
    return value.item() if isinstance(value, torch.Tensor) else value


def specialize(gm: fx.GraphModule, args: Sequence[Any], templates: bool = True) -> Specialization:
    """`templates`: where `symbolic_values` learned the templates of `gm` at
    an earlier call, read the values off them instead of propagating. The
    first call of a graph propagates and learns them, and keeps them only if
    specialising from them there gives back the same graph and values."""
    learned, known = templates_of(gm)
    if templates and known is not None:
        fast = _specialized(gm, args, known)
        if fast is not None:
            return fast
    result, candidate = _propagated(gm, args, learn=not learned)
    if not learned:
        try:
            check = None if candidate is None else _specialized(gm, args, candidate)
        except UnsupportedGraphError:  # propagation planned this graph: the templates are at fault
            log.debug("templates of a graph dropped", exc_info=True)
            check = None
        agrees = check is not None and check.guards == result.guards and agree(check.gm, result.gm)
        if candidate is not None and not agrees:
            log.debug("templates of a graph dropped: they do not give back what propagation gave")
        remember(gm, candidate if agrees else None)
    return result


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    copy = _LazyGraphModule(gm, graph)  # its code is generated only if something reads or runs it
    _inline_regions(copy)
    _refuse_transforms(copy.graph)
    _positional_operator_calls(copy.graph)
    return copy


def _propagated(gm: fx.GraphModule, args: Sequence[Any], learn: bool) -> tuple[Specialization, ValueTemplates | None]:
    """The specialisation by FakeTensor propagation, and where `learn`, the
    templates read off its first propagation (before any rewrite)."""
    copy = _copy(gm)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    fake_args = [fake_mode.from_tensor(a, static_shapes=True) if isinstance(a, torch.Tensor) else a for a in args]
    _record(copy, fake_mode, fake_args, args)
    learned = ValueTemplates.learn(copy) if learn else None
    guards = _fold_integers(copy, args)
    values = {n: n.meta.get("longstraw_value") for n in copy.graph.nodes}
    if functionalize(copy, values):
        _record(copy, fake_mode, fake_args, args)
    return _finished(copy, guards), learned


def _specialized(gm: fx.GraphModule, args: Sequence[Any], templates: ValueTemplates) -> Specialization | None:
    """The specialisation with values read off `templates`; None where they
    cannot give this call's. After functionalisation only the nodes it
    rewrote, and those whose inputs' values changed with them, propagate."""
    copy = _copy(gm)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    if not templates.fill(copy, args, fake_mode):
        return None
    guards = _fold_integers(copy, args)
    values = {n: n.meta.get("longstraw_value") for n in copy.graph.nodes}
    before = {n: (n.args, n.kwargs) for n in copy.graph.nodes}
    owners = StorageOwners.of_graph(copy)
    if functionalize(copy, values):
        _record_rewritten(copy, before, owners, fake_mode, args)
    return _finished(copy, guards)


def _finished(copy: fx.GraphModule, guards: tuple[tuple[int, Any], ...]) -> Specialization:
    _merge_common(copy.graph)
    copy.graph.eliminate_dead_code()
    copy.recompile()
    return Specialization(copy, guards)


# 1. regions ------------------------------------------------------------------

def _inlined_region(node: fx.Node) -> tuple[fx.Node, tuple] | None:
    """(body, operands) of a higher-order call whose body runs as is."""
    if node.op != "call_function":
        return None
    hop = torch.ops.higher_order
    if node.target in (hop.tag_activation_checkpoint, hop.wrap_activation_checkpoint, hop.wrap):
        return node.args[0], node.args[1:]
    if node.target is hop.invoke_subgraph:
        return node.args[0], node.args[2:]
    return None


def _inline_regions(gm: fx.GraphModule) -> None:
    graph = gm.graph
    changed = True
    while changed:
        changed = False
        for node in list(graph.nodes):
            region = _inlined_region(node)
            if region is None:
                continue
            body_attr, operands = region
            body: fx.GraphModule = getattr(gm, body_attr.target)
            env: dict[fx.Node, Any] = {}
            placeholders = list(body.graph.find_nodes(op="placeholder"))
            env.update(zip(placeholders, operands))
            results: Any = None
            with graph.inserting_before(node):
                for inner in body.graph.nodes:
                    if inner.op == "placeholder":
                        continue
                    if inner.op == "output":
                        results = fx.node.map_arg(inner.args[0], env.__getitem__)
                        continue
                    if inner.op == "get_attr":
                        name = f"{body_attr.target}_{inner.target}".replace(".", "_")
                        setattr(gm, name, getattr(body, inner.target))
                        env[inner] = graph.get_attr(name)
                        continue
                    env[inner] = graph.node_copy(inner, env.__getitem__)
            for user in list(node.users):
                if user.op == "call_function" and user.target is operator.getitem and isinstance(results, (tuple, list)):
                    user.replace_all_uses_with(results[user.args[1]])
                    graph.erase_node(user)
            if node.users:
                node.replace_all_uses_with(results)
            graph.erase_node(node)
            if not body_attr.users:
                graph.erase_node(body_attr)
            changed = True
    graph.lint()


def _refuse_transforms(graph: fx.Graph) -> None:
    """Refuse functorch transforms by name, before they break the later
    stages; flex attention is named instead when it is what brought them."""
    entry = next((n for n in graph.nodes if is_call(n) and op_name(n).endswith("_increment_nesting")), None)
    if entry is None:
        return
    flex = next((n for n in graph.nodes if op_name(n) == "flex_attention"), None)
    if flex is not None:
        raise UnsupportedGraphError(
            f"{describe_node(flex)} is flex attention, which no pass claims: {sdpa_advice(module_classes(flex))}"
        )
    raise UnsupportedGraphError(
        f"{describe_node(entry)} enters a functorch transform (`torch.vmap`, `torch.func.grad`...) inside the loss, "
        "which LongStraw cannot analyse: write it with batched tensor operations, or pass "
        "options={'on_unsupported': 'eager'} to run this graph unchanged."
    )


def _positional_operator_calls(graph: fx.Graph) -> None:
    """Calls of LongStraw's own operators with every argument that can be
    positional made so: Dynamo records keywords as the caller wrote them, and
    the passes read an operator's arguments by position."""
    for node in graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or not node.kwargs \
                or target.namespace != "longstraw":
            continue
        kwargs = dict(node.kwargs)
        args = list(node.args)
        for a in target._schema.arguments[len(args):]:
            if a.kwarg_only:
                break
            args.append(kwargs.pop(a.name) if a.name in kwargs else a.default_value)
        node.args, node.kwargs = tuple(args), kwargs


# 2. values -------------------------------------------------------------------

class _Recorder(fx.Interpreter):
    """FakeTensor propagation that records each node's value; `x.item()` of
    an argument gets the argument's real value (FakeTensors have none)."""

    def __init__(self, gm: fx.GraphModule, args: Sequence[Any]) -> None:
        super().__init__(gm)
        self.real = dict(zip(gm.graph.find_nodes(op="placeholder"), args))

    def run_node(self, n: fx.Node) -> Any:
        if n.op == "call_method" and n.target == "item":
            src = n.args[0]
            if src not in self.real:
                raise UnsupportedGraphError(
                    f"{describe_node(n)} reads a value computed inside the loss (`.item()` of a tensor the loss "
                    "computes, captured with capture_scalar_outputs): the plan cannot depend on it. Keep it a "
                    "tensor (e.g. divide by `mask.sum()`, not `mask.sum().item()`)."
                )
            with unset_fake_temporarily():
                value = self.real[src].item()
        else:
            value = super().run_node(n)
        n.meta["longstraw_value"] = value
        # a later in-place write can make this very tensor require grad; the templates need it as computed
        n.meta["longstraw_requires_grad"] = _requires_grad(value)
        return value


def _requires_grad(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if isinstance(value, (tuple, list)):
        return tuple(_requires_grad(v) for v in value)
    return None


def _record(gm: fx.GraphModule, fake_mode: FakeTensorMode, fake_args: list, args: Sequence[Any]) -> None:
    """Propagate every node in the call's own grad mode, in which Dynamo
    traced the graph: `requires_grad` of a value before the graph's first
    grad-mode switch is then the eager run's (`codegen/stages.py` splits a
    frozen reference off by it)."""
    with fake_mode:
        _Recorder(gm, args).run(*fake_args)


def _record_rewritten(gm: fx.GraphModule, before: dict[fx.Node, tuple], owners_before: dict[fx.Node, tuple],
                      fake_mode: FakeTensorMode, args: Sequence[Any]) -> None:
    """Propagate, after functionalisation, the nodes it added or rewrote
    (`before`: each node's arguments before it), the nodes reading a value
    that changed with them (in layout or in the value it is a view of:
    `owners_before`: `StorageOwners.of_graph` before it), and the
    side effects that set the grad mode or autocast for them; every other
    node keeps its value."""
    recorder = _Recorder(gm, args)
    owners = StorageOwners()
    changed: set[fx.Node] = set()
    with fake_mode:
        for node in gm.graph.nodes:
            old = node.meta.get("longstraw_value")
            if node.op != "placeholder":
                rewritten = node not in before or not _same_arguments(before[node], (node.args, node.kwargs))
                if (rewritten or old is None or any(i in changed for i in node.all_input_nodes)
                        or owners.of(node, old) != owners_before.get(node)):
                    new = recorder.run_node(node)
                    if rewritten or not same_value(old, new) or owners.of(node, new) != owners_before.get(node):
                        changed.add(node)
            value = node.meta.get("longstraw_value")
            owners.add(node, value)
            recorder.env[node] = value


def _same_arguments(a: Any, b: Any) -> bool:
    """Whether two (args, kwargs) are the same nodes and constants (nodes and
    tensors by identity), walked by hand: flattening both with pytree, for
    every node, was a tenth of a new length's plan on the hybrid."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same_arguments(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_arguments(a[k], b[k]) for k in a)
    if isinstance(a, (fx.Node, torch.Tensor)):
        return a is b
    return a is b or a == b


# 3. sizes and folded values -------------------------------------------------

def _fold_integers(gm: fx.GraphModule, args: Sequence[Any]) -> tuple[tuple[int, Any], ...]:
    """Every integer node becomes its constant, and so does every value read
    from an argument with `.item()` unless it only scales tensors
    elementwise. Returns a guard per argument whose value was folded."""
    position = {p: i for i, p in enumerate(gm.graph.find_nodes(op="placeholder"))}
    guards: dict[int, Any] = {}
    for item in list(gm.graph.nodes):
        if item.op == "call_method" and item.target == "item" and isinstance(item.meta["longstraw_value"], float):
            scalars = _scalar_descendants(item)
            if not all(_elementwise(u) for n in scalars for u in n.users if u not in scalars):
                guards[position[item.args[0]]] = scalar_of(args[position[item.args[0]]])
                for n in [n for n in gm.graph.nodes if n in scalars]:
                    _replace_with_constant(n, n.meta["longstraw_value"])
    for node in list(gm.graph.nodes):
        value = node.meta.get("longstraw_value")
        if node.op == "output" or not (_integer(value) or _integer_tuple(value)):
            continue
        for source in ancestors([node]):
            if source.op == "call_method" and source.target == "item" and source.args[0] in position:
                index = position[source.args[0]]
                guards[index] = scalar_of(args[index])
        _replace_with_constant(node, int(value) if _integer(value) else tuple(int(v) for v in value))
    return tuple(sorted(guards.items()))


def _integer(value: Any) -> bool:
    return isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool)


def _integer_tuple(value: Any) -> bool:
    """A shape (`x.size()` under dynamic shapes, `x.size()[:-1] + (n,)`): a
    tuple of integers, which a static trace would have held as a constant."""
    return isinstance(value, tuple) and bool(value) and all(_integer(v) for v in value)


def _scalar_descendants(node: fx.Node) -> set[fx.Node]:
    """`node` and the Python-number nodes computed from it (`beta * 2`)."""
    out, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n not in out:
            out.add(n)
            todo.extend(u for u in n.users if isinstance(u.meta.get("longstraw_value"), (int, float)))
    return out


def _elementwise(node: fx.Node) -> bool:
    """An arithmetic op on a tensor, where a scalar operand can change from call to call."""
    return isinstance(node.meta.get("longstraw_value"), torch.Tensor) and op_name(node) in ELEMENTWISE


def _replace_with_constant(node: fx.Node, constant: Any) -> None:
    for user in list(node.users):
        user.args = fx.node.map_arg(user.args, lambda a: constant if a is node else a)
        user.kwargs = fx.node.map_arg(user.kwargs, lambda a: constant if a is node else a)
    if node.op != "placeholder":
        node.graph.erase_node(node)


# 5. common subexpressions ----------------------------------------------------

def _merge_common(graph: fx.Graph) -> None:
    """Merge nodes that compute the same operator on the same inputs. A
    floating-point result is merged only within one grad-mode and autocast
    region (the same op under `no_grad` is another value for autograd);
    integer results (token ids) anywhere. Random and side-effecting nodes
    are never merged."""
    seen: dict[Any, fx.Node] = {}
    grad_enabled, autocast = True, 0
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is torch._C._set_grad_enabled:
            grad_enabled = bool(node.args[0])
            continue
        if node.op == "call_function" and "autocast" in op_name(node):
            autocast += 1
            continue
        if node.op not in ("call_function", "call_method") or is_random(node) or node.is_impure() or is_side_effect(node):
            continue
        value = node.meta.get("longstraw_value")
        exact = isinstance(value, torch.Tensor) and not (value.is_floating_point() or value.is_complex())
        region = None if exact else (grad_enabled, autocast)
        try:
            key = (region, node.op, node.target, _hashable(node.args), _hashable(node.kwargs))
            hash(key)
        except TypeError:
            continue
        if key in seen:
            node.replace_all_uses_with(seen[key])
            graph.erase_node(node)
        else:
            seen[key] = node


def _hashable(a: Any) -> Any:
    if isinstance(a, (tuple, list)):
        return (type(a).__name__, tuple(_hashable(x) for x in a))
    if isinstance(a, dict):
        return ("dict", tuple(sorted((k, _hashable(v)) for k, v in a.items())))
    if isinstance(a, slice):
        return ("slice", _hashable(a.start), _hashable(a.stop), _hashable(a.step))
    if isinstance(a, torch.Tensor):
        raise TypeError("tensor constant")
    return a
