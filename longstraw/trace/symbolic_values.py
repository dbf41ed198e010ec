"""Node values at a new length read off Dynamo's symbolic example values.

Planning records every node's value by FakeTensor propagation at the call's
sizes (`specialize.py`); that was most of what a new prompt or completion
length cost a loop (0.2 of 0.3 s per new length on an H100's host). A graph
Dynamo traced with dynamic shapes carries, on every node, its example value
with sizes, strides and offsets as expressions in the input sizes
(`node.meta["example_value"]`), and Dynamo's guards hold for every call
that reaches the graph. The values at a new length are those expressions
evaluated at the call's sizes: no operator runs.

`ValueTemplates.learn` reads the templates of a graph off the values its
first propagation recorded: the size expressions from Dynamo's example
values; dtypes, devices and `requires_grad` as recorded (they follow from
the graph and the input signature, which a plan is keyed on, not from the
lengths); which values share storage as recorded (functionalisation finds
in-place writes through views by it). `specialize` keeps them only if
planning from them at that first call gives back exactly what propagation
gave, node for node (`agree`). Anything a template cannot evaluate (a size
no input gives, inputs that alias otherwise) makes that call propagate.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable
from typing import Any, Sequence

import sympy
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef

from longstraw.trace.functionalize import StorageOwners

log = logging.getLogger("longstraw.trace.symbolic_values")

SymValue = (torch.SymInt, torch.SymBool, torch.SymFloat)


@dataclasses.dataclass(frozen=True)
class _TensorTemplate:
    size: tuple[Any, ...]  # ints and sympy expressions
    stride: tuple[Any, ...]
    offset: Any
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    storage: str  # the tensor that holds its storage ("node.index"): values with the same one share it


@dataclasses.dataclass(frozen=True)
class _Sequence:
    """A tuple, list or `torch.Size` of values, rebuilt as its own type."""

    kind: type
    items: tuple[Any, ...]


class Unknown(Exception):
    """A template that cannot be built or evaluated: propagate instead."""


class _Item:
    """The value of `x.item()` of an argument: read from the argument, as propagation does."""


ITEM = _Item()


def _expr(value: Any) -> Any:
    """A Python int, bool or float as is; a symbolic one as its sympy expression."""
    if isinstance(value, SymValue):
        return value.node.expr
    if isinstance(value, (int, float, bool)) or value is None:
        return value
    raise Unknown(f"a {type(value).__name__}")


def _template(example: Any, recorded: Any, requires_grad: Any, owner: Callable[[torch.Tensor], str]) -> Any:
    """The template of one value: Dynamo's `example` for what depends on sizes,
    the `recorded` value (propagated at the first call) for the rest, with
    `requires_grad` as it was when recorded (a later in-place write can
    change the tensor's) and `owner`: the node whose value holds its storage."""
    if isinstance(recorded, torch.Tensor):
        if not isinstance(example, torch.Tensor) or not isinstance(requires_grad, bool):
            raise Unknown("no example tensor")
        return _TensorTemplate(tuple(_expr(s) for s in example.shape), tuple(_expr(s) for s in example.stride()),
                               _expr(example.storage_offset()), recorded.dtype, recorded.device, requires_grad,
                               owner(recorded))
    if isinstance(recorded, (tuple, list)):
        if not isinstance(example, (tuple, list)) or len(example) != len(recorded):
            raise Unknown("a sequence of another length")
        flags = requires_grad if isinstance(requires_grad, tuple) else (None,) * len(recorded)
        return _Sequence(type(recorded), tuple(_template(e, r, g, owner) for e, r, g in zip(example, recorded, flags)))
    if isinstance(recorded, (bool, int, float)) or recorded is None:
        return _expr(example) if isinstance(example, SymValue) else recorded
    raise Unknown(f"a {type(recorded).__name__} value")


class _Evaluator:
    """Expressions evaluated at one call's bindings of the size symbols, each once."""

    def __init__(self, bindings: dict[sympy.Symbol, Any]) -> None:
        self.bindings = {symbol: sympy.sympify(value) for symbol, value in bindings.items()}
        self.done: dict[Any, Any] = {}

    def __call__(self, expr: Any) -> Any:
        if not isinstance(expr, sympy.Basic):
            return expr
        if expr not in self.done:
            if not expr.free_symbols <= self.bindings.keys():
                raise Unknown(f"{expr} reads a size no input gives")
            value = expr.xreplace(self.bindings)
            if value.is_Boolean:
                self.done[expr] = bool(value)
            elif value.is_Integer:
                self.done[expr] = int(value)
            elif value.is_Number:
                self.done[expr] = float(value)
            else:
                raise Unknown(f"{expr} does not evaluate to a number")
        return self.done[expr]


def _bind(symbols: dict[sympy.Symbol, Any], expr: Any, value: Any) -> None:
    """Record that the plain symbol `expr` is `value` at this call."""
    if isinstance(expr, sympy.Symbol) and symbols.setdefault(expr, value) != value:
        raise Unknown(f"{expr} is {symbols[expr]} and {value} at once")


@dataclasses.dataclass
class _Layout:
    """A tensor value's layout at this call, before its storage is made."""

    template: _TensorTemplate
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def end_bytes(self) -> int:
        extent = 1 + sum((n - 1) * s for n, s in zip(self.size, self.stride)) if all(self.size) else 0
        return (self.offset + extent) * self.template.dtype.itemsize


class ValueTemplates:
    """One Dynamo graph's node values as functions of its input sizes (see module docstring)."""

    def __init__(self, templates: dict[str, Any]) -> None:
        self.templates = templates  # node name -> template, in graph order

    @classmethod
    def learn(cls, gm: fx.GraphModule) -> ValueTemplates | None:
        """The templates of `gm`, whose nodes hold the values propagation
        recorded (`longstraw_value`) and Dynamo's example values; None where
        a node's value has no template."""
        templates: dict[str, Any] = {}
        owners = StorageOwners()

        def owner(tensor: torch.Tensor) -> str:
            node, index = owners.first[StorageWeakRef(tensor.untyped_storage())]
            return f"{node.name}.{index}"

        try:
            for node in gm.graph.nodes:
                if node.op == "output":
                    continue
                example, recorded = node.meta.get("example_value"), node.meta.get("longstraw_value")
                owners.add(node, recorded)
                if node.op == "call_method" and node.target == "item":
                    templates[node.name] = ITEM
                elif example is None and recorded is None:
                    templates[node.name] = None  # a side effect (`_set_grad_enabled`): no value
                else:
                    templates[node.name] = _template(example, recorded, node.meta.get("longstraw_requires_grad"),
                                                     owner)
        except Unknown as why:
            log.debug("no templates for this graph: %s", why)
            return None
        except (TypeError, ValueError, RuntimeError):
            log.debug("no templates for this graph", exc_info=True)
            return None
        return cls(templates)

    def _bindings(self, gm: fx.GraphModule, real: dict[fx.Node, Any]) -> dict[sympy.Symbol, Any]:
        symbols: dict[sympy.Symbol, Any] = {}
        storages: dict[StorageWeakRef, str] = {}
        for node, value in real.items():
            template = self.templates[node.name]
            if isinstance(template, _TensorTemplate) and isinstance(value, torch.Tensor):
                if (value.dtype, value.device, value.requires_grad) != (
                        template.dtype, template.device, template.requires_grad):
                    raise Unknown(f"argument {node.name} has another dtype, device or requires_grad")
                if storages.setdefault(StorageWeakRef(value.untyped_storage()), template.storage) != template.storage:
                    raise Unknown(f"argument {node.name} shares storage otherwise")
                for expr, size in zip((*template.size, *template.stride, template.offset),
                                      (*value.shape, *value.stride(), value.storage_offset())):
                    _bind(symbols, expr, size)
            elif isinstance(template, sympy.Basic):
                _bind(symbols, template, value)
            elif isinstance(template, _TensorTemplate) or isinstance(value, torch.Tensor):
                raise Unknown(f"argument {node.name} is not what it was")
        for node in gm.graph.nodes:
            example = node.meta.get("example_value")
            if self.templates.get(node.name) is ITEM and isinstance(example, SymValue):
                _bind(symbols, _expr(example), real[node.args[0]].item())
        return symbols

    def fill(self, gm: fx.GraphModule, args: Sequence[Any], fake_mode: FakeTensorMode) -> bool:
        """Set every node's `longstraw_value` at these arguments' sizes, as
        FakeTensors of `fake_mode`; False (nothing set) where a template
        cannot be evaluated."""
        nodes = [n for n in gm.graph.nodes if n.op != "output"]
        if [n.name for n in nodes] != list(self.templates):
            return False
        real = dict(zip(gm.graph.find_nodes(op="placeholder"), args))
        try:
            evaluate = _Evaluator(self._bindings(gm, real))
            layouts: dict[fx.Node, Any] = {}
            for node in nodes:
                template = self.templates[node.name]
                layouts[node] = real[node.args[0]].item() if template is ITEM else _layout(template, evaluate)
                value = real.get(node)
                if isinstance(value, torch.Tensor) and (layouts[node].size, layouts[node].stride, layouts[node].offset) != (
                        tuple(value.shape), value.stride(), value.storage_offset()):
                    raise Unknown(f"argument {node.name} has another layout")
            ends: dict[str, int] = {}
            for layout in _leaves(layouts.values()):
                ends[layout.template.storage] = max(ends.get(layout.template.storage, 0), layout.end_bytes())
            storages = {owner: torch.UntypedStorage(end, device="meta") for owner, end in ends.items()}
            values = {node: _value(layout, storages, fake_mode) for node, layout in layouts.items()}
        except Unknown as why:
            log.debug("propagating at these sizes: %s", why)
            return False
        except (TypeError, ValueError, RuntimeError):  # a value the templates rebuild wrongly: propagation is right
            log.debug("propagating at these sizes: the templates failed", exc_info=True)
            return False
        for node, value in values.items():
            node.meta["longstraw_value"] = value
        for node in gm.graph.find_nodes(op="output"):  # propagation records the outputs too
            node.meta["longstraw_value"] = fx.node.map_aggregate(
                node.args[0], lambda n: n.meta["longstraw_value"] if isinstance(n, fx.Node) else n)
        return True


def _layout(template: Any, evaluate: _Evaluator) -> Any:
    if isinstance(template, _TensorTemplate):
        return _Layout(template, tuple(evaluate(s) for s in template.size), tuple(evaluate(s) for s in template.stride),
                       evaluate(template.offset))
    if isinstance(template, _Sequence):
        return _Sequence(template.kind, tuple(_layout(t, evaluate) for t in template.items))
    return evaluate(template)


def _leaves(values: Any) -> list[_Layout]:
    out = []
    for value in values:
        if isinstance(value, _Layout):
            out.append(value)
        elif isinstance(value, _Sequence):
            out.extend(_leaves(value.items))
    return out


def _value(layout: Any, storages: dict[str, torch.UntypedStorage], fake_mode: FakeTensorMode) -> Any:
    if isinstance(layout, _Layout):
        t = layout.template
        meta = torch.empty((0,), dtype=t.dtype, device="meta").set_(storages[t.storage], layout.offset, layout.size,
                                                                    layout.stride)
        if t.requires_grad:
            meta.requires_grad_(True)
        return fake_mode.fake_tensor_converter.from_meta_and_device(fake_mode, meta, t.device)
    if isinstance(layout, _Sequence):
        return layout.kind(tuple(_value(v, storages, fake_mode) for v in layout.items))
    return layout


def same_value(a: Any, b: Any) -> bool:
    """Whether two recorded values have the same layout, dtype, device, `requires_grad`, or are equal."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.stride() == b.stride() and a.storage_offset() == b.storage_offset() and a.dtype == b.dtype
                and a.device == b.device and a.requires_grad == b.requires_grad)
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        return (type(a) is type(b) and len(a) == len(b)) and all(same_value(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _sharing(gm: fx.GraphModule) -> list[str]:
    """Which of the graph's tensor values share storage: each one's owner (`StorageOwners`), by name."""
    return [f"{node.name}.{index}" for owners in StorageOwners.of_graph(gm).values() for node, index in owners]


def agree(a: fx.GraphModule, b: fx.GraphModule) -> bool:
    """Whether two specialisations of one graph are the same graph with the same values and sharing."""
    if a.code != b.code:
        return False
    pairs = list(zip(a.graph.nodes, b.graph.nodes))
    return (len(pairs) == len(b.graph.nodes)
            and all(same_value(x.meta.get("longstraw_value"), y.meta.get("longstraw_value")) for x, y in pairs)
            and _sharing(a) == _sharing(b))


_LEARNED: weakref.WeakKeyDictionary[fx.GraphModule, ValueTemplates | None] = weakref.WeakKeyDictionary()


def templates_of(gm: fx.GraphModule) -> tuple[bool, ValueTemplates | None]:
    """(whether `gm`'s templates were learned, the templates or None)."""
    return (gm in _LEARNED, _LEARNED.get(gm))


def remember(gm: fx.GraphModule, templates: ValueTemplates | None) -> None:
    _LEARNED[gm] = templates
