"""Code generation of the steps the runtime executes (the outer graph and
the tail around them are `graphs.py`'s).

A step (prefix and branch kinds) is the sequence part of the original
graph for one row and positions `[o, o+n)`, with claimed operators
replaced by their incremental versions and captured tensors written to
state; the branch kind continues through the branch nodes to the branch
outputs.

With static shapes Dynamo bakes the group size and sequence length into
arguments (`view(3, 17, -1, 8)`, `arange(17)`). The step rewrites exactly
the arguments whose output dimension carries the token or group class
(from `dims.py`), never by matching values.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn.functional as F

from longstraw.analysis.dims import DimAnalysis
from longstraw.analysis.partition import Partition
from longstraw.analysis.slots import SlotKind, StateSlot
from longstraw.codegen.graphs import GradModeReplay, StepGraph, generated_module, needed_for, step_imports
from longstraw.codegen.head import HeadChunks, HeadRegion, head_region
from longstraw.errors import UnsupportedGraphError, describe_node
from longstraw.nodes import ancestors, arg, op_name, size_args, tensor_of
from longstraw.runtime.kernels import weight_grads
from longstraw.runtime.mask_block import MaskTiles
from longstraw.runtime.prompt_state import write_state

_WEIGHT_GRADS_INTO = {F.linear: weight_grads.linear, F.embedding: weight_grads.embedding}
"""Operators whose weight gradient the step adds into `.grad` in place (`weight_grads.py`)."""
_SIZED_METHODS = {"view", "reshape", "expand", "broadcast_to", "new_zeros", "new_ones", "new_empty", "new_full"}
_SIZED_FACTORIES = {"zeros", "ones", "empty", "full", "rand", "randn"}


@dataclasses.dataclass
class _Sizing:
    """How a step resizes dimensions: each sequence class becomes a range
    `(offset, length)` of positions, the group class the step's `rows` (one
    branch row, or several: `Options.branch_rows`)."""

    dims: DimAnalysis
    ranges: dict[int, tuple[Any, Any]]
    batch: int | None
    group_dims: dict[fx.Node, set[int]] = dataclasses.field(default_factory=dict)
    """Dimensions known to be the group axis by other means (mask trees)."""
    rows: int = 1

    def range_of(self, node: fx.Node, dim: int) -> tuple[Any, Any] | None:
        factors = self.dims.dims_of(node)[dim]
        if len(factors) == 1:
            return self.ranges.get(self.dims.find(factors[0]))
        return None

    def is_group(self, node: fx.Node, dim: int) -> bool:
        return dim in self.group_dims.get(node, ())

    def labelled(self, node: fx.Node, dim: int) -> bool:
        return self.is_group(node, dim) or any(
            self.dims.find(f) in self.ranges or self.dims.find(f) == self.batch for f in self.dims.dims_of(node)[dim]
        )


class _StepBuilder:
    """Copies the needed part of the graph into a step graph (see module docstring)."""

    def __init__(self, part: Partition, kind: str, rows: int = 1) -> None:
        self.part = part
        self.kind = kind
        self.rows = rows
        self.graph = fx.Graph()
        self.root = torch.nn.Module()  # holds the mask tile graphs the step calls
        self.env: dict[fx.Node, Any] = {}
        self.blocks: dict[fx.Node, fx.Node] = {}
        self.carries: dict[int, fx.Node] = {}

    def carry_output(self, slot: int, node: fx.Node) -> None:
        self.carries[slot] = node

    # sizes ---------------------------------------------------------------

    def new_size(self, node: fx.Node, dim: int) -> Any:
        """The size of `node`'s dimension `dim` in the step: sequence factors
        become their range's length, group factors the step's rows, others
        keep their size."""
        an = self.sizing.dims
        if self.sizing.is_group(node, dim):
            return self.sizing.rows
        const, lengths = 1, []
        for f in an.dims_of(node)[dim]:
            cls = an.find(f)
            if cls in self.sizing.ranges:
                lengths.append(self.sizing.ranges[cls][1])
            elif cls == self.sizing.batch:
                const *= self.sizing.rows
            else:
                const *= an.factor_size(f)
        size: Any = const
        for length in lengths:
            size = length if size == 1 else self.graph.call_function(operator.mul, (size, length))
        return size

    def resized(self, node: fx.Node, sizes: list[Any], first_dim: int = 0) -> list[Any]:
        """Rewrite a size list whose entry i is output dimension first_dim + i."""
        out = []
        for i, size in enumerate(sizes):
            d = first_dim + i
            out.append(size if size == -1 or not self.sizing.labelled(node, d) else self.new_size(node, d))
        return out

    # emission ------------------------------------------------------------

    def mapped(self, a: Any) -> Any:
        """Original nodes to their step counterparts; nodes already in the step graph stay."""
        return fx.node.map_arg(a, lambda n: n if n.graph is self.graph else self.env[n])

    def copy(self, node: fx.Node, args: tuple | None = None, kwargs: dict | None = None) -> fx.Node:
        args = self.mapped(node.args if args is None else args)
        kwargs = self.mapped(node.kwargs if kwargs is None else kwargs)
        new = self.graph.create_node(node.op, node.target, args, kwargs, name=node.name)
        new.meta = dict(node.meta)
        return new

    def emit(self, node: fx.Node) -> Any:
        part, name = self.part, op_name(node)
        if node in part.claims:
            return part.claims[node].emit_step(self, node, part.sites[node])
        if tensor_of(node) is None:
            return self.copy(node)
        if name == "arange":
            return self.emit_arange(node)
        if name in ("tril", "triu"):
            return self.emit_triangular(node)
        if name in ("getitem", "narrow", "select") and node in self.sizing.dims.restricts:
            return self.emit_restriction(node)
        if node.op == "call_method" and name in _SIZED_METHODS:
            if name == "new_full":
                sizes = self.resized(node, list(node.args[1]))
                return self.copy(node, (node.args[0], tuple(sizes), *node.args[2:]), node.kwargs)
            kwargs = {k: v for k, v in node.kwargs.items() if k not in ("size", "shape")}
            return self.copy(node, (node.args[0], tuple(self.resized(node, size_args(node)))), kwargs)
        if node.op == "call_function" and name in ("reshape", "broadcast_to"):
            return self.copy(node, (node.args[0], tuple(self.resized(node, list(node.args[1])))), node.kwargs)
        if node.op == "call_function" and name in _SIZED_FACTORIES:
            return self.emit_factory(node)
        if name == "repeat":
            mults = size_args(node)
            offset = tensor_of(node).dim() - len(mults)
            if any(m != 1 and self.sizing.labelled(node, i + offset) for i, m in enumerate(mults)):
                raise UnsupportedGraphError(f"{describe_node(node)} repeats along the sequence or group axis")
        if name == "unflatten":
            d = arg(node, 1, "dim") % tensor_of(node.args[0]).dim()
            sizes = self.resized(node, list(arg(node, 2, "sizes")), first_dim=d)
            return self.copy(node, (node.args[0], d, tuple(sizes)), {})
        return self.copy(node)

    def emit_arange(self, node: fx.Node) -> fx.Node:
        if not self.sizing.labelled(node, 0):
            return self.copy(node)
        span = self.sizing.range_of(node, 0)
        if span is None:
            raise UnsupportedGraphError(f"{describe_node(node)} enumerates the group axis, which branch replay splits")
        numeric = [a for a in node.args if isinstance(a, (int, float))]
        start = numeric[0] if len(numeric) >= 2 else node.kwargs.get("start", 0)
        step = numeric[2] if len(numeric) >= 3 else node.kwargs.get("step", 1)
        if step != 1:
            raise UnsupportedGraphError(f"{describe_node(node)}: positions with a step other than 1")
        offset, length = span
        begin = self.graph.call_function(operator.add, (start, offset))
        end = self.graph.call_function(operator.add, (begin, length))
        kwargs = {k: v for k, v in node.kwargs.items() if k not in ("start", "end", "step")}
        return self.copy(node, (begin, end), kwargs)

    def emit_triangular(self, node: fx.Node) -> fx.Node:
        """`tril(x, d)` keeps column - row <= d; on a block whose rows start at
        r0 and columns at c0 that is column' - row' <= d + r0 - c0."""
        src = node.args[0]
        rank = tensor_of(src).dim()
        rows, cols = self.sizing.range_of(src, rank - 2), self.sizing.range_of(src, rank - 1)
        if rows is None and cols is None:
            return self.copy(node)
        diagonal = arg(node, 1, "diagonal", 0)
        shift = self.graph.call_function(operator.sub, (rows[0] if rows else 0, cols[0] if cols else 0))
        return self.copy(node, (src, self.graph.call_function(operator.add, (diagonal, shift))), {})

    def emit_factory(self, node: fx.Node) -> fx.Node:
        name = op_name(node)
        if name == "full":
            sizes = list(node.args[0])
            return self.copy(node, (tuple(self.resized(node, sizes)), *node.args[1:]), node.kwargs)
        sizes = list(node.args[0]) if len(node.args) == 1 and isinstance(node.args[0], (tuple, list)) else list(node.args)
        return self.copy(node, (tuple(self.resized(node, sizes)),), node.kwargs)

    def emit_restriction(self, node: fx.Node) -> fx.Node:
        """Slices on the token axis: identity ranges stay identity; exits
        (in the branch step) are shifted to the step's local positions."""
        an = self.sizing.dims
        src = node.args[0]
        src_dims = an.dims_of(src)
        rewrites: dict[int, Any] = {}
        for r in an.restricts[node]:
            cls = an.classes(src_dims[r.in_dim])
            if self.sizing.batch in cls:
                raise UnsupportedGraphError(f"{describe_node(node)} indexes the group axis inside a branch")
            span = self.sizing.range_of(src, r.in_dim)
            if span is None:
                continue
            if self.kind != "branch":
                raise UnsupportedGraphError(f"{describe_node(node)} restricts the sequence axis inside the prompt computation")
            read = None if r.out_dim is None else self.sizing.range_of(node, r.out_dim)
            if read is None:
                start = self.graph.call_function(operator.sub, (r.start, span[0]))
                stop = self.graph.call_function(operator.sub, (r.stop, span[0]))
            else:  # a chunk of an exit (`head.py`): read positions [a, a+n) are sequence positions [s+a, s+a+n)
                first = self.graph.call_function(operator.add, (r.start, read[0]))
                start = self.graph.call_function(operator.sub, (first, span[0]))
                stop = self.graph.call_function(operator.add, (start, read[1]))
            rewrites[r.in_dim] = (start, stop, r.out_dim is None)
        name = op_name(node)
        if name == "getitem":
            return self.copy(node, (src, self.rewrite_index(node, src, rewrites)), {})
        if not rewrites:
            return self.copy(node)
        ((d, (start, stop, _)),) = rewrites.items()
        if name == "narrow":
            return self.copy(node, (src, d, start, self.graph.call_function(operator.sub, (stop, start))), {})
        return self.copy(node, (src, d, start), {})

    def rewrite_index(self, node: fx.Node, src: fx.Node, rewrites: dict[int, Any]) -> Any:
        index = node.args[1]
        items = list(index) if isinstance(index, tuple) else [index]
        rank = tensor_of(src).dim()
        consumed = sum(1 for i in items if i is not None and i is not Ellipsis)
        d, out = 0, []
        for item in items:
            if item is Ellipsis:
                span = rank - consumed
                out.extend(self.index_item(d + k, rewrites, slice(None), src) for k in range(span))
                d += span
            elif item is None:
                out.append(None)
            else:
                out.append(self.index_item(d, rewrites, item, src))
                d += 1
        return tuple(out) if isinstance(index, tuple) else out[0]

    def index_item(self, d: int, rewrites: dict[int, Any], item: Any, src: fx.Node) -> Any:
        if d in rewrites:
            start, stop, is_int = rewrites[d]
            return start if is_int else slice(start, stop, None)
        if isinstance(item, slice) and self.sizing.labelled(src, d):
            return slice(None)  # the full range of a resized axis
        return item

    # attention masks and other query x key blocks --------------------------

    def query_key_block(self, node: fx.Node) -> fx.Node:
        """Emit a `MaskBlock` of `node` (an attention mask `[..., L, L]`
        computed from positions only) for the step's rows `[o, o+n)` and the
        visible columns `[0, o+n)`.

        The subgraph is copied as a tree, so a position tensor used for both
        rows and columns gets one copy per role, and dimension propagation on
        the tree tells rows from columns. Nodes over rows or columns alone
        (position vectors, even a cumsum over them) are computed in the step
        in full, as traced, which costs O(L). Nodes over both go to a tile
        graph (`MaskTiles`) that computes any rows x columns tile from those
        vectors narrowed to it, so no step materialises its n x (o+n) block.
        A key padding mask (`Partition.key_padding`) is one of those vectors:
        the outer graph computes it, the runtime gives the step its row."""
        if node in self.blocks:
            return self.blocks[node]
        part = self.part
        tree, root, leaves, origin = _tree_copy(node, part.sequence | part.positional)
        an = DimAnalysis(tree)
        rank = tensor_of(root).dim()
        row_cls = an.find(an.dims_of(root)[rank - 2][0])
        col_cls = an.find(an.dims_of(root)[rank - 1][0])
        if row_cls == col_cls:
            raise UnsupportedGraphError(f"{describe_node(node)}: cannot tell the rows of this mask from its columns")
        tiled: set[fx.Node] = set()
        for t in tree.nodes:
            classes = {c for d in an.dims_of(t) for c in an.classes(d)} if t not in leaves else set()
            if {row_cls, col_cls} <= classes or any(i in tiled for i in t.all_input_nodes):
                tiled.add(t)
        # in graph order: a tile graph's inputs, and so a step's code, are the same at every plan
        vectors = list(dict.fromkeys(i for t in tree.nodes if t in tiled for i in t.all_input_nodes if i not in tiled))

        saved = self.graph, self.sizing, self.env
        full_env = {leaf: saved[2][original] for leaf, original in leaves.items()}
        self.sizing, self.env = _Sizing(an, {}, None), full_env
        try:
            for t in tree.nodes:
                if t not in leaves and t not in tiled:
                    full_env[t] = self.emit(t)
            tile = fx.Graph()
            row_start, rows, col_start, cols = (tile.placeholder(p) for p in ("row_start", "rows", "col_start", "cols"))
            inputs = [v for v in vectors if isinstance(full_env[v], fx.Node)]
            tile_env = {v: full_env[v] for v in vectors}
            tile_env.update({v: tile.placeholder(f"vector_{v.name}") for v in inputs})
            spans = {row_cls: (row_start, rows), col_cls: (col_start, cols)}
            group_dims = {
                t: {d for d in range(len(an.dims_of(t))) if part.dims.dim_index(o, part.batch) == d}
                for t, o in origin.items()
            }
            self.graph, self.sizing, self.env = tile, _Sizing(an, spans, None, group_dims), tile_env
            for v in vectors:
                tile_env[v] = self.narrowed(tile_env[v], v, an, spans, group_dims.get(v, set()))
            for t in tree.nodes:
                if t in tiled:
                    tile_env[t] = self.emit(t)
            tile.output(tile_env[root])
        finally:
            self.graph, self.sizing, self.env = saved
        name = f"mask_tiles_{len(self.blocks)}"
        padding = [i for i, v in enumerate(inputs) if any(leaves.get(a) in part.key_padding for a in ancestors([v]))]
        if len(padding) > 1 or any(an.find(an.dims_of(inputs[i])[-1][0]) != col_cls for i in padding):
            raise UnsupportedGraphError(
                f"{describe_node(node)}: its key padding mask reaches the mask as more than one vector, or not "
                "with the keys as its last dimension; LongStraw supports HF's `causal & attention_mask[batch, key]`"
            )
        rows = tuple(self.group_dim(origin.get(v, leaves.get(v))) for v in inputs)
        tiles = MaskTiles(generated_module(tile, "LongStrawMaskTile"), padding[0] if padding else None, rows)
        self.root.add_module(name, tiles)
        block = self.graph.call_module(name, (self.offset, self.length, *(full_env[v] for v in inputs)))
        self.blocks[node] = block
        return block

    def group_dim(self, node: fx.Node | None) -> int | None:
        """The group dimension of a mask's vector in the step (the tile
        graph reads one row of it), or None where it has none."""
        d = None if node is None else self.part.batch_dim(node)
        return None if d is None or tensor_of(node).shape[d] == 1 else d

    def narrowed(self, value: fx.Node, node: fx.Node, an: DimAnalysis, spans: dict, group: set[int]) -> fx.Node:
        """A full position vector cut to the tile's rows, columns and one group row."""
        if tensor_of(node) is None:
            return value
        for d, dim in enumerate(an.dims_of(node)):
            span = spans.get(an.find(dim[0])) if len(dim) == 1 else None
            if d in group and tensor_of(node).shape[d] != 1:
                span = (0, 1)
            if span is not None:
                value = self.graph.call_function(torch.narrow, (value, d, span[0], span[1]))
        return value

    def build(
        self, outputs: list[fx.Node], importer: Callable[[fx.Node], bool], head_chunk: int | None = None,
        read: int | None = None, slots: list[StateSlot] | None = None,
    ) -> StepGraph:
        """`outputs`: original nodes to return; for the prefix kind, the
        captured state of each of `slots` (default: every slot) in slot
        order instead. `head_chunk`:
        run the branch step's head region that many positions at a time.
        `read`: the class of read positions, sized by the context's
        `head_start` and `head_length` (the graph of one head chunk)."""
        part = self.part
        slot_of = {s.node: s.index for s in part.slots if s.kind == SlotKind.SEQUENCE}
        stop = {n for n in part.graph.nodes if importer(n)}
        needed = needed_for(outputs, stop, part.positional)
        region = head_region(part, outputs, needed, stop) if self.kind == "branch" and head_chunk else None
        self.ctx = self.graph.placeholder("ctx")
        externals = [n for n in part.graph.nodes if n in needed and (n in stop or n.op == "placeholder")]
        for n in externals:
            self.env[n] = self.graph.placeholder(n.name)
        self.offset = self.graph.call_function(getattr, (self.ctx, "offset"))
        self.length = self.graph.call_function(getattr, (self.ctx, "length"))
        grad_mode = GradModeReplay(self.graph)
        ranges = {part.token: (self.offset, self.length)}
        if read is not None:
            ranges[read] = tuple(self.graph.call_function(getattr, (self.ctx, a)) for a in ("head_start", "head_length"))
        self.sizing = _Sizing(part.dims, ranges, part.batch, rows=self.rows)
        for node in part.graph.nodes:
            if grad_mode.track(node) or node in self.env or node not in needed or (region is not None and node in region.nodes):
                continue
            grad_mode.sync()
            value = self.emit(node)
            if node in slot_of:
                value = self.graph.call_function(write_state, (self.ctx, slot_of[node], value))
            self.env[node] = value
        grad_mode.restore()
        if region is not None:
            self.emit_head(region, head_chunk)
        if self.kind == "prefix":
            results = [self.env[s.node] if s.kind == SlotKind.SEQUENCE else self.carries[s.index]
                       for s in (part.slots if slots is None else slots)]
        else:
            results = [self.env[o] for o in outputs]
        self.graph.output(tuple(results))
        module = generated_module(self.graph, f"LongStraw{self.kind.title()}Step", self.root)
        module.graph.eliminate_dead_code()  # e.g. K/V head repetition the attention step absorbed
        for node in module.graph.nodes:
            if node.op == "call_function" and node.target in _WEIGHT_GRADS_INTO:
                node.target = _WEIGHT_GRADS_INTO[node.target]
        module.recompile()
        return StepGraph(module, externals, region)

    def emit_head(self, region: HeadRegion, chunk: int) -> None:
        """Replace the head region by one call of `HeadChunks` over the
        graph of one chunk, built by a builder of its own with the read
        positions sized by the chunk."""
        part = self.part
        head = _StepBuilder(part, "branch", self.rows).build(region.outputs, lambda n: n not in region.nodes, read=region.read)
        input_dims: list[tuple[str, int] | None] = []
        for node in head.externals:
            token_dim, read_dim = part.token_dim(node), part.dims.dim_index(node, region.read)
            if token_dim is not None:
                input_dims.append(("sequence", token_dim))
            else:
                input_dims.append(None if read_dim is None else ("read", read_dim))
        output_dims = [part.dims.dim_index(o, region.read) for o in region.outputs]
        self.root.add_module("head_chunks", HeadChunks(head.module, region, input_dims, output_dims, chunk))
        call = self.graph.call_module("head_chunks", (self.ctx, *(self.env[n] for n in head.externals)))
        for i, out in enumerate(region.outputs):
            self.env[out] = self.graph.call_function(operator.getitem, (call, i))


