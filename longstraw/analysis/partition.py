"""Classify every node of the loss graph and record the decisions.

- *sequence* nodes carry the token axis (the union-find class of the
  attention queries' position dimension): they run in prompt chunks and in
  branch replays, one position range at a time;
- *roots* are the first sequence nodes built from inputs (`cat([prompt
  .expand(G, -1), responses], 1)`), computed once per call and sliced;
- *exits* restrict the token axis to the positions the loss reads
  (`logits[:, P-1:-1]`); the earliest exit bounds the shared prefix;
- *branch* nodes follow exits and stay per-row along the group axis; the
  ones the tail reads are the branch outputs;
- *tail* nodes are everything after (the loss reduction), run under
  autograd on the stacked branch outputs;
- *outer* nodes depend on no sequence node: parameter-only ones are
  recomputed where needed, data ones are computed once per call.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.fx as fx

from longstraw.passes import DEFAULT_PASSES, ArchitecturePass, SiteState

from longstraw.analysis.boundary import choose_state
from longstraw.analysis.dims import DimAnalysis
from longstraw.analysis.dim_types import Restriction
from longstraw.errors import InputError, UnsupportedGraphError, describe_node
from longstraw.trace.functionalize import is_updated
from longstraw.analysis.mask_bands import key_padding_of
from longstraw.analysis.refusals import (
    check_position_tables,
    check_sequence_ops,
    nothing_claimed,
    padded_to_a_window,
    position_length,
    unsupported,
)
from longstraw.nodes import ancestors, is_call, is_side_effect, op_name, tensor_inputs, tensor_of
from longstraw.analysis.slots import StateSlot
from longstraw.pass_registry import claiming_pass

log = logging.getLogger("longstraw.analysis.partition")


@dataclasses.dataclass(frozen=True)
class Root:
    """A sequence tensor built from inputs: sliced per chunk and per branch."""

    node: fx.Node
    token_dim: int
    batch_dim: int | None
    structural_prefix: int | None  # prompt length when the graph proves rows equal


@dataclasses.dataclass(frozen=True)
class Exit:
    node: fx.Node
    restriction: Restriction  # on the token axis, in full-sequence positions


@dataclasses.dataclass(frozen=True)
class Partition:
    """Every decision about one graph; the step builder and the summary read
    it. `classify` makes it without state (`slots` and `sites` empty);
    `with_state` adds the state the claimed operators read."""

    graph: fx.Graph
    placeholders: list[fx.Node]
    params: set[fx.Node]
    dims: DimAnalysis
    token: int
    batch: int
    seq_len: int
    group_size: int
    claims: dict[fx.Node, ArchitecturePass]
    sites: dict[fx.Node, list[SiteState]]
    slots: list[StateSlot]
    roots: list[Root]
    exits: list[Exit]
    sequence: set[fx.Node]
    positional: set[fx.Node]
    branch: set[fx.Node]
    tail: set[fx.Node]
    outer_data: set[fx.Node]
    branch_outputs: list[fx.Node]
    first_consumed: int
    end: int  # one past the last position the loss reads; later ones are never run
    # key masks read from inputs (`mask.key_padding_of`): outer data, computed once per call by the outer graph
    key_padding: tuple[fx.Node, ...] = ()

    def batch_dim(self, node: fx.Node) -> int | None:
        return self.dims.dim_index(node, self.batch)

    def token_dim(self, node: fx.Node) -> int | None:
        return self.dims.dim_index(node, self.token)


def classify(
    gm: fx.GraphModule, params: set[fx.Node], passes: tuple[ArchitecturePass, ...] = DEFAULT_PASSES
) -> Partition:
    """The claim, dimension and classification stages: which pass claims
    which operator, which dimensions are the sequence and group axes, and
    which nodes run per position, per branch, in the tail or once."""
    graph = gm.graph
    claims = {n: p for n in graph.nodes if is_call(n) and (p := claiming_pass(n, passes)) is not None}
    an = DimAnalysis(graph, lambda rules, n: claims[n].dim_rule(rules, n) if n in claims else None)
    if not claims:
        raise nothing_claimed(graph, an)
    for node, p in claims.items():
        reason = p.unsupported_reason(node)
        if reason:
            raise unsupported(node, f"cannot be replayed incrementally: {reason}")

    token, batch = _seed_axes(claims, an)
    key_padding = _key_padding(claims)
    padding_only = _used_only_by(graph, set(key_padding))
    sequence = {n for n in graph.nodes if an.carries_class(n, token)} - padding_only
    positional = _positional(graph, claims, sequence) - padding_only
    check_sequence_ops(graph, an, token, batch, sequence, claims, positional | padding_only)
    exits = _find_exits(graph, an, token, sequence, positional)
    roots = _find_roots(an, token, batch, sequence - positional, params)
    seq_len = an.factor_size(token)
    first_consumed = min(e.restriction.start for e in exits)
    for e in exits:
        if e.restriction.stop <= e.restriction.start:
            raise InputError(
                f"the loss reads an empty range of positions at {describe_node(e.node)}: "
                "responses must have at least one token"
            )
    post = _descendants(graph, {e.node for e in exits}) - sequence
    for node in sequence - positional:
        for arg in node.all_input_nodes:
            if arg in post:
                raise unsupported(node, "combines a restricted range of positions with the full sequence (a shift)")
    for node in graph.find_nodes(op="output"):
        for arg in node.all_input_nodes:
            if arg in sequence:
                raise unsupported(arg, "is returned from the loss with its full sequence axis (prompt positions included)")
    branch, tail = _split_branch_tail(graph, an, batch, post, {e.node for e in exits})
    branch_outputs = [
        n for n in graph.nodes if n in branch and any(u in tail or u.op == "output" for u in n.users)
    ]
    if not branch_outputs:
        raise UnsupportedGraphError("the loss reads nothing per response: no branch outputs were found")
    outer = set(graph.nodes) - sequence - post
    outer_data = {n for n in outer if _depends_on_data(n, params)}
    group_size = _group_size(roots)
    part = Partition(
        graph=graph,
        placeholders=list(graph.find_nodes(op="placeholder")),
        params=params,
        dims=an,
        token=token,
        batch=batch,
        seq_len=seq_len,
        group_size=group_size,
        claims=claims,
        sites={},
        slots=[],
        roots=roots,
        exits=exits,
        sequence=sequence,
        positional=positional,
        branch=branch,
        tail=tail,
        outer_data=outer_data,
        branch_outputs=branch_outputs,
        first_consumed=first_consumed,
        end=max(e.restriction.stop for e in exits),
        key_padding=key_padding,
    )
    check_position_tables(graph, part.end)
    log.debug(
        "partition: %d sequence, %d branch, %d tail nodes; first consumed position %d",
        len(sequence), len(branch), len(tail), first_consumed,
    )
    return part


def with_state(part: Partition) -> Partition:
    """The state stage: which tensors to capture for the claimed operators
    (`boundary.choose_state`: the cheapest cut per position, carried states)."""
    slots, sites = choose_state(part.claims, part.dims, part.token, part.batch)
    log.debug("state: %d slots", len(slots))
    return dataclasses.replace(part, slots=slots, sites=sites)


def _seed_axes(claims: dict[fx.Node, ArchitecturePass], an: DimAnalysis) -> tuple[int, int]:
    """The sequence and group classes of the claimed operators. A size-1
    factor of a query's position dimension that is not a group axis is
    dropped: it numbers nothing (GPT-BigCode's multi-query attention views
    `c_attn(x).unsqueeze(1)` as `[G, L, heads, d]`, merging that 1 into the
    positions, one more per layer), and the steps already size it as 1."""
    positions = {node: p.position_dims(node) for node, p in claims.items()}
    batches = {an.dims_of(batch_node)[batch_dim] for _, (batch_node, batch_dim) in positions.values()}
    group = {c for dim in batches for c in an.classes(dim)}
    tokens: dict[tuple[int, ...], fx.Node] = {}
    for node, ((seq_node, seq_dim), _) in positions.items():
        classes = an.classes(an.dims_of(seq_node)[seq_dim])
        tokens.setdefault(tuple(c for c in classes if an.factor_size(c) != 1 or c in group), node)
    if len(tokens) != 1:
        first, second = list(tokens.values())[:2]
        if padded_to_a_window(positions[first][0], positions[second][0]):
            lengths = [position_length(positions[node][0]) for node in (first, second)]
            raise UnsupportedGraphError(
                f"{describe_node(first)} runs over {lengths[0]} positions and {describe_node(second)} over "
                f"{lengths[1]}. If the loss runs one sequence, the model treats a sequence this short differently "
                "(HF's cache pads a causal convolution's states shorter than its kernel to the kernel's length). "
                "Call the model with use_cache=False, or trace the loss with a longer prompt and completion."
            )
        raise UnsupportedGraphError(
            f"{describe_node(first)} and {describe_node(second)} run over two different sequences: LongStraw "
            "shares one prompt along one sequence axis. Build the input ids once and pass the same tensor to "
            "every model the loss runs (or compute one sequence from the other)."
        )
    if len(next(iter(tokens))) != 1:
        raise unsupported(next(iter(tokens.values())), "runs over positions that are a product of several axes")
    batch_list = list(batches)
    for b in batch_list[1:]:
        an.unify(batch_list[0], b)
    token = next(iter(tokens))[0]
    batch = an.classes(batch_list[0])[0]
    if token == batch:
        raise UnsupportedGraphError("the batch and sequence axes of the attention queries could not be told apart")
    return token, batch


def _key_padding(claims: dict[fx.Node, ArchitecturePass]) -> tuple[fx.Node, ...]:
    """The key masks read from inputs in claimed nodes' masks (a 2-D padding
    mask): data, computed once per call for the whole sequence by the
    outer graph instead of per block by the step."""
    found = (key_padding_of(m) for node, p in claims.items() for m in p.positional_inputs(node))
    return tuple(dict.fromkeys(k for k in found if k is not None))


def _used_only_by(graph: fx.Graph, targets: set[fx.Node]) -> set[fx.Node]:
    """`targets` and the nodes computed only for them (inputs excluded)."""
    out = set(targets)
    for node in reversed(graph.nodes):
        if node.op != "placeholder" and node.users and all(u in out for u in node.users):
            out.add(node)
    return out


def _positional(graph: fx.Graph, claims: dict[fx.Node, ArchitecturePass], sequence: set[fx.Node]) -> set[fx.Node]:
    """Nodes used only to build claimed nodes' positional inputs (masks):
    the step rebuilds those per block instead of running them. A pass's
    `per_position_inputs` and their ancestors are not among them."""
    roots = {m for node, p in claims.items() for m in p.positional_inputs(node) if m in sequence}
    consumers = {node: set(p.positional_inputs(node)) for node, p in claims.items()}
    per_position = {m for node, p in claims.items() for m in p.per_position_inputs(node)}
    out: set[fx.Node] = set()
    for node in reversed(graph.nodes):
        if node.op == "placeholder" or not (node in roots or node.users) or is_side_effect(node):
            continue
        if node in per_position:
            continue
        if all(u in out or (u in consumers and not _used_outside(u, node, consumers[u])) for u in node.users):
            out.add(node)
    return out


def _used_outside(user: fx.Node, node: fx.Node, positional_inputs: set[fx.Node]) -> bool:
    """Whether `user` reads `node` other than as one of its positional inputs."""
    uses: list[fx.Node] = []
    fx.node.map_arg((user.args, user.kwargs), uses.append)
    return uses.count(node) > (1 if node in positional_inputs else 0)


def _find_exits(
    graph: fx.Graph, an: DimAnalysis, token: int, sequence: set[fx.Node], positional: set[fx.Node]
) -> list[Exit]:
    exits = []
    for node in graph.nodes:
        if node in sequence or node in positional or not is_call(node):
            continue
        r = an.restriction(node, token)
        if r is not None and node.args[0] in sequence and not is_updated(node):
            if r.step != 1:
                raise unsupported(node, "reads every k-th position of the sequence")
            exits.append(Exit(node, r))
    if not exits:
        raise UnsupportedGraphError(
            "the loss never selects response positions from the sequence (e.g. `logits[:, P-1:-1]`), "
            "so no shared prefix can be skipped"
        )
    return exits


def _group_invariant(node: fx.Node, an: DimAnalysis, batch: int) -> bool:
    """Whether every row of `node` along the group axis is provably the same
    (it was broadcast from a tensor without that axis)."""
    name = op_name(node)
    if name in ("expand", "broadcast_to", "expand_as", "repeat"):
        src = node.args[0]
        batch_dim = an.dim_index(node, batch)
        offset = tensor_of(node).dim() - tensor_of(src).dim()
        src_dim = None if batch_dim is None else batch_dim - offset
        return src_dim is None or src_dim < 0 or tensor_of(src).shape[src_dim] == 1
    if name in ("contiguous", "clone", "to", "long", "int", "view", "reshape"):
        return _group_invariant(node.args[0], an, batch)
    return False


def _find_roots(
    an: DimAnalysis, token: int, batch: int, sequence: set[fx.Node], params: set[fx.Node]
) -> list[Root]:
    roots = []
    for node in sequence:
        inputs = tensor_inputs(node)
        if node.op == "placeholder":
            if node in params:
                continue
        elif not inputs or any(i in sequence for i in inputs) or not any(_depends_on_data(i, params) for i in inputs):
            continue
        token_dim = an.dim_index(node, token)
        structural = None
        if op_name(node) in ("cat", "concat") and node.args:
            parts = list(node.args[0])
            cat_dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % tensor_of(node).dim()
            if cat_dim == token_dim and len(parts) >= 2 and _group_invariant(parts[0], an, batch):
                structural = tensor_of(parts[0]).shape[cat_dim]
        roots.append(Root(node, token_dim, an.dim_index(node, batch), structural))
    if not roots:
        raise UnsupportedGraphError(
            "no shared prefix found: no input-built tensor carries the sequence axis (expected e.g. "
            "`torch.cat([prompt.expand(G, -1), responses], 1)` or input ids whose rows share a prefix)"
        )
    return sorted(roots, key=lambda r: r.node.name)


def _descendants(graph: fx.Graph, starts: set[fx.Node]) -> set[fx.Node]:
    out = set(starts)
    for node in graph.nodes:
        if any(a in out for a in node.all_input_nodes):
            out.add(node)
    return out


def _split_branch_tail(
    graph: fx.Graph, an: DimAnalysis, batch: int, post: set[fx.Node], exits: set[fx.Node]
) -> tuple[set[fx.Node], set[fx.Node]]:
    """Branch nodes stay per row along the group axis; the rest of `post` is tail."""
    branch: set[fx.Node] = set()
    tail: set[fx.Node] = set()
    for node in graph.nodes:
        if node not in post or node.op == "output":
            continue
        per_row = (
            tensor_of(node) is not None
            and node not in an.unknown
            and an.has_class(node, batch)
            and not any(batch in an.classes(d) for d in an.mixes.get(node, []))
            and not any(a in tail for a in node.all_input_nodes)
            and not any(batch in an.classes(an.dims_of(node.args[0])[r.in_dim]) for r in an.restricts.get(node, []))
        )
        (branch if per_row else tail).add(node)
    return branch, tail


def _depends_on_data(node: fx.Node, params: set[fx.Node]) -> bool:
    return any(
        n.op == "placeholder" and n not in params and isinstance(tensor_of(n), torch.Tensor) for n in ancestors([node])
    )


def _group_size(roots: list[Root]) -> int:
    sizes = {tensor_of(r.node).shape[r.batch_dim] if r.batch_dim is not None else 1 for r in roots}
    if len(sizes) != 1:
        raise InputError(f"inputs disagree on the group size: {sorted(sizes)}")
    return sizes.pop()
