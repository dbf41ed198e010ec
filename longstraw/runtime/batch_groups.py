"""Rows sharing one prompt, found from a call's values, and the checks of what a plan
assumed of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import fx

from longstraw.analysis.partition import Partition, Root
from longstraw.errors import InputError, UnsupportedGraphError, argument_name, describe_node
from longstraw.nodes import ancestors
from longstraw.runtime.call_state import Group
from longstraw.runtime.mask_block import HOST_COPY
from longstraw.runtime.prompt_state import has_values


class BatchGroups:
    """A call's batch read against the plan: which rows share one prompt
    (the groups), how many prompt positions are shared, and the checks
    that what the plan assumed of the values holds (padding masks, per-row
    values the prompt reads), on every call: these are data, never folded."""

    def __init__(self, part: Partition, padding_roots: Sequence[Root], shared_values: Sequence[fx.Node]) -> None:
        self.part = part
        self.padding_roots = padding_roots
        self.shared_values = shared_values

    def prefix_len(self, values: dict) -> int:
        """Positions captured as state: before the first position the loss
        reads, and shared by every row (proved by the graph, else checked)."""
        prefix_len = self.part.first_consumed
        for root in self.part.roots:
            if root in self.padding_roots:
                continue
            if root.structural_prefix is not None:
                shared = root.structural_prefix
            else:
                shared = _shared_prefix(values[root.node], root.batch_dim, root.token_dim)
                if shared == 0 and self.part.group_size > 1:
                    raise InputError(
                        f"no shared prefix: the rows of `{root.node.name}` already differ at position 0, "
                        "so the group has no common prompt to capture"
                    )
            prefix_len = min(prefix_len, shared)
        return prefix_len

    def check_prompt_gradients(self, requires_grad: Sequence[bool], prompt_inputs: Sequence[fx.Node]) -> None:
        """Exact mode cannot give per-row gradients to per-row inputs of the
        prompt's computation (`prompt_inputs`: what the prompt step reads):
        the prompt runs once, from row 0, and the gradient of each row's
        prompt positions is their sum. Eager keeps them apart, so such
        inputs are refused (inputs broadcast from one prompt inside the
        loss, `prompt.expand(G, ...)`, are fine: their gradient is that sum)."""
        part = self.part
        position = {p: i for i, p in enumerate(part.placeholders)}
        per_row = [r.node for r in part.roots if r.structural_prefix is None and r.node in prompt_inputs]
        for node in per_row + list(self.shared_values):
            if part.batch_dim(node) is None:
                continue
            for source in ancestors([node]):
                if source.op == "placeholder" and source not in part.params and requires_grad[position[source]]:
                    raise UnsupportedGraphError(
                        f"`{argument_name(source)}` requires grad and gives each row of the group its own copy of the prompt "
                        f"(through `{node.name}`): exact mode computes the prompt once and cannot tell the rows' "
                        "gradients apart. Pass the prompt once and expand it inside the loss "
                        "(`torch.cat([prompt.expand(G, -1, ...), responses], 1)`), or use prompt_grad='detached'."
                    )

    def groups(self, values: dict) -> list[Group]:
        """The batch's groups: rows equal in every per-row input over the
        prompt part (the positions before the first one the loss reads),
        padding masks included. One class of rows is one group, whose
        captured prefix is what all rows share (as long as the graph proves
        or the values show); several classes are several groups, each
        capturing the whole prompt part, and then every row must share its
        prompt with another."""
        part = self.part
        every_row = tuple(range(part.group_size))
        keyed = [r for r in part.roots if r.batch_dim is not None]
        shape_only = any(not has_values(values[r.node]) for r in keyed)  # meta or fake: one group, as traced
        if part.group_size == 1 or part.first_consumed == 0 or len(keyed) < len(part.roots) or shape_only:
            return [Group(every_row, self.prefix_len(values))]
        per_row = [(values[r.node], r.batch_dim, r.token_dim) for r in keyed]
        per_row += [(values[k], part.batch_dim(k), part.token_dim(k)) for k in self.part.key_padding if part.batch_dim(k) is not None]
        classes = _rows_by_prompt(per_row, part.first_consumed)
        if len(classes) == 1 or all(len(rows) == 1 for rows in classes):
            # one prompt; or no two rows alike over the prompt part (the loss reads from inside the
            # prompt, or the rows diverge early): one group over the prefix every row shares
            return [Group(every_row, self.prefix_len(values))]
        for rows in classes:
            if len(rows) == 1:
                names = ", ".join(f"`{argument_name(r.node) if r.node.op == 'placeholder' else r.node.name}`" for r in keyed)
                masks = "".join(f" and the padding mask from {_inputs_named(k)}" for k in self.part.key_padding)
                raise InputError(
                    f"row {rows[0]} shares no prompt with any other row: the batch holds {len(classes)} different "
                    f"prompts (rows equal in {names}{masks} over the first {part.first_consumed} positions, the ones "
                    "before the loss reads any), and this row's prompt appears once. Each prompt needs at least two "
                    "completions in the batch, padded the same way; drop the row or score it in a separate call."
                )
        return [Group(rows, part.first_consumed) for rows in classes]

    def check_padding(self, values: dict, groups: Sequence[Group]) -> None:
        """A padding mask must be one for each group over the prompt, the
        positions before the first one the loss reads (the prompt is
        computed once, with the group's first row's mask), and a padding
        mask in every row: zeros, then ones, then zeros, the prompt's zeros
        on the left. Checked on every call: the mask is data, never folded."""
        prefix_len = self.part.first_consumed
        for root in self.padding_roots:
            value = values[root.node]
            if root.batch_dim is None or not has_values(value):
                continue
            rows = value.movedim((root.batch_dim, root.token_dim), (0, 1))
            rows = rows.reshape(*rows.shape[:2], -1).narrow(1, 0, prefix_len)
            for group in groups:
                _check_same_prompt(rows, group.rows, root.node, _inputs_named(root.node))
        for node in self.part.key_padding:
            # the call's host copy where the runner made one (`mask_block.attach_host_copy`): no second copy
            value, batch_dim = getattr(values[node], HOST_COPY, values[node]), self.part.batch_dim(node)
            if not has_values(value):
                continue
            keys = value.movedim((batch_dim, -1), (0, 1)) if batch_dim is not None else value.movedim(-1, 0)[None]
            keys = keys.reshape(*keys.shape[:2], -1)  # [G, L, the other (size-1) dims]
            name = _inputs_named(node)
            if not bool((keys == keys[..., :1]).all()):
                raise InputError(f"the key mask built from {name} ({describe_node(node)}) differs between heads: "
                                 "LongStraw supports a 2-D padding mask, one value per row and position")
            keys = keys[..., 0].narrow(1, 0, self.part.end).cpu()  # one copy: the checks below ask row by row
            for group in groups:
                _check_same_prompt(keys[:, :prefix_len, None], group.rows if batch_dim is not None else (0,), node, name)
            _check_is_padding(keys, prefix_len, name)

    def check_shared_values(self, values: dict, groups: Sequence[Group]) -> None:
        """Per-row values the prompt's computation reads must be the same in every row of a group."""
        for node in self.shared_values:
            value, batch_dim = values[node], self.part.batch_dim(node)
            if not (isinstance(value, torch.Tensor) and has_values(value) and batch_dim is not None and value.shape[batch_dim] > 1):
                continue
            name = argument_name(node) if node.op == "placeholder" else node.name
            per_row = value.movedim(batch_dim, 0).reshape(value.shape[batch_dim], 1, -1)  # [G, 1, values]
            for group in groups:
                rows_named = f" (rows {list(group.rows)}, which share one prompt)" if len(groups) > 1 else ""
                _check_rows_equal(per_row, group.rows, lambda row, _: (
                    f"`{name}` differs between the rows of the group but feeds the prompt's computation "
                    f"({describe_node(node)}){rows_named}: row {row} differs from row {group.rows[0]}, so the rows "
                    "would not share one prompt state. Pass one value for the whole group (or compute it after the "
                    "prompt)."
                ))


