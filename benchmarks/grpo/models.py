"""The benchmarked models (the dense, hybrid, GLM-5, Qwen3.5-MoE and Nemotron-H slices), the GRPO loss and a group of inputs."""

from __future__ import annotations

import dataclasses

import torch
import transformers

from longstraw.models import qwen3_5


def dense_config(tiny: bool) -> transformers.PretrainedConfig:
    if tiny:
        shapes = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256}
    else:
        shapes = {"hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936}
    return transformers.Qwen3Config(num_hidden_layers=4, max_position_embeddings=1 << 22, **shapes)


def hybrid_config(tiny: bool) -> transformers.PretrainedConfig:
    layers = ["linear_attention"] * 3 + ["full_attention"]
    if tiny:
        return qwen3_5.tiny_config(layer_types=layers, max_position_embeddings=1 << 22)
    return transformers.Qwen3_5TextConfig(num_hidden_layers=4, layer_types=layers, max_position_embeddings=1 << 22)


GLM5_MLP_LAYERS = ["dense", "sparse", "sparse", "sparse"]
GLM5_ROUTED_EXPERTS = 16


def glm5_config(tiny: bool) -> transformers.PretrainedConfig:
    """GLM-5's layer shapes are transformers' GlmMoeDsaConfig defaults
    (hidden 6144, 64 heads, MLA q/kv ranks 2048/512, rope 64, nope 192, v
    256, DSA indexer 32 heads of 128 selecting the top 2048 keys, 8 routed
    experts per token of 2048 and one shared expert, vocabulary 154,880).
    The slice keeps them and cuts what only sets the size: 4 layers (one
    dense, then MoE) and 16 routed experts, so weights and gradients fit
    one H200 while each token's work is GLM-5's. Tiny: one dense and one
    MoE layer (each compiled layer costs CPU test time)."""
    layers = GLM5_MLP_LAYERS[:2] if tiny else GLM5_MLP_LAYERS
    if tiny:
        shapes = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
                  "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 24, "kv_lora_rank": 32,
                  "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "num_experts_per_tok": 2,
                  "n_routed_experts": 4, "index_n_heads": 16, "index_head_dim": 16, "index_topk": 16}
    else:
        shapes = {"n_routed_experts": GLM5_ROUTED_EXPERTS}
    return transformers.GlmMoeDsaConfig(num_hidden_layers=len(layers), mlp_layer_types=layers,
                                        max_position_embeddings=1 << 22, **shapes)


def hybrid_moe_config(tiny: bool) -> transformers.PretrainedConfig:
    """Qwen3.5-MoE's layer shapes (`Qwen3_5MoeTextConfig`'s defaults, 35B-A3B:
    hidden 2048, 256 experts of 512 with 8 per token and a shared one, Gated
    DeltaNet and gated attention), 4 layers: three Gated DeltaNet, one full
    attention."""
    layers = ["linear_attention"] * 3 + ["full_attention"]
    if tiny:
        shapes = {"vocab_size": 256, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                  "linear_value_head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
                  "initializer_range": 0.2}  # at 0.02 the router's top-k has near-ties that flip between dtypes
    else:
        shapes = {}
    return transformers.Qwen3_5MoeTextConfig(num_hidden_layers=4, layer_types=layers, max_position_embeddings=1 << 22,
                                             **shapes)


NEMOTRON_H_LAYERS = ["linear_attention", "mlp", "linear_attention", "full_attention"]
"""Nemotron-H's pattern `M-M*` (Mamba-2, MLP, Mamba-2, attention): its 8B model repeats `M-` and `M*` groups."""


def nemotron_h_config(tiny: bool) -> transformers.PretrainedConfig:
    """Nemotron-H-8B's layer shapes (hidden 4096, FFN 21504, 32 query and 8
    key-value heads of 128, 128 Mamba-2 heads of 64 with 8 groups of state
    128), 4 layers (`NEMOTRON_H_LAYERS`). Its Mamba-2 scan runs transformers'
    PyTorch path in the eager modes (mamba-ssm is not installed)."""
    if tiny:
        shapes = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 16, "mamba_num_heads": 4, "mamba_head_dim": 16,
                  "ssm_state_size": 16, "n_groups": 2, "chunk_size": 16}
    else:
        shapes = {"vocab_size": 131072, "hidden_size": 4096, "intermediate_size": 21504, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "head_dim": 128, "mamba_num_heads": 128, "mamba_head_dim": 64,
                  "ssm_state_size": 128, "n_groups": 8}
    return transformers.NemotronHConfig(num_hidden_layers=len(NEMOTRON_H_LAYERS), layers_block_type=NEMOTRON_H_LAYERS,
                                        conv_kernel=4, use_mamba_kernels=False, max_position_embeddings=1 << 22,
                                        **shapes)


MODEL_CLASSES = {
    "dense": (dense_config, transformers.Qwen3ForCausalLM),
    "hybrid": (hybrid_config, transformers.Qwen3_5ForCausalLM),
    "glm5": (glm5_config, transformers.GlmMoeDsaForCausalLM),
    "hybrid_moe": (hybrid_moe_config, transformers.Qwen3_5MoeForCausalLM),
    "nemotron_h": (nemotron_h_config, transformers.NemotronHForCausalLM),
}
RECURRENT_KINDS = ("hybrid", "hybrid_moe", "nemotron_h")
"""Slices with layers that carry a recurrent state: prefix-grouper's packed row is not exact on them."""
MOE_KINDS = ("glm5", "hybrid_moe")


def build_model(kind: str, tiny: bool, dtype: torch.dtype, device: torch.device) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    make_config, cls = MODEL_CLASSES[kind]
    with torch.device(device):
        model = cls(make_config(tiny)).to(dtype)
    if kind == "glm5":
        model.set_attn_implementation("sdpa")
    if kind in MOE_KINDS:
        # batched_mm copies an expert's weights per routed token (50 MB each at GLM-5 shapes);
        # grouped_mm runs as LongStraw's `moe_experts` operator (docs/design.md, "Mixture of experts")
        model.set_experts_implementation("grouped_mm")
    model.train()  # attention dropout is 0; train() is what checkpointing needs
    return model


def grpo_loss(model, input_ids, advantages, completion_mask, logits_to_keep: int):
    """TRL's GRPO loss at one policy step (ratio 1, no KL), per-token mean."""
    logits = model(input_ids=input_ids, logits_to_keep=logits_to_keep + 1).logits[:, :-1].float()
    completion = input_ids[:, -logits_to_keep:]
    logp = logits.gather(-1, completion.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
    return policy_loss(logp, advantages, completion_mask)


def policy_loss(logp, advantages, completion_mask):
    ratio = torch.exp(logp - logp.detach())
    return -((ratio * advantages[:, None]) * completion_mask).sum() / completion_mask.sum()


@dataclasses.dataclass
class Group:
    prompt: torch.Tensor  # [P]
    responses: torch.Tensor  # [G, R]
    advantages: torch.Tensor  # [G]
    mask: torch.Tensor  # [G, R]

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt.expand(self.responses.shape[0], -1), self.responses], 1)


def make_group(G: int, P: int, R: int, vocab: int, device: torch.device) -> Group:
    gen = torch.Generator().manual_seed(P * 1000 + G)
    return Group(
        prompt=torch.randint(0, vocab, (P,), generator=gen).to(device),
        responses=torch.randint(0, vocab, (G, R), generator=gen).to(device),
        advantages=torch.randn(G, generator=gen).to(device),
        mask=torch.ones(G, R, device=device),
    )
