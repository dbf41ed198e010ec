"""The benchmarked models (the dense, hybrid and GLM-5 slices), the GRPO loss and a group of inputs."""

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


MODEL_CLASSES = {
    "dense": (dense_config, transformers.Qwen3ForCausalLM),
    "hybrid": (hybrid_config, transformers.Qwen3_5ForCausalLM),
    "glm5": (glm5_config, transformers.GlmMoeDsaForCausalLM),
}


def build_model(kind: str, tiny: bool, dtype: torch.dtype, device: torch.device) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    make_config, cls = MODEL_CLASSES[kind]
    with torch.device(device):
        model = cls(make_config(tiny)).to(dtype)
    if kind == "glm5":
        model.set_attn_implementation("sdpa")
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
