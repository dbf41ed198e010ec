"""Remove in-place writes from a Dynamo graph before it is analysed.

Dynamo's torch-level graphs keep mutation: `x[..., :8].copy_(k)` into a
`new_empty` buffer (HF's DeepSeek-V3 attention), `x += y`, `logp[mask] = 0`,
`F.relu(x, inplace=True)`. Every later stage reasons about values flowing
along edges, so a write that changes a tensor other nodes read (through the
same node or through a view of the same storage) would be invisible to it.

`functionalize` rewrites each write into a pure node and redirects every
later read, as PyTorch's own functionalisation does at the aten level, but
on the torch-level graph the analyses work on:

- which nodes share storage is read from FakeTensor propagation of the
  graph as traced (`StorageWeakRef`, as AOTAutograd does), never guessed
  from operator names: `reshape` or `contiguous` alias only when they did;
- a write into tensor `t` becomes `updated(t, op, *args)` (a copy of `t`
  after the in-place op), and the write into the storage's base is rebuilt
  up the chain of views from `t` to the base (`setitem` into an index, the
  inverse reshape or transpose);
- every node after the write that reads the base or any view of it reads
  the view recomputed from the new base.

A write it cannot follow is refused with the operator and source line: an
in-place write into a graph input, a parameter or a buffer (the caller
would see it), into a view it cannot invert (`expand`, `as_strided`, an
operator that returns an alias it does not know), or an op that changes a
tensor's metadata (`resize_`, `set_`).
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from longstraw.errors import UnsupportedGraphError, argument_name, describe_node, module_path
from longstraw.nodes import arg, op_name


def updated(target: torch.Tensor, op: str, *args: Any, **kwargs: Any) -> torch.Tensor:
    """A copy of `target` after the in-place `op` (a Tensor method such as
    `copy_` or `add_`, or `"setitem"` with `(index, value)`) wrote into it.
    The copy keeps `target`'s dtype, shape and layout, as the write would."""
    out = target.clone()
    if op == "setitem":
        out[args[0]] = args[1]
    else:
        getattr(out, op)(*args, **kwargs)
    return out


