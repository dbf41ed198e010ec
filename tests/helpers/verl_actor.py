"""verl 0.9.1's FSDP actor engine on the CPU in this process: a tiny random
model saved where verl loads it from, engines built from verl's configs,
and a recorded GRPO batch in the layout verl's trainer hands the actor
(`left_right_2_no_padding` of the rollout's padded batch)."""

from __future__ import annotations

import datetime
import functools
import socket
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import distribute_tensor
from tensordict import TensorDict
from transformers import Qwen3Config, Qwen3ForCausalLM
from verl.models.transformers import monkey_patch
from verl.trainer.config import CheckpointConfig
from verl.utils import tensordict_utils as tu
from verl.workers.config import FSDPActorConfig, FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
from verl.workers.utils.losses import ppo_loss

from longstraw.integrations.verl import recorded_batch
from longstraw.integrations.verl_cpu import use_cpu_platform

VOCAB = 97
FP32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}


def prepare_verl() -> None:
    """verl on the CPU: its platform. verl 0.9.1 patches
    `trl.AutoModelForCausalLMWithValueHead` whenever trl imports, a class
    trl 1.16 (which the TRL tests need) no longer has, so verl's engine
    build fails beside it: verl is told trl is absent."""
    use_cpu_platform()
    monkey_patch.is_trl_available = lambda: False


def start_process_group() -> None:
    """`prepare_verl` and a one-rank gloo group in this process."""
    prepare_verl()
    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120))


def save_tiny_qwen3(path: Path) -> str:
    """A 2-layer random Qwen3 where verl's HFModelConfig loads it from."""
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(path)
    return str(path)


def build_engine(engine_class: type, model_path: str, *, remove_padding: bool = True,
                 checkpointing: bool = False, lora_rank: int = 0, lr: float = 1e-2, **engine_fields):
    """An initialised engine of `engine_class` (verl's own or LongStraw's) in
    float32. With `lora_rank`, verl's LoRA adapters on every linear layer,
    set from their names (peft draws them from the global generator). With
    `lr=0` its updates leave the weights as they are, so one engine serves
    several updates compared one by one."""
    model = HFModelConfig(path=model_path, load_tokenizer=False, override_config={"attn_implementation": "sdpa"},
                          use_remove_padding=remove_padding, enable_gradient_checkpointing=checkpointing,
                          lora_rank=lora_rank, lora_alpha=2 * lora_rank)
    engine_fields = {"strategy": "fsdp2", "mixed_precision": FP32, "use_torch_compile": False, **engine_fields}
    engine = engine_class(model, FSDPEngineConfig(**engine_fields), FSDPOptimizerConfig(lr=lr, clip_grad=1.0),
                          CheckpointConfig())
    engine.initialize()
    with torch.no_grad():
        for index, (name, p) in enumerate(engine.module.named_parameters()):
            if "lora_" in name:
                value = 0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(index))
                p.copy_(distribute_tensor(value, p.device_mesh, p.placements))
    return engine


def grpo_batch(prompt_lengths=(9, 6), response_lengths=((6, 3, 5), (2, 6, 4)), seed: int = 1,
               temperature: float = 0.7, row_order: list[int] | None = None,
               same_prompt_as: dict[int, int] | None = None) -> TensorDict:
    """A rollout batch, each prompt's responses in adjacent rows as verl's
    `rollout.n` repeats them (or in `row_order`), converted as verl's
    trainer converts it. `same_prompt_as` {group: earlier group}: a
    dataset's duplicate prompt."""
    g = torch.Generator().manual_seed(seed)
    P, R = max(prompt_lengths), max(max(r) for r in response_lengths)
    rows = sum(len(r) for r in response_lengths)
    ids = torch.zeros(rows, P + R, dtype=torch.long)
    mask = torch.zeros(rows, P + R, dtype=torch.long)
    row, prompts = 0, []
    for group, (prompt_length, responses) in enumerate(zip(prompt_lengths, response_lengths)):
        prompt = torch.randint(1, VOCAB, (prompt_length,), generator=g)
        if same_prompt_as and group in same_prompt_as:
            prompt = prompts[same_prompt_as[group]]
        prompts.append(prompt)
        for response_length in responses:
            ids[row, P - prompt_length:P] = prompt
            ids[row, P:P + response_length] = torch.randint(1, VOCAB, (response_length,), generator=g)
            mask[row, P - prompt_length:P + response_length] = 1
            row += 1
    if row_order is not None:
        ids, mask = ids[row_order], mask[row_order]
    advantages = torch.randn(rows, generator=g)
    return recorded_batch(ids, mask, P, advantages, old_log_probs=-3 * torch.rand(rows, R, generator=g),
                          ref_log_prob=-3 * torch.rand(rows, R, generator=g), temperature=temperature,
                          calculate_entropy=True, global_batch_size=rows)


def with_micro_batches(batch: TensorDict, *, rows: int | None = None, max_tokens: int | None = None,
                       remove_padding: bool = True) -> TensorDict:
    """The engineering keys verl's `TrainingWorker` adds: a fixed micro-batch
    of `rows`, or dynamic batch size up to `max_tokens` per micro-batch."""
    tu.assign_non_tensor(batch, use_remove_padding=remove_padding, use_dynamic_bsz=max_tokens is not None,
                         micro_batch_size_per_gpu=rows or 0, max_token_len_per_gpu=max_tokens or 0,
                         use_fused_kernels=False)
    return batch


def grpo_loss(rollout_n: int):
    """verl's `ppo_loss` as GRPO runs it: sequence-mean token-mean, KL loss to the reference, an entropy bonus."""
    config = FSDPActorConfig(strategy="fsdp2", rollout_n=rollout_n, ppo_micro_batch_size_per_gpu=rollout_n,
                             loss_agg_mode="seq-mean-token-mean", use_kl_loss=True, kl_loss_coef=0.1,
                             kl_loss_type="low_var_kl", entropy_coeff=0.01)
    return functools.partial(ppo_loss, config)


def dapo_loss(rollout_n: int):
    """verl's `ppo_loss` as DAPO runs it: token-mean, decoupled clip (0.2, 0.28), no KL."""
    config = FSDPActorConfig(strategy="fsdp2", rollout_n=rollout_n, use_dynamic_bsz=True, loss_agg_mode="token-mean",
                             clip_ratio_low=0.2, clip_ratio_high=0.28)
    return functools.partial(ppo_loss, config)


def grads(engine) -> dict[str, torch.Tensor | None]:
    """The engine's full gradients by parameter name (one rank: the shard is the whole)."""
    return {name: None if p.grad is None else p.grad.full_tensor().clone()
            for name, p in engine.module.named_parameters()}
