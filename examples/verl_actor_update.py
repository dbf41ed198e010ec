"""One verl actor update through LongStraw, on the CPU, offline.

verl 0.9.1's FSDP2 actor engine and `LongStrawActorEngine` load the same
tiny random Qwen3 and take one GRPO update on the same recorded batch
(2 prompts x 4 responses, in the nested layout verl's trainer hands the
actor); verl's own `ppo_loss` runs in both. The gradients are compared.
No rollout engine: the batch is what a rollout would have produced.

verl pins transformers < 5.11; install it beside this project without
its requirements (as `.ci/run` does):

    pip install -c .ci/constraints.txt -e '.[examples]' -r .ci/verl.txt
    pip install --no-deps verl==0.9.1
    python examples/verl_actor_update.py
"""

from __future__ import annotations

import functools
import socket
import tempfile

import torch
import torch.distributed as dist
import transformers
from verl.models.transformers import monkey_patch
from verl.trainer.config import CheckpointConfig
from verl.workers.config import FSDPActorConfig, FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.utils.losses import ppo_loss

from longstraw.integrations.verl import longstraw_engine, recorded_batch
from longstraw.integrations.verl_cpu import use_cpu_platform

G, P, R, VOCAB = 4, 24, 12, 128


def rollout(seed: int = 0):
    """2 prompts x G responses as a rollout leaves them (prompts left-padded,
    responses right-padded), converted to verl's no-padding layout."""
    g = torch.Generator().manual_seed(seed)
    rows = 2 * G
    ids = torch.zeros(rows, P + R, dtype=torch.long)
    mask = torch.zeros(rows, P + R, dtype=torch.long)
    for row in range(rows):
        prompt_length = (P, P - 7)[row // G]
        if row % G == 0:
            prompt = torch.randint(1, VOCAB, (prompt_length,), generator=g)
        response_length = int(torch.randint(3, R + 1, (), generator=g))
        ids[row, P - prompt_length:P] = prompt
        ids[row, P:P + response_length] = torch.randint(1, VOCAB, (response_length,), generator=g)
        mask[row, P - prompt_length:P + response_length] = 1
    rewards = torch.rand(rows, generator=g)
    grouped = rewards.view(2, G)
    advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).view(rows)
    return recorded_batch(ids, mask, P, advantages, old_log_probs=-3 * torch.rand(rows, R, generator=g),
                          ref_log_prob=-3 * torch.rand(rows, R, generator=g), temperature=1.0,
                          calculate_entropy=False, global_batch_size=rows, use_remove_padding=True,
                          use_dynamic_bsz=False, micro_batch_size_per_gpu=G, max_token_len_per_gpu=0,
                          use_fused_kernels=False)


def engine(engine_class: type, model_path: str):
    """An engine as verl's worker builds it, in float32 on the CPU."""
    model = HFModelConfig(path=model_path, load_tokenizer=False, override_config={"attn_implementation": "sdpa"},
                          enable_gradient_checkpointing=False)
    config = FSDPEngineConfig(strategy="fsdp2", use_torch_compile=False,
                              mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"})
    built = engine_class(model, config, FSDPOptimizerConfig(lr=1e-5, clip_grad=1.0), CheckpointConfig())
    built.initialize()
    return built


def update(actor, loss) -> tuple[dict[str, torch.Tensor], float]:
    """One actor update (micro-batches of one group); its gradients and loss."""
    with actor.train_mode():
        out = actor.train_batch(rollout(), loss_function=loss)
        grads = {name: p.grad.full_tensor().clone() for name, p in actor.module.named_parameters()}
    return grads, sum(out["loss"])


def main() -> None:
    use_cpu_platform()
    monkey_patch.is_trl_available = lambda: False  # verl 0.9.1 patches a class trl >= 1.16 no longer has
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    config = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model_path = tempfile.mkdtemp()
    transformers.Qwen3ForCausalLM(config).save_pretrained(model_path)
    loss = functools.partial(ppo_loss, FSDPActorConfig(strategy="fsdp2", rollout_n=G, ppo_micro_batch_size_per_gpu=G,
                                                       use_kl_loss=True, loss_agg_mode="seq-mean-token-mean"))
    ours, our_loss = update(engine(longstraw_engine({"prompt_grad": "exact"}), model_path), loss)
    theirs, their_loss = update(engine(FSDPEngineWithLMHead, model_path), loss)
    worst = max(((ours[n] - theirs[n]).norm() / theirs[n].norm().clamp_min(1e-30)).item() for n in theirs)
    print(f"verl actor update through LongStraw (exact, float32): loss {our_loss:.6f} vs verl's {their_loss:.6f}, "
          f"max relative gradient error {worst:.2e}; tolerance 1e-05")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
