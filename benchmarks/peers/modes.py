"""The peers: TRL's GRPO loss eager and with checkpointing, prefix-grouper, LongStraw detached and exact.

Every mode is `compute_loss` of a TRL `GRPOTrainer` on the same micro-batch,
so the loss (TRL's default, `dapo`), its normalisation and the LM head
(TRL's tiled log-prob and entropy kernel) are TRL's own in all of them; what
differs is how the per-token log-probs of the completions are computed:

  trl_eager           trl.GRPOTrainer: one forward over the n_prompts x G rows [prompt; completion]
  trl_ckpt            the same with gradient checkpointing (GRPOConfig's default), non-reentrant
                      (both: a hybrid's Gated DeltaNet on fla's kernels where they run, `gated_delta`)
  prefix_grouper      prefix-grouper 0.0.1.post1: one packed row per prompt [prompt, c_1 .. c_G],
                      attention through its transformers attention function over SDPA
  longstraw_detached  longstraw.integrations.trl.LongStrawGRPOTrainer, prompt_grad="detached"
  longstraw_exact     the same, prompt_grad="exact"
"""

from __future__ import annotations

import contextlib
import tempfile
from typing import Any

import torch
from datasets import Dataset
from prefix_grouper import PrefixGrouper
from prefix_grouper.utils.register_transformers import register_attention
from tokenizers import Tokenizer, models
from transformers import AttentionInterface, PreTrainedTokenizerFast
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface
from trl import GRPOConfig, GRPOTrainer
from trl.kernels import ChunkedLogProbFunction
from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

from longstraw.integrations.trl import LongStrawGRPOTrainer

from .batch import EOS_ID, PAD_ID
from .gated_delta import hopper_safe_gated_delta

PEERS = ("trl_eager", "trl_ckpt", "prefix_grouper", "longstraw_detached", "longstraw_exact")
PG_ATTENTION = "prefix_grouper_attention"  # the name prefix-grouper registers its attention under
PG_SDPA = "prefix_grouper_sdpa"  # the SDPA function it calls per part, below


def padded_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor, *, completion_bias: torch.Tensor, **kwargs: Any):
    """SDPA for prefix-grouper's two calls per layer, which pass 2-D key
    padding masks (its packaged path calls flash-attention's varlen kernels
    with them). The prompts' call (keys left-padded to the longest prompt):
    causal SDPA per prompt over its real positions, zeros at the padding
    (which prefix-grouper drops). The completions' call: the prompt's keys
    then the completion's own, masked by `completion_bias`, built once per
    step so every layer's backward keeps the same tensor."""
    if query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(module, query, key, value, completion_bias, **kwargs)
    width, outputs = query.shape[2], []
    for row, real in enumerate(attention_mask.sum(-1).tolist()):
        start = width - real
        out, _ = sdpa_attention_forward(module, query[row : row + 1, :, start:], key[row : row + 1, :, start:],
                                        value[row : row + 1, :, start:], None, **kwargs)  # [1, real, heads, D]
        outputs.append(torch.nn.functional.pad(out, (0, 0, 0, 0, start, 0)))
    return torch.cat(outputs), None


def completion_bias(key_padding: torch.Tensor, queries: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, R, W + R] additive mask: a completion query sees its prompt's
    real keys and its own completion's keys up to itself."""
    keys = key_padding.shape[1]  # W + R
    prompt_width = keys - queries
    q = torch.arange(queries, device=key_padding.device)[:, None]  # [R, 1]
    k = torch.arange(keys, device=key_padding.device)[None]  # [1, W + R]
    visible = key_padding[:, None, None, :].bool() & ((k < prompt_width) | (k - prompt_width <= q))  # [B, 1, R, W + R]
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, torch.finfo(dtype).min)


