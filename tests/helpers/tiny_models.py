"""Tiny deterministic float64 models and GRPO groups for the tests.

No downloads: HF models are built from a config with random weights.
"""

from __future__ import annotations

import torch
import transformers
from torch import nn

from longstraw.models import qwen3_5
from longstraw.models.tiny import tiny_causal_lm

from helpers.families import _MLA
from helpers.plain_transformer import make_plain

VOCAB = 64

# kind -> PlainConfig overrides
PLAIN_KINDS = {
    "plain": {},  # GQA 4/2 via SDPA(enable_gqa=True), hand-written RMSNorm
    "plain_repeat": {"kv_mode": "repeat"},  # HF-style repeat_kv before SDPA
    "plain_repeat_interleave": {"kv_mode": "repeat_interleave"},
    "plain_explicit_mask": {"mask": "explicit"},  # bool tril mask, is_causal=False
    "plain_window_mask": {"mask": "window"},  # bool sliding-window mask: not plain causal
    "plain_mha_layernorm": {"num_kv_heads": 4, "norm": "layer"},
}
HF_KINDS = ("qwen3", "llama", "llama_tied")
KINDS = (*PLAIN_KINDS, *HF_KINDS)


def is_hf(kind: str) -> bool:
    return kind in HF_KINDS


def parity_tol(kind: str) -> float:
    """Relative tolerance for compiled-vs-eager in float64. HF norms and RoPE
    round through float32, so HF models only get ~1e-7."""
    return 1e-6 if is_hf(kind) else 1e-9


# Smaller than longstraw.models.tiny's defaults so the parity sweeps stay fast.
_HF_SHAPES = dict(hidden_size=32, intermediate_size=48, head_dim=8, max_position_embeddings=1024)


def make_qwen3(seed: int = 0, vocab_size: int = VOCAB) -> nn.Module:
    return tiny_causal_lm("qwen3", seed=seed, vocab_size=vocab_size, **_HF_SHAPES)


def make_llama(seed: int = 0, vocab_size: int = VOCAB, tie_word_embeddings: bool = False) -> nn.Module:
    return tiny_causal_lm(
        "llama", seed=seed, vocab_size=vocab_size, tie_word_embeddings=tie_word_embeddings, **_HF_SHAPES
    )


def make_model(kind: str, seed: int = 0, vocab_size: int = VOCAB) -> nn.Module:
    if kind in PLAIN_KINDS:
        return make_plain(seed=seed, vocab_size=vocab_size, **PLAIN_KINDS[kind])
    if kind == "qwen3":
        return make_qwen3(seed, vocab_size)
    if kind == "llama":
        return make_llama(seed, vocab_size)
    if kind == "llama_tied":
        return make_llama(seed, vocab_size, tie_word_embeddings=True)
    raise ValueError(f"unknown model kind {kind!r}")


def make_group(G: int, P: int, R: int, vocab: int = VOCAB, pad: bool = False, seed: int = 0):
    """One GRPO group: prompt [P] long, responses [G, R] long, advantages [G]
    float64, mask [G, R] float64.

    pad=True: ragged completion lengths in [1, R], zeros at the end of the
    mask rows (row 0 is always full length, at least one other row is cut when
    G > 1 and R > 1); the padded token ids stay random, as a trainer's pad
    id would be arbitrary.
    """
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (P,), generator=gen)
    responses = torch.randint(0, vocab, (G, R), generator=gen)
    advantages = torch.randn(G, generator=gen, dtype=torch.float64)
    mask = torch.ones(G, R, dtype=torch.float64)
    if pad and R > 1:
        lengths = torch.randint(1, R + 1, (G,), generator=gen)
        lengths[0] = R
        if G > 1:
            lengths[1] = min(int(lengths[1]), R - 1)
        mask = (torch.arange(R)[None, :] < lengths[:, None]).to(torch.float64)
    return prompt, responses, advantages, mask


def make_lora_qwen3(seed: int = 0, vocab_size: int = VOCAB) -> nn.Module:
    """Tiny Qwen3 wrapped by peft LoRA on q/k/v/o (base weights frozen).

    `init_lora_weights=False` draws B at random too: with the default B = 0
    the gradient of every lora_A is exactly zero and would prove nothing.
    """
    import peft

    base = make_qwen3(seed, vocab_size)
    torch.manual_seed(seed + 1)
    cfg = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        init_lora_weights=False,
    )
    return peft.get_peft_model(base, cfg)


def freeze_all_but_qkv_and_head(model: nn.Module) -> list[str]:
    """requires_grad_(False) on everything except attention q/k/v
    projections and the LM head; returns the names left trainable."""
    keep = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "lm_head.weight")
    kept = []
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith(keep))
        if p.requires_grad:
            kept.append(name)
    return kept


def make_qwen3_5(seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny float64 Qwen3.5 hybrid (`qwen3_5.tiny_config` with `overrides`)."""
    torch.manual_seed(seed)
    return transformers.Qwen3_5ForCausalLM(qwen3_5.tiny_config(**overrides)).double()


def make_deepseek_v3(experts: bool = False, seed: int = 0, **overrides) -> nn.Module:
    """Tiny DeepSeek-V3 in float64: two dense layers, or one dense and one MoE
    layer (HF's `batched_mm` experts: the eager loop is a graph break)."""
    config = transformers.DeepseekV3Config(**{**_MLA, "first_k_dense_replace": 1 if experts else 2, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    if experts:
        model.set_experts_implementation("batched_mm")
    return model.double().eval()


GLM5 = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=4, q_lora_rank=12, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
    moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, index_head_dim=8, index_n_heads=8,
    index_topk=8, max_position_embeddings=256, initializer_range=0.2,
)


def make_glm5(experts: bool = True, seed: int = 0, **overrides) -> torch.nn.Module:
    """Tiny GLM-5 in float64: a dense and a MoE layer (HF's `batched_mm`
    experts: the eager loop is a graph break), or two dense layers."""
    layers = ["dense", "sparse"] if experts else ["dense", "dense"]
    config = transformers.GlmMoeDsaConfig(**{**GLM5, "mlp_layer_types": layers, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    if experts:
        model.set_experts_implementation("batched_mm")
    return model.double().eval()


def make_mistral(window: int, layers: int = 2) -> torch.nn.Module:
    config = transformers.MistralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=window, max_position_embeddings=256,
    )
    torch.manual_seed(0)
    return transformers.MistralForCausalLM(config).double()
