"""HF mixture-of-experts layers: the experts computation as one operator.

HF's `grouped_mm` experts (the default implementation) sort all token rows
of a call by expert, multiply in groups sized by `histc` and un-permute: as
a whole each token's output row depends only on its own hidden row, its own
routing row and the expert weights, but no per-operator rule can prove it
(`sort` mixes the token axis). `longstraw::moe_experts` is that whole
computation as one operator, run by HF's own function inside (so it matches
eager bit for bit), with a per-position dimension rule (`dims._moe_experts`).

Importing longstraw substitutes the operator for `grouped_mm_experts_forward`
in every Dynamo trace (`substitute_in_traces`, see `longstraw.models`), for
experts modules it covers: not expert-parallel, no post-expert norm, HF's
default gate, and the activation class `config.hidden_act` names (one HF
never builds with arguments, so its type tells what it computes). Any other module traces
HF's function as it is, which LongStraw refuses at its `sort` with the fix.
Eager calls are untouched.
"""

from __future__ import annotations

import functools
import types

import torch
from torch.utils.flop_counter import register_flop_formula

from longstraw.runtime.carry import recompute_grads

_SUBSTITUTED: set[str] = set()


@functools.cache
def _activation(name: str) -> torch.nn.Module:
    from transformers.activations import ACT2FN

    return ACT2FN[name]


class _Experts:
    """The attributes HF's `grouped_mm_experts_forward` reads from its module,
    built from the operator's arguments alone (no module identity in the graph)."""

    _is_expert_parallel = False
    has_post_expert_norm = False

    def __init__(self, up_proj, down_proj, up_proj_bias, down_proj_bias, has_gate: bool, is_transposed: bool, activation: str):
        from transformers.integrations.moe import _default_apply_gate

        self.num_experts = up_proj.shape[0]
        self.has_gate, self.has_bias, self.is_transposed = has_gate, up_proj_bias is not None, is_transposed
        prefix = "gate_up_proj" if has_gate else "up_proj"
        setattr(self, prefix, up_proj)
        setattr(self, f"{prefix}_bias", up_proj_bias)
        self.down_proj, self.down_proj_bias = down_proj, down_proj_bias
        self.act_fn = _activation(activation)
        self._apply_gate = types.MethodType(_default_apply_gate, self)


def _grouped_mm(hidden_states, top_k_index, top_k_weights, up_proj, down_proj, up_proj_bias, down_proj_bias,
                has_gate, is_transposed, activation):
    from transformers.integrations.moe import grouped_mm_experts_forward

    experts = _Experts(up_proj, down_proj, up_proj_bias, down_proj_bias, has_gate, is_transposed, activation)
    return grouped_mm_experts_forward(experts, hidden_states, top_k_index, top_k_weights)


@torch.library.custom_op("longstraw::moe_experts", mutates_args=())
def moe_experts(
    hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
    up_proj: torch.Tensor, down_proj: torch.Tensor, up_proj_bias: torch.Tensor | None, down_proj_bias: torch.Tensor | None,
    has_gate: bool, is_transposed: bool, activation: str,
) -> torch.Tensor:
    """HF's grouped_mm experts: hidden_states [T, H], top_k_index and
    top_k_weights [T, k], stacked expert weights; returns [T, H]."""
    return _grouped_mm(hidden_states, top_k_index, top_k_weights, up_proj, down_proj, up_proj_bias, down_proj_bias,
                       has_gate, is_transposed, activation)


@moe_experts.register_fake
def _(hidden_states, top_k_index, top_k_weights, up_proj, down_proj, up_proj_bias, down_proj_bias,
      has_gate, is_transposed, activation):
    return hidden_states.new_empty(hidden_states.shape)  # HF's sum over k: contiguous


@register_flop_formula(torch.ops.longstraw.moe_experts)
def _moe_experts_flops(hidden_shape, index_shape, weights_shape, up_shape, down_shape, *args, out_shape=None) -> int:
    """Each routed token through its expert's up (gated: and gate) and down projections."""
    tokens_times_k = index_shape[0] * index_shape[1]
    return 2 * tokens_times_k * (up_shape[1] * up_shape[2] + down_shape[1] * down_shape[2])


def _setup(ctx, inputs, output):
    ctx.static = inputs[7:]
    ctx.save_for_backward(*inputs[:7])


def _backward(ctx, grad_out):
    """Recompute under autograd: HF's own backward, so gradients are eager's."""
    wanted = list(ctx.needs_input_grad[:7])
    wanted[1] = False  # expert ids
    grads = recompute_grads(lambda *tensors: [_grouped_mm(*tensors, *ctx.static)], ctx.saved_tensors, [grad_out], wanted)
    return (*grads, None, None, None)


moe_experts.register_autograd(_backward, setup_context=_setup)


def _covered(experts: torch.nn.Module) -> bool:
    """Whether `moe_experts` computes what HF's grouped_mm computes for this
    module: the attributes it does not take are HF's defaults."""
    from transformers.activations import ACT2CLS
    from transformers.integrations.moe import _default_apply_gate

    activation = getattr(getattr(experts, "config", None), "hidden_act", None)
    act_class = ACT2CLS.get(activation) if isinstance(activation, str) else None
    # A class some entry builds with arguments (`(cls, kwargs)`) is not told apart by its type.
    with_arguments = any(isinstance(entry, tuple) and entry[0] is act_class for entry in ACT2CLS.values())
    return (
        not with_arguments
        and not experts._is_expert_parallel
        and not experts.has_post_expert_norm
        and experts._apply_gate.__func__ is _default_apply_gate
        and isinstance(act_class, type)
        and type(experts.act_fn) is act_class
    )


def substitute_in_traces(module: types.ModuleType) -> None:
    """Make Dynamo trace `moe_experts` wherever HF's `transformers.integrations.moe`
    `module` runs its grouped_mm experts (once per process)."""
    if module.__name__ in _SUBSTITUTED:
        return
    hf = module.grouped_mm_experts_forward
    # A copy with its own identity: what uncovered modules trace, not substituted again.
    hf_traced = types.FunctionType(hf.__code__, hf.__globals__, hf.__name__, hf.__defaults__, hf.__closure__)

    def traced(self, hidden_states, top_k_index, top_k_weights):
        if not _covered(self):
            return hf_traced(self, hidden_states, top_k_index, top_k_weights)
        prefix = "gate_up_proj" if self.has_gate else "up_proj"
        return moe_experts(
            hidden_states, top_k_index, top_k_weights, getattr(self, prefix), self.down_proj,
            getattr(self, f"{prefix}_bias") if self.has_bias else None, self.down_proj_bias if self.has_bias else None,
            self.has_gate, self.is_transposed, self.config.hidden_act,
        )

    torch.compiler.substitute_in_graph(hf, skip_signature_check=True)(traced)
    _SUBSTITUTED.add(module.__name__)


__all__ = ["moe_experts", "substitute_in_traces"]
