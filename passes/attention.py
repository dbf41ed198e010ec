"""Full causal attention: SDPA with `is_causal=True` or an explicit mask
computed from positions, with or without GQA.

State per layer: K and V at prompt positions, captured after RoPE and before
any head repetition (`repeat_kv`), which the step folds into SDPA's
`enable_gqa`. A step with queries at positions `[o, o+n)` attends to the
buffer view `[0, o+n)` with a lower-right causal bias, so no
`n x (o+n)` mask is materialised on backends that support the bias. An
explicit mask is rebuilt by the step for its rows and visible columns (see
`StepEmitter.query_key_block`); that block is materialised.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from torch.utils._python_dispatch import _disable_current_modes

from longstraw.carry import recompute_grads
from longstraw.nodes import ancestors, arg, is_sdpa, op_name, tensor_of
from longstraw.state import StepContext

from .base import ArchitecturePass, Candidate, SiteState, StepEmitter


class CausalAttentionPass(ArchitecturePass):
    name = "causal_attention"

    def claims(self, node: fx.Node) -> bool:
        return is_sdpa(node)

    def position_dims(self, node: fx.Node) -> tuple[tuple[fx.Node, int], tuple[fx.Node, int]]:
        q = node.args[0]
        return (q, tensor_of(q).dim() - 2), (q, 0)

    def state_inputs(self, node: fx.Node) -> list[fx.Node]:
        return [node.args[1], node.args[2]]

    def positional_inputs(self, node: fx.Node) -> list[fx.Node]:
        mask = arg(node, 3, "attn_mask")
        return [mask] if isinstance(mask, fx.Node) else []

    def unsupported_reason(self, node: fx.Node) -> str | None:
        mask = arg(node, 3, "attn_mask")
        if mask is not None:
            if not isinstance(mask, fx.Node) or tensor_of(mask).dim() < 2:
                return "attn_mask must be a tensor of at least [queries, keys]"
            if any(n.op == "placeholder" for n in ancestors([mask])):
                return (
                    "the attn_mask depends on inputs (e.g. a padding mask); only masks computed from "
                    "positions are supported: pad responses at the end and mask the loss instead"
                )
            if _sees_the_future(mask):
                return (
                    "the attn_mask lets a position attend to later positions (e.g. a prefix-LM mask), "
                    "so earlier positions cannot be computed before later ones"
                )
        elif not arg(node, 5, "is_causal", False):
            return "non-causal SDPA lets earlier positions see later ones, so the prompt cannot be captured once"
        dropout = arg(node, 4, "dropout_p", 0.0)
        if dropout != 0.0:
            return f"attention dropout (dropout_p={dropout}) is not replayed yet; put the model in eval mode or set attention_dropout=0"
        if tensor_of(node.args[0]).dim() != 4:
            return "SDPA query must be [batch, heads, positions, head_dim]"
        return None

    def candidates(self, node: fx.Node, state_input: fx.Node) -> list[Candidate]:
        """Walk up from the key/value input through ops the step can absorb:
        identities (contiguous, clone, `cat([empty, k])`) and head repetition."""
        out = [Candidate(state_input, 1)]
        current, repeat = state_input, 1
        while True:
            parent, factor = _absorbable(current)
            if parent is None:
                return out
            current, repeat = parent, repeat * factor
            out.append(Candidate(current, repeat))

    def emit_step(self, emitter: StepEmitter, node: fx.Node, sites: list[SiteState]) -> fx.Node:
        k_site, v_site = sites
        q = node.args[0]
        mask = arg(node, 3, "attn_mask")
        kwargs = dict(
            mask=emitter.query_key_block(mask) if mask is not None else None,
            k_slot=k_site.slot,
            v_slot=v_site.slot,
            scale=arg(node, 6, "scale"),
            enable_gqa=bool(arg(node, 7, "enable_gqa", False)) or k_site.transform > 1 or v_site.transform > 1,
        )
        args = (emitter.ctx, *emitter.mapped((q, k_site.cut, v_site.cut)))
        return emitter.graph.call_function(attention_step, args, kwargs)


def _absorbable(node: fx.Node) -> tuple[fx.Node | None, int]:
    """(input, head repeat factor) if `node` is an op the attention step absorbs."""
    name = op_name(node)
    if name in ("contiguous", "clone"):
        return node.args[0], 1
    if name == "cat":
        parts = [p for p in arg(node, 0, "tensors") if tensor_of(p).numel() > 0 or tensor_of(p).dim() > 1]
        if len(parts) == 1 and tensor_of(parts[0]).shape == tensor_of(node).shape:
            return parts[0], 1
        return None, 1
    if name == "repeat_interleave":
        repeats, dim = arg(node, 1, "repeats"), arg(node, 2, "dim")
        if isinstance(repeats, int) and dim in (1, -3) and tensor_of(node).dim() == 4:
            return node.args[0], repeats
        return None, 1
    if name in ("reshape", "view"):
        # repeat_kv: x[:, :, None].expand(b, h, r, l, d).reshape(b, h * r, l, d)
        src = node.args[0]
        if op_name(src) != "expand" or tensor_of(node).dim() != 4 or tensor_of(src).dim() != 5:
            return None, 1
        inner = src.args[0]
        b, h, r, l, d = tensor_of(src).shape
        if tuple(tensor_of(inner).shape) != (b, h, 1, l, d) or tuple(tensor_of(node).shape) != (b, h * r, l, d):
            return None, 1
        base = _unsqueezed_from(inner)
        if base is None:
            return None, 1
        return base, r
    return None, 1


MASK_CHECK_MAX_POSITIONS = 4096


def _sees_the_future(mask: fx.Node) -> bool:
    """Evaluate a positions-only mask (it reads no input) and check that no
    query attends to a later key. Masks over more positions than
    MASK_CHECK_MAX_POSITIONS are not evaluated (the check would cost L^2)."""
    value = tensor_of(mask)
    rows, cols = value.shape[-2], value.shape[-1]
    if max(rows, cols) > MASK_CHECK_MAX_POSITIONS or value.device.type == "meta":
        return False
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    needed = ancestors([mask])
    for node in mask.graph.nodes:
        if node in needed:
            env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(env[mask])
    with torch.no_grad():
        block = fx.GraphModule(torch.nn.Module(), graph)()
    later = torch.ones(rows, cols, dtype=torch.bool, device=block.device).triu(cols - rows + 1)
    allowed = block if block.dtype == torch.bool else block > float("-inf")
    return bool((allowed & later).any())


def _unsqueezed_from(node: fx.Node) -> fx.Node | None:
    """The 4-D tensor `x` if `node` is `x.unsqueeze(2)` or `x[:, :, None]`."""
    name = op_name(node)
    if name == "unsqueeze" and arg(node, 1, "dim") in (2, -3):
        return node.args[0]
    if node.target is operator.getitem and isinstance(node.args[1], tuple):
        index = node.args[1]
        full = slice(None, None, None)
        if index[:3] == (full, full, None) and all(i == full or i is Ellipsis for i in index[3:]):
            return node.args[0]
    return None


def attention_step(
    ctx: StepContext,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None,
    k_slot: int,
    v_slot: int,
    scale: float | None,
    enable_gqa: bool,
) -> torch.Tensor:
    """Attention of the step's queries over all positions so far.

    q: [1, Hq, n, D]; k, v: [1, Hkv, n, D] (the step's own positions, already
    written to the state buffers by `write_state`); mask: None (causal) or
    the mask block [..., n, o+n]."""
    return _AttentionOverState.apply(ctx, q, k, v, mask, k_slot, v_slot, scale, enable_gqa)


def _attend(q, keys, values, mask, scale, enable_gqa) -> torch.Tensor:
    n, total = q.shape[-2], keys.shape[-2]
    if mask is None and n == total:
        return F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=enable_gqa)
    if mask is None:
        mask = _lower_right_causal(n, total, q.device)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)


def _lower_right_causal(n: int, total: int, device: torch.device):
    """Queries at the last n of `total` positions. On CUDA the bias object
    selects kernels that apply it without materialising a mask; elsewhere
    SDPA would materialise it anyway, so build the boolean block directly."""
    if device.type == "cuda":
        # the bias is a tensor subclass, which cannot be created under a
        # dispatch mode (memory or FLOP counters); SDPA itself still runs under it
        with _disable_current_modes():
            return causal_lower_right(n, total)
    return torch.ones(n, total, dtype=torch.bool, device=device).tril(total - n)


class _AttentionOverState(torch.autograd.Function):
    """Attention whose keys/values before the step live in the state buffers.

    Only q and the step's own k/v are saved; the buffers are read by
    reference, so replaying a branch never copies the prompt state. Backward
    recomputes attention over `[0, o+n)`, returns the gradient of the step's
    positions and adds the rest to d(state) (exact mode)."""

    @staticmethod
    def forward(ctx, step: StepContext, q, k, v, mask, k_slot, v_slot, scale, enable_gqa):
        ctx.step, ctx.slots, ctx.scale, ctx.enable_gqa = step, (k_slot, v_slot), scale, enable_gqa
        ctx.save_for_backward(q, k, v, mask)
        return _attend(q, step.visible(k_slot), step.visible(v_slot), mask, scale, enable_gqa)

    @staticmethod
    def backward(ctx, grad_out):
        step: StepContext = ctx.step
        k_slot, v_slot = ctx.slots
        q, k, v, mask = ctx.saved_tensors
        step.write(k_slot, k)
        step.write(v_slot, v)
        grad_q, grad_keys, grad_values = recompute_grads(
            lambda q, keys, values: (_attend(q, keys, values, mask, ctx.scale, ctx.enable_gqa),),
            [q, step.visible(k_slot), step.visible(v_slot)],
            [grad_out],
            [True, True, True],
        )
        # when k and v are one slot, both land in the same d(state) and sum there
        step.accumulate_grad(k_slot, grad_keys)
        step.accumulate_grad(v_slot, grad_values)
        o, n = step.offset, step.length
        return None, grad_q, grad_keys.narrow(-2, o, n), grad_values.narrow(-2, o, n), None, None, None, None, None