def _inputs_named(node: fx.Node) -> str:
    """The user's inputs `node` is computed from, for messages."""
    found = ancestors([node])
    names = [f"`{argument_name(n)}`" for n in node.graph.nodes if n.op == "placeholder" and n in found]
    return " and ".join(names) or f"`{node.name}`"


def _check_rows_equal(values: torch.Tensor, rows: Sequence[int], message: Callable[[int, int], str]) -> None:
    """`values` [G, positions, ...]: the group's `rows` equal to its first,
    else an InputError with `message(row, position)` for the first row that
    differs and the first position where it does."""
    group = values[list(rows)]
    differs = (group != group[:1]).flatten(2).any(-1)  # [rows, positions]
    if bool(differs.any()):
        i, position = (int(i) for i in differs.nonzero()[0])
        raise InputError(message(rows[i], position))


def _check_same_prompt(values: torch.Tensor, rows: Sequence[int], node: fx.Node, name: str) -> None:
    """`values` [G, prompt positions, ...]: a padding mask is the same in every row of a group."""
    _check_rows_equal(values, rows, lambda row, position: (
        f"row {row} of the attention mask {name} differs from row {rows[0]} at prompt position {position} "
        f"({describe_node(node)}): the rows share one prompt, computed once, so its padding must be the same "
        "in every row. Left-pad the prompt the same way for every completion of it."
    ))


