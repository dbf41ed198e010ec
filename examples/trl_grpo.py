"""TRL's GRPO loop for a few steps through LongStraw, on the CPU, offline.

A tiny random Qwen3, a word-level tokenizer built in memory (no download),
a toy reward (how many completion words are "yes"), and
`LongStrawGRPOTrainer`: TRL generates, rewards and computes the loss as
usual; the model's per-token log-probs come from the compiled scorer.

    python examples/trl_grpo.py
"""

from __future__ import annotations

import tempfile

import torch
import transformers
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from trl import GRPOConfig

from longstraw.integrations.trl import LongStrawGRPOTrainer

WORDS = ["yes", "no", "maybe", "the", "a", "cat", "dog", "runs", "sleeps", "why", "how", "what"]
PROMPTS = ["why the cat sleeps", "how a dog runs", "what the dog", "the cat runs"]


def tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over `WORDS`, built without network."""
    vocab = {word: index for index, word in enumerate(["<pad>", "<eos>", "<unk>", *WORDS])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def tiny_model(tokenizer: transformers.PreTrainedTokenizerFast) -> transformers.Qwen3ForCausalLM:
    """A random two-layer Qwen3 in float32 with SDPA attention."""
    config = transformers.Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(config)


def yes_reward(completions: list[str], **kwargs: object) -> list[float]:
    """Toy reward: the number of "yes" words in the completion."""
    return [float(completion.split().count("yes")) for completion in completions]


def grpo_config(output_dir: str, max_steps: int = 2, **overrides: object) -> GRPOConfig:
    """Two prompts of four completions per micro-batch, two micro-batches per
    generation, float32 on the CPU (GRPOConfig's default bf16 autocast off),
    no gradient checkpointing (LongStraw replays completions anyway), nothing
    saved."""
    settings: dict[str, object] = dict(
        output_dir=output_dir,
        per_device_train_batch_size=8,
        num_generations=4,
        steps_per_generation=2,
        max_completion_length=6,
        max_steps=max_steps,
        learning_rate=1e-3,
        beta=0.04,
        temperature=0.9,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        seed=0,
    )
    return GRPOConfig(**{**settings, **overrides})


def make_trainer(output_dir: str, max_steps: int = 2, longstraw_options: dict | None = None) -> LongStrawGRPOTrainer:
    """The policy is saved to `output_dir` and passed by path: TRL loads the
    reference model (beta > 0) from the same path."""
    tokenizer = tiny_tokenizer()
    model_dir = f"{output_dir}/model"
    tiny_model(tokenizer).save_pretrained(model_dir)
    dataset = Dataset.from_dict({"prompt": PROMPTS * 4})
    return LongStrawGRPOTrainer(
        model=model_dir,
        reward_funcs=yes_reward,
        args=grpo_config(output_dir, max_steps),
        train_dataset=dataset,
        processing_class=tokenizer,
        longstraw_options=longstraw_options,
    )


def main() -> None:
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = make_trainer(output_dir, max_steps=2)
        trainer.train()
    for record in trainer.state.log_history:
        if "loss" in record:
            print(f"step {record['step']}: loss {record['loss']:.4f}, entropy {record['entropy']:.3f}")
    print(f"LongStraw plans made: {len(trainer.longstraw_backend.plans)}")
    print(trainer.longstraw_backend.plans[-1].summary())


if __name__ == "__main__":
    main()