def is_updated(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is updated


_IN_PLACE_OPERATORS = {
    operator.iadd: "add_", operator.isub: "sub_", operator.imul: "mul_", operator.itruediv: "div_",
    operator.ifloordiv: "floor_divide_", operator.imod: "remainder_", operator.ipow: "pow_",
    operator.iand: "bitwise_and_", operator.ior: "bitwise_or_", operator.ixor: "bitwise_xor_",
    operator.ilshift: "bitwise_left_shift_", operator.irshift: "bitwise_right_shift_",
}
_METADATA_WRITES = {
    "set_", "resize_", "resize_as_", "as_strided_", "detach_", "squeeze_", "unsqueeze_", "transpose_", "t_",
    "swapdims_", "swapaxes_", "share_memory_", "untyped_storage",
}
_NOT_WRITES = {"requires_grad_"}

# Views whose inverse the rewrite knows: writing into the view writes into its source.
_INDEX_VIEWS = {"getitem", "narrow", "select"}
_RESHAPE_VIEWS = {"view", "reshape", "flatten", "unflatten", "view_as", "reshape_as", "squeeze", "unsqueeze"}
_TRANSPOSE_VIEWS = {"transpose", "swapaxes", "swapdims", "t", "permute"}
_IDENTITY_VIEWS = {
    "detach", "alias", "contiguous", "to", "type", "type_as", "float", "double", "half", "bfloat16", "long", "int",
    "bool", "cpu", "cuda",
}
_SPLIT_VIEWS = {"split", "chunk", "unbind", "split_with_sizes", "tensor_split"}
# Views that can be recomputed from a new source but not written through.
_READ_ONLY_VIEWS = {"expand", "expand_as", "broadcast_to", "diagonal", "unfold", "as_strided", "movedim", "moveaxis",
                    "real", "imag", "view_as_real", "view_as_complex", "narrow_copy"}
_VIEWS = _INDEX_VIEWS | _RESHAPE_VIEWS | _TRANSPOSE_VIEWS | _IDENTITY_VIEWS | _SPLIT_VIEWS | _READ_ONLY_VIEWS


class _Write:
    """One in-place write: the tensor written, and how to build its new value."""

    def __init__(self, node: fx.Node, target: fx.Node, build: Callable[[fx.Graph, Callable], fx.Node]) -> None:
        self.node, self.target, self.build = node, target, build


def _write_of(node: fx.Node, values: dict[fx.Node, Any]) -> _Write | None:
    """The write `node` performs, or None for a pure node."""
    if node.op not in ("call_function", "call_method"):
        return None
    first = node.args[0] if node.args else None
    if not isinstance(first, fx.Node) or not isinstance(values.get(first), torch.Tensor):
        return None
    name = op_name(node)

    def method(op: str, args: tuple, kwargs: dict) -> Callable:
        return lambda graph, fresh: graph.call_function(updated, (fresh(first), op, *fresh(args)), fresh(kwargs))

    if node.op == "call_function" and node.target is operator.setitem:
        return _Write(node, first, method("setitem", node.args[1:], {}))
    if node.op == "call_function" and node.target in _IN_PLACE_OPERATORS:
        return _Write(node, first, method(_IN_PLACE_OPERATORS[node.target], node.args[1:], dict(node.kwargs)))
    out = node.kwargs.get("out")
    if isinstance(out, fx.Node):
        kwargs = {k: v for k, v in node.kwargs.items() if k != "out"}

        def into_out(graph: fx.Graph, fresh: Callable) -> fx.Node:
            value = graph.create_node(node.op, node.target, fresh(node.args), fresh(kwargs))
            return graph.call_function(updated, (fresh(out), "copy_", value))

        return _Write(node, out, into_out)
    if node.kwargs.get("inplace") is True:
        kwargs = {**node.kwargs, "inplace": False}
        return _Write(node, first, lambda graph, fresh: graph.create_node(node.op, node.target, fresh(node.args), fresh(kwargs)))
    python_operator = node.op == "call_function" and getattr(operator, name, None) is node.target
    if name.endswith("_") and not name.startswith("_") and name not in _NOT_WRITES and not python_operator:
        if name in _METADATA_WRITES or not hasattr(torch.Tensor, name):
            raise UnsupportedGraphError(
                f"{describe_node(node)} changes a tensor's storage or shape in place; LongStraw cannot follow it. "
                "Use the out-of-place form."
            )
        return _Write(node, first, method(name, node.args[1:], dict(node.kwargs)))
    return None


def storages_of(value: Any) -> list[StorageWeakRef]:
    """The storage of each tensor in a value (a tensor, or a tuple or list of values)."""
    if isinstance(value, torch.Tensor):
        return [StorageWeakRef(value.untyped_storage())]
    if isinstance(value, (tuple, list)):
        return [s for v in value for s in storages_of(v)]
    return []


Owner = tuple[fx.Node, int]
"""A node and the index of a tensor among its value's tensors."""


class StorageOwners:
    """For each storage met, the first tensor in graph order whose storage it
    is (`Owner`): which values are views of which."""

    def __init__(self) -> None:
        self.first: dict[StorageWeakRef, Owner] = {}

    def of(self, node: fx.Node, value: Any) -> tuple[Owner, ...]:
        """The owner of each tensor in `node`'s `value` (itself for a storage not met yet)."""
        return tuple(self.first.get(s, (node, i)) for i, s in enumerate(storages_of(value)))

    def add(self, node: fx.Node, value: Any) -> None:
        for i, s in enumerate(storages_of(value)):
            self.first.setdefault(s, (node, i))

    @classmethod
    def of_graph(cls, gm: fx.GraphModule) -> dict[fx.Node, tuple[Owner, ...]]:
        """`of` every node's recorded value (`longstraw_value`), in graph order."""
        owners, out = cls(), {}
        for node in gm.graph.nodes:
            value = node.meta.get("longstraw_value")
            out[node] = owners.of(node, value)
            owners.add(node, value)
        return out


class _Functionalizer:
    """One walk over the graph in program order (see module docstring).

    Every tensor node has a *base* (the node that allocated its storage) and,
    if it is a view, a *parent* it was viewed from. `current` maps a written
    base to its latest value; nodes computed from an older value are
    recomputed from the latest one, memoised per (node, value). Those new
    nodes get the traced value of the node they stand for (a write keeps
    shape and dtype): a later write through them reads its rank and dtype."""

    def __init__(self, graph: fx.Graph, values: dict[fx.Node, Any]) -> None:
        self.graph = graph
        self.values = values
        self.parent: dict[fx.Node, fx.Node | None] = {}
        self.base: dict[fx.Node, fx.Node] = {}
        self.version: dict[fx.Node, fx.Node] = {}  # the value of its base a node was computed from
        self.opaque: set[fx.Node] = set()  # aliases through an operator not known as a view
        self.owner: dict[StorageWeakRef, fx.Node] = {}
        self.current: dict[fx.Node, fx.Node] = {}
        self.memo: dict[tuple[fx.Node, fx.Node], fx.Node] = {}

    def run(self) -> None:
        for node in list(self.graph.nodes):
            write = _write_of(node, self.values)
            with self.graph.inserting_before(node):
                if write is not None:
                    self.rewrite_write(write)
                    continue
                node.args = self.fresh(node.args)
                node.kwargs = self.fresh(node.kwargs)
            self.track(node)

    # aliasing, from the storages FakeTensor propagation gave each value --------

    def track(self, node: fx.Node) -> None:
        value = self.values.get(node)
        src = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        name = op_name(node)
        if isinstance(value, (tuple, list)) and name not in _SPLIT_VIEWS:
            return  # a tuple of results: each `getitem` of it is a tensor of its own
        storages = storages_of(value)
        if not storages:
            return
        known = [self.owner[s] for s in storages if s in self.owner]
        if not known:
            for s in storages:
                self.owner[s] = node
            self.register(node, node, None)
            return
        base = self.base.get(known[0], known[0])
        is_view = name in _VIEWS and not (name == "getitem" and isinstance(self.values.get(src), (tuple, list))
                                          and op_name(src) not in _SPLIT_VIEWS)
        if is_view and src is not None and self.base.get(src) is base:
            self.register(node, base, src)
        else:
            self.register(node, base, None)
            self.opaque.add(node)

    def register(self, node: fx.Node, base: fx.Node, parent: fx.Node | None) -> None:
        self.base[node], self.parent[node] = base, parent
        self.version[node] = self.current.get(base, base)

    def path(self, node: fx.Node) -> list[fx.Node]:
        """Views from the value they start at (excluded) down to `node` (included)."""
        chain = []
        while self.parent.get(node) is not None:
            chain.append(node)
            node = self.parent[node]
        return chain[::-1]

    # reads -----------------------------------------------------------------

    def fresh(self, a: Any) -> Any:
        """Arguments with every read of a written storage redirected to its latest value."""
        return fx.node.map_arg(a, self.latest)

    def latest(self, node: fx.Node) -> fx.Node:
        base = self.base.get(node)
        if base is None or base not in self.current or self.version.get(node) is self.current[base]:
            return node
        if node in self.opaque:
            raise UnsupportedGraphError(
                f"{describe_node(node)} returns an alias of a tensor that is written in place later; LongStraw "
                "cannot follow the write through this operator. Use out-of-place operations."
            )
        version = self.current[base]
        key = (node, version)
        if key not in self.memo:
            value = version
            for view in self.path(node):
                source = value
                value = self.graph.node_copy(view, lambda a, v=view, s=source: s if a is self.parent[v] else self.fresh(a))
                self.values[value] = self.values[view]
                self.register(value, base, source)
            self.memo[key] = value
        return self.memo[key]

    # writes ----------------------------------------------------------------

    def rewrite_write(self, write: _Write) -> None:
        node, target = write.node, write.target
        base = self.base.get(target, target)
        if base.op in ("placeholder", "get_attr"):
            what = "an argument of the loss" if base.op == "placeholder" else "a constant of the graph"
            raise UnsupportedGraphError(
                f"{describe_node(node)} writes in place into `{argument_name(base)}`, {what} (a parameter, buffer or input): "
                f"the caller would see the write, which LongStraw's replays cannot reproduce. {_write_advice(node)}"
            )
        if any(v in self.opaque for v in [target, *self.path(target)]):
            raise UnsupportedGraphError(
                f"{describe_node(node)} writes into a tensor that aliases another one through an operator LongStraw "
                "does not know as a view; it cannot follow the write. Write into a fresh tensor instead."
            )
        first_new = node.prev
        child, value = target, write.build(self.graph, self.fresh)
        while self.parent.get(child) is not None:
            value = self.write_through(child, value, node)
            child = self.parent[child]
            if op_name(child) in _SPLIT_VIEWS:
                child = self.parent[child]
        self.current[base] = value
        self.values[value] = self.values[base]
        self.register(value, base, None)
        new = first_new.next
        while new is not node:
            new.meta.update({k: node.meta[k] for k in ("stack_trace", "nn_module_stack") if k in node.meta})
            new = new.next
        node.replace_all_uses_with(target)
        self.graph.erase_node(node)

    def write_through(self, view: fx.Node, value: fx.Node, write: fx.Node) -> fx.Node:
        """The new value of `view`'s source after `view` became `value`."""
        src = self.parent[view]
        name = op_name(view)
        graph = self.graph
        if op_name(src) in _SPLIT_VIEWS:
            return self.write_into_piece(view, value)
        source = self.latest(src)
        if name in _INDEX_VIEWS:
            return graph.call_function(updated, (source, "setitem", self.index_of(view), value))
        if name == "view" and isinstance(arg(view, 1, "dtype"), torch.dtype):
            return graph.call_method("view", (value, self.values[src].dtype))  # bits reinterpreted back
        if name in _RESHAPE_VIEWS:
            return graph.call_method("reshape_as", (value, source))
        if name in _IDENTITY_VIEWS:
            return value
        if name in ("transpose", "swapaxes", "swapdims"):
            return graph.call_method("transpose", (value, *view.args[1:3]))
        if name == "t":
            return graph.call_method("t", (value,))
        if name == "permute":
            order = list(view.args[1]) if len(view.args) == 2 and isinstance(view.args[1], (tuple, list)) else list(view.args[1:])
            inverse = [0] * len(order)
            for i, d in enumerate(order):
                inverse[d % len(order)] = i
            return graph.call_method("permute", (value, *inverse))
        raise UnsupportedGraphError(
            f"{describe_node(write)} writes through `{name}` (node `{view.name}`), a view LongStraw cannot invert; "
            "write into a fresh tensor instead."
        )

    def write_into_piece(self, piece: fx.Node, value: fx.Node) -> fx.Node:
        """`split`/`chunk`/`unbind` piece i is a slice (or index) of its source along one dim."""
        split = piece.args[0]
        src = self.parent[split]
        name = op_name(split)
        pieces = self.values[split]
        dim = arg(split, 1 if name == "unbind" else 2, "dim", 0) % self.values[src].dim()
        index = piece.args[1]
        lead = (slice(None),) * dim
        if name == "unbind":
            item: Any = lead + (index,)
        else:
            start = sum(p.shape[dim] for p in pieces[:index])
            item = lead + (slice(start, start + pieces[index].shape[dim]),)
        return self.graph.call_function(updated, (self.latest(src), "setitem", item, value))

    def index_of(self, view: fx.Node) -> Any:
        name = op_name(view)
        if name == "getitem":
            return self.fresh(view.args[1])
        dim = arg(view, 1, "dim") % self.values[view.args[0]].dim()
        if name == "narrow":
            start, length = arg(view, 2, "start"), arg(view, 3, "length")
            stop = start + length
            return (slice(None),) * dim + (slice(start, None if start < 0 and stop == 0 else stop),)
        return (slice(None),) * dim + (arg(view, 2, "index"),)


def functionalize(gm: fx.GraphModule, values: dict[fx.Node, Any]) -> bool:
    """Rewrite every in-place write of `gm` (see module docstring); `values`
    are the nodes' FakeTensor values as traced. Returns whether anything changed."""
    if not any(_write_of(n, values) is not None for n in gm.graph.nodes):
        return False
    _Functionalizer(gm.graph, values).run()
    gm.graph.lint()
    gm.recompile()
    return True


def _write_advice(node: fx.Node) -> str:
    """What to do about a write into an argument: the loss's own code can
    write into a copy; a write inside the model is the model's code, which a
    module in eval mode often skips (HF's Gemma 3n clamps its AltUp
    coefficients in place in train mode only)."""
    where = module_path(node)
    if where is None:
        return "Write into a copy (`x = x.clone()`) or use the out-of-place operation."
    return (f"It is the model's own code, in `{where}`: if it writes only in train mode, put that module in eval mode "
            f"for the compiled call (`{where}.eval()`) and do the write outside it, if it matters; else write into a "
            "copy there (`x = x.clone()`) or use the out-of-place operation.")
