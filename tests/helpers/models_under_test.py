"""HF decoders with shapes drawn by the fuzz tests."""

from __future__ import annotations

import torch

from longstraw.models.tiny import tiny_causal_lm


def hf_decoder(family: str, layers: int, kv_heads: int, heads: int, head_dim: int, tied: bool) -> torch.nn.Module:
    return tiny_causal_lm(
        family, num_hidden_layers=layers, num_key_value_heads=kv_heads, num_attention_heads=heads, head_dim=head_dim,
        hidden_size=16, intermediate_size=24, vocab_size=64, tie_word_embeddings=tied, max_position_embeddings=1024,
    )