def _check_is_padding(keys: torch.Tensor, prefix_len: int, name: str) -> None:
    """`keys` [G, L] bool: each row is zeros, ones, zeros (left padding in
    the prompt, right padding after it); otherwise name the row and position."""
    on = keys.long()
    ends = (on[:, :-1] > on[:, 1:]).long()  # a one followed by a zero: [G, L - 1]
    after_end = torch.cumsum(ends, 1) > 0  # positions 1.. at or after the first zero that follows a one
    restart = after_end & keys[:, 1:].bool()
    for row in range(keys.shape[0]):
        ended = ends[row].nonzero()
        if not ended.numel():
            continue
        hole = int(ended[0, 0]) + 1
        again = restart[row].nonzero()
        if hole < prefix_len:
            raise InputError(
                f"row {row} of the attention mask {name} has a hole inside the prompt: position {hole} is padding "
                "after real tokens. LongStraw takes padding masks: the prompt padded on the left, completions on "
                "the right (pad the prompt on the left, as TRL does)."
            )
        if again.numel():
            raise InputError(
                f"row {row} of the attention mask {name} marks position {int(again[0, 0]) + 1} real after padding "
                f"at position {hole}, after the prompt: a completion must be padded on the right only, its real "
                "tokens first."
            )


def _rows_by_prompt(values: Sequence[tuple[torch.Tensor, int, int]], length: int) -> list[tuple[int, ...]]:
    """Rows equal in every (value, batch dim, token dim) over the first
    `length` positions, as classes in order of their first row: each class
    is the rows equal to its first, one comparison (and one sync) per class.
    (`torch.unique(dim=0)` sorts the rows: 90 ms at 16 rows of 16K positions
    on an H200.)"""
    flat = []
    for value, batch_dim, token_dim in values:
        prompt = value.narrow(token_dim, 0, length).movedim(batch_dim, 0)
        flat.append(prompt.reshape(prompt.shape[0], -1))
    left, classes = list(range(flat[0].shape[0])), []
    while left:
        first = left[0]
        same = torch.stack([(rows == rows[first]).all(-1) for rows in flat]).all(0)  # [rows]
        members = same.nonzero().flatten().tolist()
        classes.append(tuple(members))
        taken = set(members)
        left = [row for row in left if row not in taken]
    return classes


def _shared_prefix(value: torch.Tensor, batch_dim: int | None, token_dim: int) -> int:
    """Number of leading positions at which every row equals the first."""
    if batch_dim is None:
        return value.shape[token_dim]
    same = value == value.narrow(batch_dim, 0, 1)
    other = [d for d in range(value.dim()) if d != token_dim]
    per_position = same.permute(token_dim, *other).reshape(value.shape[token_dim], -1).all(dim=1)
    differs = (~per_position).nonzero()
    return int(differs[0, 0]) if differs.numel() else value.shape[token_dim]