def _tree_copy(
    node: fx.Node, inside: set[fx.Node]
) -> tuple[fx.Graph, fx.Node, dict[fx.Node, fx.Node], dict[fx.Node, fx.Node]]:
    """Copy the ancestors of `node` that are `inside` into a new graph, one
    copy per use. Other inputs become placeholders. Returns the tree, its
    root, `leaves` (placeholder -> original) and `origin` (copy -> original)."""
    tree = fx.Graph()
    leaves: dict[fx.Node, fx.Node] = {}
    origin: dict[fx.Node, fx.Node] = {}

    def visit(n: fx.Node) -> fx.Node:
        if n not in inside:
            leaf = tree.placeholder(n.name)
            leaf.meta = dict(n.meta)
            leaves[leaf] = n
            return leaf
        new = tree.node_copy(n, visit)
        new.meta = dict(n.meta)
        origin[new] = n
        return new

    root = visit(node)
    return tree, root, leaves, origin


def build_step(
    part: Partition, kind: str, head_chunk: int | None = None, slots: list[StateSlot] | None = None,
    outputs: list[fx.Node] | None = None, handed: set[fx.Node] = frozenset(), rows: int = 1,
) -> StepGraph:
    """`prefix`: outputs the captured tensors of `slots` (default: all) for
    positions [o, o+n) of the prompt row. `branch`: outputs `outputs`
    (default: all branch outputs) of `rows` responses, its head region
    `head_chunk` positions at a time when it has one. Nodes in `handed` are
    inputs of the step (computed per row by an earlier stage, `stages.py`)."""
    imports = set(step_imports(part)) | set(handed)
    if kind == "prefix":
        wanted = [s.node for s in (part.slots if slots is None else slots)]
    else:
        wanted = list(part.branch_outputs if outputs is None else outputs)
    return _StepBuilder(part, kind, rows).build(list(dict.fromkeys(wanted)), lambda n: n in imports, head_chunk, slots=slots)
