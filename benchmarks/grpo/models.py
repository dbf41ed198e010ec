"""The benchmarked models (the dense and hybrid slices), the GRPO loss and a group of inputs."""

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


def build_model(kind: str, tiny: bool, dtype: torch.dtype, device: torch.device) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = dense_config(tiny) if kind == "dense" else hybrid_config(tiny)
    cls = transformers.Qwen3ForCausalLM if kind == "dense" else transformers.Qwen3_5ForCausalLM
    with torch.device(device):
        model = cls(config).to(dtype)
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
