"""DeepSeek sparse attention (GLM-5's `glm_moe_dsa`): MLA whose mask keeps,
per query, only the `k` earlier positions a lightweight indexer scores highest.

HF's indexer (under `no_grad`) scores query `i` against key `j` as

    score[i, j] = sum_h w[i, h] * relu(scale * q[i, h] . k[j])      (float32)

with `q` [B, L, H, D] and the weights `w` [B, L, H] per query and one index
key `k` [B, L, D] per position, fills later keys with -inf, takes
`topk(score, k)` and scatters the indices into a boolean mask that is
and-ed with the causal mask before SDPA. `selection_of` proves exactly
that chain from the graph; `latent_of` (`passes/mla.py`) proves the MLA
around it. The state per position is the latent, the rope key and the
index key; the index query and weights are per-position inputs of the step.

The step selects without a query x key score matrix: it walks the keys
`[0, o + n)` in tiles (`tiled_topk`), keeping per query the best `k`
(value, position) pairs seen so far (a stable sort of the running best and
the tile, running best first), a block of query rows at a time so that a
tile stays `INDEX_KEY_TILE` keys wide: each merge sorts the k running
best with a whole tile, not with a sliver of it. Among equal scores the earlier position
wins; `torch.topk`'s choice among ties is unspecified, so a tie across the
k-th place is the one case where the selection may differ from eager's:
the step warns when it sees one.
A query with fewer than `k` earlier positions reads all of them, as eager
(its extra picks are later positions, which the causal mask drops).

The selection has no gradient (eager's indexer runs under `no_grad`); the
absorbed attention reads only the selected positions, gathered a block of
queries at a time (`runtime/kernels/latent_attention.py`, `_LatentOverSelection`: n x k pairs,
not n x (o + n)), and their latent and rope key gradients go to d(state)
in exact mode.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import torch
import torch.fx as fx

from longstraw.analysis.mask_bands import band_of, selected_by_topk
from longstraw.nodes import arg, is_sdpa, op_name, tensor_of
from longstraw.parallel.shards import by_rank, gather_round, padded_to, shard_positions
from longstraw.runtime.kernels.latent_attention import absorbed_attention, flat_positions
from longstraw.runtime.prompt_state import StepContext, has_values

from .base import ArchitecturePass, SiteState, StepEmitter, each_row_as_one_step
from .mla import latent_of

INDEX_KEY_TILE = 4096  # at most this many keys scored at once
INDEX_BLOCK_SCORES = 1 << 24  # and at most this many float32 scores (query rows x index heads x keys) at once
TIE = (
    "longstraw: DSA top-k selection: a query's k-th and (k+1)-th index scores are equal; LongStraw keeps the "
    "earlier position, eager's torch.topk picks among ties as it likes, so this selection may differ from an "
    "eager run's (docs/design.md, GLM-5 / DeepSeek sparse attention)"
)


@dataclasses.dataclass(frozen=True)
class TopkSelection:
    """A proved DSA selection: `query` [B, L, H, D], `key` [B, L, D] and
    `weights` [B, L, H] of the indexer, its score `scale` and `k`."""

    query: fx.Node
    key: fx.Node
    weights: fx.Node
    scale: float
    k: int


def _single(node: object, *names: str) -> fx.Node | None:
    """`node.args[0]` if `node` is one of the operators `names`."""
    if isinstance(node, fx.Node) and op_name(node) in names and node.args and isinstance(node.args[0], fx.Node):
        return node.args[0]
    return None


def _to_float32(node: object) -> fx.Node | None:
    """The input of `x.float()` or `x.to(torch.float32)`."""
    if not isinstance(node, fx.Node):
        return None
    if op_name(node) == "float" and len(node.args) == 1 and not node.kwargs:
        return node.args[0]
    if op_name(node) == "to" and tuple(node.args[1:]) == (torch.float32,) and not node.kwargs:
        return node.args[0]
    return None


def _int_arg(node: fx.Node, index: int, name: str, default: object, want: int) -> bool:
    value = arg(node, index, name, default)
    return isinstance(value, int) and value % tensor_of(node.args[0]).dim() == want % tensor_of(node.args[0]).dim()


def _causal(mask: object, length: int) -> bool:
    """A positions-only boolean mask proved causal over `length` x `length`."""
    return (
        isinstance(mask, fx.Node) and tensor_of(mask) is not None and tensor_of(mask).dtype == torch.bool
        and tuple(tensor_of(mask).shape[-2:]) == (length, length) and band_of(mask) == (0, math.inf)
    )


def _causal_rows(node: fx.Node | None, length: int) -> bool:
    """`mask[:, h]` (HF's `attention_mask[:, 0, :, :]`) of a proved causal [B, H, L, L] mask."""
    if node is None or op_name(node) != "getitem" or not isinstance(node.args[1], tuple) or len(node.args[1]) != 4:
        return False
    whole = slice(None)
    batch, head, rows, columns = node.args[1]
    return batch == rows == columns == whole and isinstance(head, int) and _causal(node.args[0], length)


def _index_mask(mask: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(causal mask, top-k indices) of `causal & ~scatter(ones, -1, indices, False).unsqueeze(1)`."""
    if op_name(mask) != "and_" or len(mask.args) != 2:
        return None
    for causal, inverted in (mask.args, mask.args[::-1]):
        unsqueezed = _single(inverted, "invert")
        scattered = _single(unsqueezed, "unsqueeze")
        if scattered is None or unsqueezed.args[1:] != (1,):
            continue
        if op_name(scattered) != "scatter" or len(scattered.args) != 4 or scattered.kwargs:
            continue
        ones, dim, index, value = scattered.args
        if value is not False or not isinstance(dim, int) or dim % tensor_of(scattered).dim() != 2:
            continue
        if tensor_of(scattered).shape[-1] != tensor_of(scattered).shape[-2]:  # keys beyond the queries (a cache)
            continue
        if op_name(ones) != "new_ones" or tensor_of(ones).dtype != torch.bool:
            continue
        indices = _single(index, "long")
        if indices is None or ones.args[0] is not indices:
            continue
        return causal, indices
    return None


def _topk_of(indices: fx.Node) -> tuple[fx.Node, int] | None:
    """(scores, k) of `topk(scores, k, dim=-1).indices.to(int32)` (largest)."""
    if op_name(indices) != "to" or tuple(indices.args[1:]) != (torch.int32,) or indices.kwargs:
        return None
    picked = indices.args[0]
    if op_name(picked) != "getitem" or picked.args[1] != 1:
        return None
    topk = picked.args[0]
    if not isinstance(topk, fx.Node) or op_name(topk) != "topk" or not _int_arg(topk, 2, "dim", -1, -1):
        return None
    k = arg(topk, 1, "k")
    if not isinstance(k, int) or not arg(topk, 3, "largest", True):
        return None
    return topk.args[0], k


def selection_of(node: fx.Node) -> TopkSelection | None:
    """The DSA selection the SDPA `node`'s mask applies, if the graph proves it (module docstring)."""
    mask = arg(node, 3, "attn_mask")
    if not is_sdpa(node) or not isinstance(mask, fx.Node) or arg(node, 5, "is_causal", False):
        return None
    length = tensor_of(node.args[0]).shape[-2]
    found = _index_mask(mask)
    if found is None or not _causal(found[0], length):
        return None
    topk = _topk_of(found[1])
    if topk is None:
        return None
    filled, k = topk
    if op_name(filled) != "masked_fill" or filled.args[2:] != (-math.inf,):
        return None
    if not _causal_rows(_single(filled.args[1], "invert"), length):
        return None
    return _scores_of(filled.args[0], k, length)


def _scores_of(scores: fx.Node, k: int, length: int) -> TopkSelection | None:
    """`squeeze(matmul(w.unsqueeze(-2), relu(matmul(q.float(), k.T.float().unsqueeze(1)) * s)), -2)`."""
    product = _single(scores, "squeeze")
    if product is None or op_name(product) != "matmul" or not _int_arg(scores, 1, "dim", None, -2):
        return None
    weights = _single(product.args[0], "unsqueeze")
    if weights is None or not _int_arg(product.args[0], 1, "dim", None, -2):
        return None
    scaled = _single(product.args[1], "relu")
    if scaled is None or op_name(scaled) != "mul" or not isinstance(scaled.args[1], float):
        return None
    dot = scaled.args[0]
    if not isinstance(dot, fx.Node) or op_name(dot) != "matmul":
        return None
    query, keys_t = _to_float32(dot.args[0]), _single(dot.args[1], "unsqueeze")
    if query is None or keys_t is None or dot.args[1].args[1:] != (1,):
        return None
    transposed = _to_float32(keys_t)
    key = _single(transposed, "transpose")
    if key is None or {d % 3 for d in transposed.args[1:3]} != {1, 2}:
        return None
    q, kk, w = tensor_of(query), tensor_of(key), tensor_of(weights)
    if q.dim() != 4 or kk.dim() != 3 or w.dim() != 3 or w.dtype != torch.float32:
        return None
    batch, positions, heads, dim = q.shape
    if positions != length or tuple(kk.shape) != (batch, length, dim) or tuple(w.shape) != (batch, length, heads):
        return None
    return TopkSelection(query=query, key=key, weights=weights, scale=scaled.args[1], k=k)


class SparseLatentAttentionPass(ArchitecturePass):
    """SDPA with a top-k selection mask: proved DSA over MLA, or refused."""

    name = "sparse_latent_attention"
    overrides = ("causal_attention",)
    runs_rounds = True  # `_round_topk`, then `latent_attention._RoundLatentOverSelection`
    branch_graphs_kept = True  # the selection is made in the forward; the backward reads earlier keys only
    branches_batched = True  # `sparse_latent_attention_step` runs a batched step's rows one by one over the state

    def claims(self, node: fx.Node) -> bool:
        return selected_by_topk(node)

    def unsupported_reason(self, node: fx.Node) -> str | None:
        if arg(node, 4, "dropout_p", 0.0) != 0.0:
            return "attention dropout is not replayed; put the model in eval mode or set attention_dropout=0"
        if selection_of(node) is None:
            return (
                "its attn_mask selects keys with a top-k that is not DeepSeek sparse attention's indexer as "
                "LongStraw proves it (passes/sparse_index.py: relu scores of an index query against one index "
                "key per position, weighted over index heads, causal, scattered into the causal mask)"
            )
        batch, _, length, _ = tensor_of(node.args[0]).shape
        if batch == length:
            return (
                f"the group size equals the sequence length ({batch}), so the shapes cannot tell the latent's "
                "group axis from its positions (passes/mla.py): use another group size or response length"
            )
        if latent_of(node) is None:
            return (
                "it applies a DSA top-k selection to attention that is not proved to be multi-head latent "
                "attention (passes/mla.py): only MLA with a DSA indexer is supported"
            )
        return None

    def position_dims(self, node: fx.Node) -> tuple[tuple[fx.Node, int], tuple[fx.Node, int]]:
        q = node.args[0]
        return (q, 2), (q, 0)

    def positional_inputs(self, node: fx.Node) -> list[fx.Node]:
        return [arg(node, 3, "attn_mask")]  # proved: the step selects and masks itself

    def per_position_inputs(self, node: fx.Node) -> list[fx.Node]:
        found = selection_of(node)
        return [found.query, found.key, found.weights]

    def state_inputs(self, node: fx.Node) -> list[fx.Node]:
        latent, selection = latent_of(node), selection_of(node)
        return [latent.latent, latent.rope_key, selection.key]

    def emit_step(self, emitter: StepEmitter, node: fx.Node, sites: list[SiteState]) -> fx.Node:
        latent, selection = latent_of(node), selection_of(node)
        latent_site, rope_site, index_site = sites
        kwargs = {
            "latent_slot": latent_site.slot,
            "rope_slot": rope_site.slot,
            "index_slot": index_site.slot,
            "nope_dim": latent.nope_dim,
            "scale": latent.scale,
            "index_scale": selection.scale,
            "k": selection.k,
        }
        inputs = (node.args[0], latent_site.cut, rope_site.cut, latent.weight,
                  selection.query, index_site.cut, selection.weights)
        return emitter.graph.call_function(sparse_latent_attention_step, (emitter.ctx, *emitter.mapped(inputs)), kwargs)


@dataclasses.dataclass(frozen=True)
class Selection:
    """Per query of a step, the selected key positions [n, k] and whether
    each pick is a key [n, k] (a query with fewer than k earlier positions
    picks fewer)."""

    positions: torch.Tensor
    valid: torch.Tensor


def select_topk(
    ctx: StepContext, query: torch.Tensor, own_keys: torch.Tensor, weights: torch.Tensor, index_slot: int,
    scale: float, k: int,
) -> Selection:
    """The top-`k` keys of `[0, o + n)` for the step's queries at `[o, o + n)`."""
    o, n = ctx.offset, ctx.length
    heads = query.shape[-2]
    query, weights, own = query.reshape(n, heads, -1), weights.reshape(n, heads), own_keys.reshape(n, -1)
    if ctx.round is not None:
        return _round_topk(ctx, query, weights, own, index_slot, scale, k)
    if ctx.state.shard is not None:
        return _sharded_topk(ctx, query, weights, own, index_slot, scale, k)
    earlier = flat_positions(ctx, index_slot, ctx.visible(index_slot)).narrow(0, 0, o)  # [o, D]
    return tiled_topk(query, weights, earlier, own, scale, k)


def tiled_topk(
    query: torch.Tensor, weights: torch.Tensor, earlier: torch.Tensor, own: torch.Tensor, scale: float, k: int
) -> Selection:
    """Per query `query` [n, H, D] (weights [n, H]) at positions `[o, o + n)`,
    the `k` best of the keys `[0, o + n)` (`earlier` [o, D], then `own`
    [n, D]), walked a tile of keys at a time (`INDEX_KEY_TILE` keys, fewer
    only where one query row's H x tile would pass `INDEX_BLOCK_SCORES`) for
    a block of query rows at a time (as many as that budget holds); float32,
    as HF's indexer. Rows are independent, so the blocks change no pick."""
    return _selection(*_best(query, weights, earlier, own, scale, k), k)


def _best(
    query: torch.Tensor, weights: torch.Tensor, earlier: torch.Tensor, own: torch.Tensor, scale: float, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`tiled_topk`'s k + 1 best (scores, positions) per query, best first."""
    n, heads = query.shape[0], query.shape[1]
    tile = max(1, min(INDEX_KEY_TILE, INDEX_BLOCK_SCORES // heads))
    row_block = max(1, INDEX_BLOCK_SCORES // (heads * tile))
    picks = [_tiled_rows(query[r:r + row_block], weights[r:r + row_block], earlier, own, r, tile, scale, k)
             for r in range(0, n, row_block)]
    return torch.cat([b for b, _ in picks]), torch.cat([p for _, p in picks])  # [n, <= k + 1] each


def _selection(best: torch.Tensor, positions: torch.Tensor, k: int) -> Selection:
    """The first k of the k + 1 best, warning when the k-th ties with the next."""
    if best.shape[1] > k and has_values(best):  # the planner's simulation runs on fake tensors
        if bool(((best[:, k - 1] == best[:, k]) & (best[:, k] > -math.inf)).any()):
            warnings.warn(TIE, stacklevel=3)
    return Selection(positions[:, :k], best[:, :k] > -math.inf)


def _sharded_topk(
    ctx: StepContext, query: torch.Tensor, weights: torch.Tensor, own: torch.Tensor, index_slot: int, scale: float,
    k: int,
) -> Selection:
    """`tiled_topk` under context parallelism: each rank's k + 1 best among
    its share of the earlier index keys, gathered in rank order, then the
    step's own keys (every rank scores them), merged by a stable sort: among
    equal scores the earlier position wins, as in `tiled_topk`."""
    shard = ctx.state.shard
    local = flat_positions(ctx, index_slot, shard_positions(ctx, index_slot, 0, shard.held_before(ctx.offset)))
    best, positions = _padded(*_best(query, weights, local, own[:0], scale, k), k + 1)
    gathered = [(torch.empty_like(best), torch.empty_like(positions)) for _ in range(shard.ranks.size)]
    shard.ranks.all_gather([b for b, _ in gathered], best)
    shard.ranks.all_gather([p for _, p in gathered], shard.to_global(positions))
    own_best, own_positions = _best(query, weights, own[:0], own, scale, k)  # causal among the step's own keys
    scores = torch.cat([*(b for b, _ in gathered), own_best], -1)
    picked = torch.cat([*(p for _, p in gathered), own_positions + ctx.offset], -1)
    return _merged_selection(scores, picked, k)


def _round_topk(
    ctx: StepContext, query: torch.Tensor, weights: torch.Tensor, own: torch.Tensor, index_slot: int, scale: float,
    k: int,
) -> Selection:
    """`_sharded_topk` for this rank's step of a round: the round's index
    queries and keys are gathered; each rank takes every chunk's k + 1 best
    among its share of the index keys before the round, and an all-to-all
    gives each rank every rank's for its own chunk, in rank order (1/W of
    an all-gather's data); this rank adds its own queries' k + 1 best among the round's
    keys before its chunk (none among branches, whose keys are not
    gathered) and its own (causal), and the stable sort merges them as in
    `_sharded_topk`."""
    shard, round_ = ctx.state.shard, ctx.round
    local = flat_positions(ctx, index_slot, shard_positions(ctx, index_slot, 0, shard.held_before(round_.start)))
    queries, weights_of = (gather_round(t, 0, round_, shard.ranks) for t in (query, weights))
    shares = [_padded(*_best(q, w, local, own[:0], scale, k), k + 1) for q, w in zip(queries, weights_of)]
    # every chunk's candidates from this rank's share, stacked in the order of the chunks' ranks: the
    # all-to-all sends each to its chunk's rank, which receives every rank's for its own chunk, in rank order
    best = by_rank([padded_to(b, 0, round_.longest, -math.inf) for b, _ in shares], round_)  # [W, longest, k + 1]
    positions = by_rank([padded_to(shard.to_global(p), 0, round_.longest) for _, p in shares], round_)
    got_best, got_positions = torch.empty_like(best), torch.empty_like(positions)
    shard.ranks.all_to_all(got_best, best)
    shard.ranks.all_to_all(got_positions, positions)
    n = query.shape[0]
    keys = [] if round_.branches else gather_round(own, 0, round_, shard.ranks)
    before = torch.cat([own[:0], *keys[:round_.before]])  # the round's index keys before this chunk
    round_best, round_positions = _best(query, weights, before, own, scale, k)
    scores = torch.cat([*got_best[:, :n], round_best], -1)
    picked = torch.cat([*got_positions[:, :n], round_positions + round_.start], -1)
    return _merged_selection(scores, picked, k)


def _merged_selection(scores: torch.Tensor, picked: torch.Tensor, k: int) -> Selection:
    """The k best of candidates gathered from several places (scores and
    positions [n, c]), by a stable sort: among equal scores the earlier
    candidate wins, as in `tiled_topk`."""
    order = scores.sort(dim=-1, descending=True, stable=True).indices[:, :k + 1]
    return _selection(scores.gather(-1, order), picked.gather(-1, order), k)


def _padded(best: torch.Tensor, positions: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(best, positions) widened to `width` columns with -inf scores (not keys), for the all-gather."""
    return padded_to(best, 1, width, -math.inf), padded_to(positions, 1, width)


def _tiled_rows(
    query: torch.Tensor, weights: torch.Tensor, earlier: torch.Tensor, own: torch.Tensor, first_row: int, tile: int,
    scale: float, k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`tiled_topk` for the query rows `[first_row, first_row + rows)` of the
    step: the k + 1 best (scores, positions), best first (one more than k:
    the tie check)."""
    o, rows = earlier.shape[0], query.shape[0]
    q = query.float()
    w = weights.float()[:, None, :]  # [rows, 1, H]
    at = torch.arange(o + first_row, o + first_row + rows, device=q.device)[:, None]  # the rows' positions
    end = o + own.shape[0]  # every block walks the step's keys: the same number of picks per row
    best = torch.empty(rows, 0, dtype=torch.float32, device=q.device)
    positions = torch.empty(rows, 0, dtype=torch.long, device=q.device)
    for start in range(0, end, tile):
        count = min(tile, end - start)
        keys = _key_tile(earlier, own, start, count).float()  # [count, D]
        scores = torch.matmul(w, torch.relu(torch.matmul(q, keys.T) * scale)).squeeze(-2)  # [rows, count]
        columns = torch.arange(start, start + count, device=q.device)[None, :]
        scores = scores.masked_fill(columns > at, -math.inf)
        merged = torch.cat([best, scores], -1)  # [rows, <= k + 1 + count]: the best so far first (earlier positions)
        order = merged.sort(dim=-1, descending=True, stable=True).indices[:, :k + 1]
        best = merged.gather(-1, order)
        positions = torch.cat([positions, columns.expand(rows, -1)], -1).gather(-1, order)
    return best, positions


def _key_tile(earlier: torch.Tensor, own: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """Keys `[start, start + count)`: the state's before `o`, the step's own after."""
    o = earlier.shape[0]
    parts = []
    if start < o:
        parts.append(earlier[start:min(o, start + count)])
    if start + count > o:
        parts.append(own[max(0, start - o):start + count - o])
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def sparse_latent_attention_step(
    ctx: StepContext,
    q: torch.Tensor,
    latent: torch.Tensor,
    rope_key: torch.Tensor,
    weight: torch.Tensor,
    index_query: torch.Tensor,
    index_key: torch.Tensor,
    weights: torch.Tensor,
    *,
    latent_slot: int,
    rope_slot: int,
    index_slot: int,
    nope_dim: int,
    scale: float,
    index_scale: float,
    k: int,
) -> torch.Tensor:
    """The step's DSA: select (no gradient, as eager's indexer), then absorbed
    MLA over the selected positions only; returns [1, H, n, dv] like the SDPA.
    A step of several branch rows (`StepContext.rows`) runs each row as a
    one-row step, selecting among the prompt's index keys and its own (from
    the arguments, as its latent and rope key)."""
    if ctx.rows > 1:
        slots = ctx.state.slots
        return each_row_as_one_step(
            ctx, sparse_latent_attention_step, (q, latent, rope_key, weight, index_query, index_key, weights),
            (0, slots[latent_slot].batch_dim, slots[rope_slot].batch_dim, None, 0, slots[index_slot].batch_dim, 0),
            latent_slot=latent_slot, rope_slot=rope_slot, index_slot=index_slot, nope_dim=nope_dim, scale=scale,
            index_scale=index_scale, k=k)
    with torch.no_grad():
        selection = select_topk(ctx, index_query, index_key, weights, index_slot, index_scale, k)
    selected = (selection.positions, selection.valid)
    return absorbed_attention(ctx, q, latent, rope_key, weight, latent_slot, rope_slot, nope_dim, scale, selected)
