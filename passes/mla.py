"""Multi-head latent attention (DeepSeek-V3, GLM-5's `glm_moe_dsa`): the
state per position is the normed KV latent and the rope key, not K and V.

HF computes, per layer, a latent `c = kv_a_layernorm(...)` [B, 1, L, r] and a
rope key `k_pe` [B, 1, L, dr] shared over heads, decompresses
`kv_b_proj(c)` into per-head `k_nope` [B, H, L, dn] and `v` [B, H, L, dv],
and calls SDPA on `K = [k_nope | k_pe]`, `V = v`. `mla_of` proves that
structure from the graph (causal SDPA, its K and V, the split, the view and the
`kv_b_proj` linear of one latent, the head expansion of one rope key);
anything else is left to the general attention pass.

The step attends in latent space (absorbed attention): with
`W = kv_b_proj.weight` viewed [H, dn + dv, r], `W_uk = W[:, :dn]`,
`W_uv = W[:, dn:]`,

    scores = scale * ((q_nope W_uk) . c + q_pe . k_pe)
    out    = softmax(scores) c W_uv^T

so earlier positions are never decompressed: r + dr values per position
(512 + 64 at DeepSeek-V3 shapes) instead of H x (dn + dr + dv). That is
multi-query attention of head dim r + dr over one key head, run by the
attention pass's explicit-softmax kernel one key block at a time (under a
DSA selection, over each query's selected positions only, gathered a block
of queries at a time); the kernels are `longstraw/runtime/kernels/
latent_attention.py`, shared with the DSA pass. Gradients
of earlier positions' latent and rope key go to d(state) (exact mode);
`kv_b_proj` gets its gradient from both the query and the output side.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.fx as fx

from longstraw.analysis.mask_bands import band_of
from longstraw.nodes import arg, is_sdpa, op_name, tensor_of
from longstraw.runtime.kernels.latent_attention import absorbed_attention
from longstraw.runtime.prompt_state import StepContext
from longstraw.trace.functionalize import is_updated

from .base import ArchitecturePass, SiteState, StepEmitter, each_row_as_one_step


@dataclasses.dataclass(frozen=True)
class LatentAttention:
    """A proved MLA attention: `latent` [B, 1, L, r] and `rope_key`
    [B, 1, L, dr] (any layout of B x L x features with size-1 dims between)
    are the state; `weight` is `kv_b_proj.weight` [H * (dn + dv), r]."""

    latent: fx.Node
    rope_key: fx.Node
    weight: fx.Node
    heads: int
    nope_dim: int
    value_dim: int
    scale: float


def _identity_source(node: fx.Node) -> fx.Node:
    """Walk up `contiguous`, `clone` and `cat([empty, x])` (HF's cache concatenation)."""
    while True:
        name = op_name(node)
        if name in ("contiguous", "clone"):
            node = node.args[0]
            continue
        if name == "cat":
            parts = [p for p in arg(node, 0, "tensors") if tensor_of(p).numel() > 0 or tensor_of(p).dim() > 1]
            if len(parts) == 1 and tuple(tensor_of(parts[0]).shape) == tuple(tensor_of(node).shape):
                node = parts[0]
                continue
        return node


def _last_dim(node: fx.Node, dim: object) -> bool:
    return dim in (-1, tensor_of(node).dim() - 1)


def _split_part(node: fx.Node) -> tuple[fx.Node, int] | None:
    """(split node, index) if `node` is `split(x, [a, b], dim=-1)[index]`."""
    if op_name(node) != "getitem" or not isinstance(node.args[1], int):
        return None
    split = node.args[0]
    if not isinstance(split, fx.Node) or op_name(split) not in ("split", "split_with_sizes"):
        return None
    sizes, dim = arg(split, 1, "split_size_or_sections", arg(split, 1, "split_sizes")), arg(split, 2, "dim", 0)
    if not isinstance(sizes, (list, tuple)) or len(sizes) != 2 or not _last_dim(split.args[0], dim):
        return None
    return split, node.args[1]


def _key_parts(key: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(nope, rope) when `key` is provably `[nope | rope]` along the last dim:
    `cat((nope, rope), -1)`, or HF's `new_empty` filled by two slice copies
    that together cover it (functionalized to `updated` nodes)."""
    if op_name(key) == "cat":
        parts = arg(key, 0, "tensors")
        if len(parts) == 2 and _last_dim(key, arg(key, 1, "dim", 0)):
            return parts[0], parts[1]
        return None
    width = tensor_of(key).shape[-1]
    writes: dict[tuple[int, int], fx.Node] = {}
    node = key
    while is_updated(node) and node.args[1] == "setitem" and len(writes) < 2:
        index, value = node.args[2], node.args[3]
        span = _last_dim_slice(index, width)
        source = _copied_source(value, node.args[0], index)
        if span is None or source is None or span in writes:
            return None
        writes[span] = source
        node = node.args[0]
    cut = [s for s in writes if s[0] == 0]
    if len(writes) != 2 or not cut or (cut[0][1], width) not in writes:
        return None
    return writes[cut[0]], writes[(cut[0][1], width)]


def _last_dim_slice(index: object, width: int) -> tuple[int, int] | None:
    """[start, stop) if `index` is `(..., slice(start, stop))` with step 1."""
    if not isinstance(index, tuple) or len(index) != 2 or index[0] is not Ellipsis or not isinstance(index[1], slice):
        return None
    s = index[1]
    if s.step not in (None, 1) or not all(v is None or isinstance(v, int) for v in (s.start, s.stop)):
        return None
    start, stop, _ = s.indices(width)
    return (start, stop) if start < stop else None


def _copied_source(value: fx.Node, target: fx.Node, index: object) -> fx.Node | None:
    """`src` if `value` is `target[index].copy_(src)` with `src` of the slice's
    exact shape and dtype (no broadcast, no cast)."""
    if not isinstance(value, fx.Node) or not is_updated(value) or value.args[1] != "copy_" or len(value.args) != 3:
        return None
    view, src = value.args[0], value.args[2]
    if op_name(view) != "getitem" or view.args[0] is not target or view.args[1] != index:
        return None
    if not isinstance(src, fx.Node):
        return None
    a, b = tensor_of(view), tensor_of(src)
    return src if a.shape == b.shape and a.dtype == b.dtype else None


def _causal(node: fx.Node) -> bool:
    """SDPA with `is_causal=True`, or with a positions-only mask proved causal
    (`band_of`: true exactly where the key is not after the query)."""
    mask, is_causal = arg(node, 3, "attn_mask"), arg(node, 5, "is_causal", False)
    if mask is None:
        return bool(is_causal)
    if is_causal or not isinstance(mask, fx.Node):
        return False  # band_of proves nothing of a mask that reads an input
    length = tensor_of(node.args[0]).shape[-2]
    return tuple(tensor_of(mask).shape[-2:]) == (length, length) and band_of(mask) == (0, math.inf)


def mla_of(node: fx.Node) -> LatentAttention | None:
    """The causal latent attention `node` computes, if the graph proves it (module docstring)."""
    found = latent_of(node)
    return found if found is not None and _causal(node) else None  # last: the mask proof walks its construction


def latent_of(node: fx.Node) -> LatentAttention | None:
    """The latent attention structure of `node` whatever its mask (`passes/sparse_index.py`
    proves a top-k selection mask, `mla_of` a causal one)."""
    if not is_sdpa(node):
        return None
    if arg(node, 4, "dropout_p", 0.0) != 0.0 or arg(node, 7, "enable_gqa", False):
        return None
    q, key, value = (tensor_of(a) for a in node.args[:3])
    if q.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return None
    batch, heads, length, qk_dim = q.shape
    if batch == length:  # the latent's batch and position order could not be told apart by shape
        return None
    value_part = _split_part(_identity_source(node.args[2]))
    parts = _key_parts(_identity_source(node.args[1]))
    if value_part is None or value_part[1] != 1 or parts is None:
        return None
    nope_part = _split_part(parts[0])
    split = value_part[0]
    if nope_part is None or nope_part != (split, 0):
        return None
    nope_dim, value_dim = arg(split, 1, "split_size_or_sections", arg(split, 1, "split_sizes"))
    rope_dim = qk_dim - nope_dim
    if rope_dim <= 0 or tuple(key.shape) != (batch, heads, length, qk_dim):
        return None
    if tuple(value.shape) != (batch, heads, length, value_dim):
        return None
    expanded = parts[1]
    if op_name(expanded) != "expand" or tuple(tensor_of(expanded).shape) != (batch, heads, length, rope_dim):
        return None
    rope_key = expanded.args[0]
    if tuple(tensor_of(rope_key).shape) != (batch, 1, length, rope_dim):
        return None
    transposed = split.args[0]
    if op_name(transposed) != "transpose" or {d % 4 for d in transposed.args[1:3]} != {1, 2}:
        return None
    viewed = transposed.args[0]
    viewed_shape = (batch, length, heads, nope_dim + value_dim)
    if op_name(viewed) not in ("view", "reshape") or tuple(tensor_of(viewed).shape) != viewed_shape:
        return None
    linear = viewed.args[0]
    if op_name(linear) != "linear" or arg(linear, 2, "bias") is not None:
        return None
    latent, weight = linear.args[0], linear.args[1]
    c, w = tensor_of(latent), tensor_of(weight)
    rank = c.shape[-1]
    if tuple(w.shape) != (heads * (nope_dim + value_dim), rank):
        return None
    # [B, (1,) L, r] in this order: the view to [B, L, H, dn + dv] reads rows batch-major
    if [d for d in c.shape[:-1] if d != 1] != [d for d in (batch, length) if d != 1]:
        return None
    scale = arg(node, 6, "scale")
    return LatentAttention(
        latent=latent, rope_key=rope_key, weight=weight, heads=heads, nope_dim=nope_dim, value_dim=value_dim,
        scale=1.0 / math.sqrt(qk_dim) if scale is None else float(scale),
    )


class LatentAttentionPass(ArchitecturePass):
    """SDPA proved to be MLA; the latent and the rope key are the state."""

    name = "latent_attention"
    overrides = ("causal_attention",)
    runs_rounds = True  # `round_attention` over `LatentKeys`, the own keys `[latent | rope key]`
    branch_graphs_kept = True  # the backward reads the state before the step only (`latent_attention._keys`)
    branches_batched = True  # `latent_attention_step` runs a batched step's rows one by one over the state

    def claims(self, node: fx.Node) -> bool:
        return mla_of(node) is not None

    def position_dims(self, node: fx.Node) -> tuple[tuple[fx.Node, int], tuple[fx.Node, int]]:
        q = node.args[0]
        return (q, 2), (q, 0)

    def positional_inputs(self, node: fx.Node) -> list[fx.Node]:
        mask = arg(node, 3, "attn_mask")
        return [mask] if isinstance(mask, fx.Node) else []  # proved causal: the step builds its own

    def state_inputs(self, node: fx.Node) -> list[fx.Node]:
        found = mla_of(node)
        return [found.latent, found.rope_key]

    def emit_step(self, emitter: StepEmitter, node: fx.Node, sites: list[SiteState]) -> fx.Node:
        found = mla_of(node)
        latent_site, rope_site = sites
        kwargs = {
            "latent_slot": latent_site.slot,
            "rope_slot": rope_site.slot,
            "nope_dim": found.nope_dim,
            "scale": found.scale,
        }
        args = (emitter.ctx, *emitter.mapped((node.args[0], latent_site.cut, rope_site.cut, found.weight)))
        return emitter.graph.call_function(latent_attention_step, args, kwargs)


def latent_attention_step(
    ctx: StepContext,
    q: torch.Tensor,
    latent: torch.Tensor,
    rope_key: torch.Tensor,
    weight: torch.Tensor,
    *,
    latent_slot: int,
    rope_slot: int,
    nope_dim: int,
    scale: float,
) -> torch.Tensor:
    """Absorbed causal attention of the step's queries `q` [1, H, n, dn + dr]
    over positions `[0, o + n)` of the latent and the rope key; returns
    [1, H, n, dv] like the SDPA it replaces. A step of several branch rows
    (`StepContext.rows`, `q` [rows, H, n, dn + dr]) runs each row as a
    one-row step: a row's own latent and rope key come from the arguments,
    never from the state's buffers (`latent_attention._keys`), so the rows
    share the prompt's state and nothing else; the layer's other operators
    ran on all rows at once."""
    if ctx.rows > 1:
        slots = ctx.state.slots
        return each_row_as_one_step(ctx, latent_attention_step, (q, latent, rope_key, weight),
                                    (0, slots[latent_slot].batch_dim, slots[rope_slot].batch_dim, None),
                                    latent_slot=latent_slot, rope_slot=rope_slot, nope_dim=nope_dim, scale=scale)
    return absorbed_attention(ctx, q, latent, rope_key, weight, latent_slot, rope_slot, nope_dim, scale)
