"""Qwen3.5 / Qwen3.6, their MoE models, Qwen3-Next and OLMo Hybrid
(transformers `qwen3_5`, `qwen3_5_moe`, `qwen3_next`, `olmo_hybrid`): route
the linear-attention layers to LongStraw's registered operators.

HF's Gated DeltaNet layer calls two module-level functions: a causal
depthwise convolution and a chunked gated delta rule written as a Python
loop over 64-token chunks (which Dynamo would unroll, growing the graph
with the prompt). `bind()` points both at `longstraw::causal_conv1d` and
`longstraw::gated_delta_rule`, which Dynamo records as one node each and
the architecture passes run chunk by chunk from carried state. The model
code itself is unchanged; eager results are the same up to float32
rounding (both implementations compute the rule in float32).

Compiled losses need no call: importing longstraw substitutes the drop-ins
for HF's functions in every Dynamo trace (`substitute_in_traces`, see
`longstraw.models`). `bind()` routes eager calls as well:

    from longstraw.models import qwen3_5
    qwen3_5.bind()                 # for the rest of the process
    with qwen3_5.bound(): ...      # or for a block
    with qwen3_5.unbound(): ...    # HF's own functions, eager and traced
"""

from __future__ import annotations

import contextlib
import inspect
import types
from typing import Callable, Iterator

import torch

from longstraw.passes.causal_conv import causal_conv1d
from longstraw.passes.gated_delta import gated_delta_rule

_MODULES = (
    "transformers.models.qwen3_5.modeling_qwen3_5",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
    "transformers.models.qwen3_next.modeling_qwen3_next",
    "transformers.models.olmo_hybrid.modeling_olmo_hybrid",
)
"""HF modeling modules whose Gated DeltaNet layer calls these two functions by these names."""


def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
    """Drop-in for HF's `causal_conv1d_fn` (no varlen `seq_idx`)."""
    if kwargs.get("seq_idx") is not None:
        raise NotImplementedError("longstraw's causal_conv1d does not support packed sequences (seq_idx)")
    return causal_conv1d(hidden_states, weight, bias, activation)


def chunk_gated_delta_rule(
    query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, **kwargs,
):
    """Drop-in for HF's `torch_chunk_gated_delta_rule` (no varlen `cu_seqlens`)."""
    if kwargs.get("cu_seqlens") is not None:
        raise NotImplementedError("longstraw's gated_delta_rule does not support packed sequences (cu_seqlens)")
    out, state = gated_delta_rule(query, key, value, g, beta, initial_state, use_qk_l2norm_in_kernel)
    return out, state if output_final_state else None


_BINDINGS = {"causal_conv1d_fn": causal_conv1d_fn, "torch_chunk_gated_delta_rule": chunk_gated_delta_rule}
_ORIGINALS: dict[tuple[str, str], object] = {}
_SUBSTITUTED: set[tuple[str, str]] = set()
_TRACE_HF = False  # inside `unbound()`: traces run HF's own functions


def substitute_in_traces(module: types.ModuleType) -> None:
    """Make Dynamo trace the drop-ins wherever HF's modeling `module` calls
    its functions (once per process; eager calls are untouched)."""
    for attr, drop_in in _BINDINGS.items():
        original = _ORIGINALS.setdefault((module.__name__, attr), getattr(module, attr))
        if (module.__name__, attr) in _SUBSTITUTED:
            continue
        torch.compiler.substitute_in_graph(original, skip_signature_check=True)(_traced(drop_in, inspect.unwrap(original)))
        _SUBSTITUTED.add((module.__name__, attr))


def _traced(drop_in: Callable, hf_function: Callable) -> Callable:
    """What Dynamo traces for one bound function: the drop-in, or inside
    `unbound()` HF's own PyTorch function (unwrapped from HF's kernel
    dispatch, which calling would substitute again)."""

    def traced(*args, **kwargs):
        if _TRACE_HF:
            return hf_function(*args, **kwargs)
        return drop_in(*args, **kwargs)

    return traced


def bind() -> dict[tuple[object, str], object]:
    """Route HF Qwen3.5 and Qwen3-Next layers to the registered operators;
    returns what was replaced, for `unbind`."""
    import importlib

    replaced: dict[tuple[object, str], object] = {}
    for name in _MODULES:
        module = importlib.import_module(name)
        for attr, fn in _BINDINGS.items():
            _ORIGINALS.setdefault((name, attr), getattr(module, attr))
            replaced[(module, attr)] = getattr(module, attr)
            setattr(module, attr, fn)
    return replaced


def unbind(replaced: dict[tuple[object, str], object]) -> None:
    for (module, attr), original in replaced.items():
        setattr(module, attr, original)


@contextlib.contextmanager
def bound() -> Iterator[None]:
    replaced = bind()
    try:
        yield
    finally:
        unbind(replaced)


@contextlib.contextmanager
def unbound() -> Iterator[None]:
    """HF's own kernels for a block, eager and traced, whatever is bound outside it."""
    import importlib

    global _TRACE_HF

    saved = {}
    for name in _MODULES:
        module = importlib.import_module(name)
        for attr in _BINDINGS:
            saved[(module, attr)] = getattr(module, attr)
            setattr(module, attr, _ORIGINALS.setdefault((name, attr), getattr(module, attr)))
    tracing_hf, _TRACE_HF = _TRACE_HF, True
    try:
        yield
    finally:
        _TRACE_HF = tracing_hf
        unbind(saved)


def tiny_config(**overrides) -> "transformers.Qwen3_5TextConfig":  # noqa: F821
    """A tiny Qwen3.5 text config: linear and full attention layers, partial
    rotary, GQA, several value heads per key head."""
    import transformers

    fields = dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, partial_rotary_factor=0.5,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, max_position_embeddings=1024, initializer_range=0.2,
    )
    fields.update(overrides)
    return transformers.Qwen3_5TextConfig(**fields)


__all__ = [
    "bind", "bound", "causal_conv1d_fn", "chunk_gated_delta_rule", "substitute_in_traces", "tiny_config", "unbind", "unbound",
]