class PrefixGrouperGRPOTrainer(GRPOTrainer):
    """TRL's trainer with its per-token log-probs computed the prefix-grouper
    way: each prompt once, its G completions attending to it."""

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **vision_inputs):
        R, G = logits_to_keep, self.num_generations
        prompt_ids, prompt_mask = input_ids[:, :-R], attention_mask[:, :-R].bool()  # [B, W]
        completion_ids, completion_mask = input_ids[:, -R:], attention_mask[:, -R:].bool()  # [B, R]
        rows = input_ids.shape[0]
        same = prompt_ids.view(rows // G, G, -1).eq(prompt_ids[::G, None]).all() and \
            prompt_mask.view(rows // G, G, -1).eq(prompt_mask[::G, None]).all()
        if not same:
            raise ValueError("prefix_grouper needs each prompt's G completions in consecutive rows (TRL's RepeatSampler)")
        grouper = PrefixGrouper.from_ungrouped_masks(prompt_mask[::G], completion_mask, G, device=input_ids.device)
        prompt_positions = (prompt_mask[::G].long().cumsum(-1) - 1).clamp(min=0)  # [n, W]
        completion_positions = prompt_mask[::G].sum(-1).repeat_interleave(G)[:, None] + torch.arange(R, device=input_ids.device)  # [B, R]
        packed_ids = grouper.concat_input(prompt_ids[::G], prompt_mask[::G], completion_ids, completion_mask)  # [n, L]
        positions = grouper.concat_input(prompt_positions, prompt_mask[::G], completion_positions, completion_mask)  # [n, L]
        bias = completion_bias(grouper.suffix_attn_mask.to(input_ids.device), grouper.suffix_x_shape[1], model.dtype)
        hidden = model.base_model(input_ids=packed_ids, position_ids=positions, use_cache=False, prefix_grouper=grouper,
                                  prefix_grouper_attn_func=PG_SDPA, completion_bias=bias).last_hidden_state  # [n, L, H]
        # per completion: the prompt's last hidden state, then its own ([B, 1 + R, H], right-padded)
        _, _, per_completion, _ = grouper.split_output(hidden, include_prefix_last=1)
        predicting = torch.nn.functional.pad(per_completion, (0, 0, 0, R + 1 - per_completion.shape[1]))[:, :R]  # [B, R, H]
        lm_head = model.get_output_embeddings()
        mask = completion_mask  # [B, R]
        per_token = ChunkedLogProbFunction.apply(predicting[mask], lm_head.weight, lm_head.bias, completion_ids[mask],
                                                 self.temperature, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0,
                                                 ("log_probs", "entropy"))
        logps, entropies = (x.new_zeros(mask.shape).masked_scatter(mask, x) for x in per_token[:2])
        return logps, entropies, None


def _no_reward(completions: list[str], **kwargs: object) -> list[float]:
    return [0.0] * len(completions)


def _tokenizer() -> PreTrainedTokenizerFast:
    """Only its pad and end ids matter: the micro-batch is made of ids."""
    backend = Tokenizer(models.WordLevel(vocab={"<pad>": PAD_ID, "<eos>": EOS_ID}, unk_token="<pad>"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")


class PeerRunner:
    """One mode's trainer on a shared model; `step(batch)` runs `compute_loss` and backward."""

    def __init__(self, model, mode: str, rows: int, G: int, R: int, longstraw_options: dict | None = None) -> None:
        """`longstraw_options`: the LongStraw modes' options besides `prompt_grad`."""
        if mode not in PEERS:
            raise ValueError(f"unknown mode {mode} (modes: {', '.join(PEERS)})")
        self.model, self.mode, self.rows, self.G, self.R = model, mode, rows, G, R
        self.longstraw_options = longstraw_options or {}

    def __enter__(self) -> PeerRunner:
        model = self.model
        self._dir = tempfile.TemporaryDirectory()
        self._contexts = contextlib.ExitStack()
        if self.mode.startswith("trl"):  # HF's hybrid layers on fla's kernels, as LongStraw's steps run them
            self._contexts.enter_context(hopper_safe_gated_delta())
        config = GRPOConfig(output_dir=self._dir.name, per_device_train_batch_size=self.rows, num_generations=self.G,
                            steps_per_generation=1, max_completion_length=self.R, beta=0.0, bf16=False,
                            use_cpu=model.device.type == "cpu", gradient_checkpointing=False, report_to="none",
                            save_strategy="no", seed=0,
                            router_aux_loss_coef=0.0)  # every mode alike: LongStraw's trainer refuses the aux loss
        trainer_cls, extra = GRPOTrainer, {}
        if self.mode == "prefix_grouper":
            register_attention()
            AttentionInterface.register(PG_SDPA, padded_sdpa)
            AttentionMaskInterface.register(PG_ATTENTION, lambda *args, **kwargs: None)  # its masks are its own
            model.set_attn_implementation(PG_ATTENTION)
            trainer_cls = PrefixGrouperGRPOTrainer
        elif self.mode.startswith("longstraw"):
            torch._dynamo.reset()
            options = {**self.longstraw_options, "prompt_grad": self.mode.removeprefix("longstraw_")}
            trainer_cls, extra = LongStrawGRPOTrainer, {"longstraw_options": options}
        self.trainer = trainer_cls(model=model, reward_funcs=_no_reward, args=config, processing_class=_tokenizer(),
                                   train_dataset=Dataset.from_dict({"prompt": [""] * self.rows}), **extra)
        self.trainer.current_gradient_accumulation_steps = 1
        if self.mode == "trl_ckpt":  # what Trainer.train does with gradient_checkpointing=True
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return self

    def __exit__(self, *exc: object) -> None:
        model = self.model
        model.__dict__.pop("forward", None)  # TRL's fused LM head patches the instance's forward
        if self.mode == "trl_ckpt":
            model.gradient_checkpointing_disable()
        if self.mode == "prefix_grouper":
            model.set_attn_implementation("sdpa")
        self.trainer = None
        self._contexts.close()
        self._dir.cleanup()
        torch._dynamo.reset()

    def step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        self.model.zero_grad(set_to_none=True)
        loss = self.trainer.compute_loss(self.model, batch)
        loss.backward()
        return loss.detach()
