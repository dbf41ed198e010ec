"""Tiny random HF models for demos and tests: no downloads, seconds on a CPU."""

from __future__ import annotations

import torch
import transformers

_SHAPES = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    initializer_range=0.2,
)

_FAMILIES = {
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
}


def tiny_causal_lm(family: str = "qwen3", *, seed: int = 0, dtype: torch.dtype = torch.float64, **overrides) -> torch.nn.Module:
    """A randomly initialised `*ForCausalLM` of `family` with tiny shapes (GQA 4/2)."""
    if family not in _FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {sorted(_FAMILIES)}")
    config_cls, model_cls = _FAMILIES[family]
    config = config_cls(**{**_SHAPES, **overrides}, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return model_cls(config).to(dtype)
