"""TRL's `GRPOTrainer` with its per-token log-probs computed through LongStraw.

    from longstraw.integrations.trl import LongStrawGRPOTrainer
    trainer = LongStrawGRPOTrainer(model=model, args=GRPOConfig(...), ...,
                                   longstraw_options={"prompt_grad": "exact"})

The hook is `_get_per_token_logps_and_entropies`, the one place TRL runs the
model: it becomes a function compiled with `backend="longstraw"` that returns
the per-token log-probs and entropies `[B, R]`, and TRL's own loss code runs
eagerly on them, so every loss type, clipping and KL option of TRL keeps its
meaning and its backward flows into LongStraw's. The old policy's and the
reference model's scoring (under `no_grad`) go through the same function.

Generation: with HF's `generate` (no vLLM, no continuous batching), each
distinct prompt of the batch is prefilled once for its whole group and its
K/V handed to `generate` (`shared_prefill`; `share_prefill=False` turns it
off); models whose cache it cannot lay out generate as in TRL.

Groups: LongStraw refuses a micro-batch in which a prompt has a single
completion. TRL shuffles the generation batch row by row before splitting it
into `steps_per_generation` micro-batches; this trainer shuffles whole prompt
groups instead (`shuffle_groups`) and requires `per_device_train_batch_size`
to be a multiple of `num_generations`, so every micro-batch holds whole groups.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from trl import GRPOTrainer
from trl.trainer.utils import split_tensor_dict

from longstraw.backend import Backend
from longstraw.errors import InputError, LongStrawError
from longstraw.integrations.scoring import completion_logps_and_entropies
from longstraw.integrations.shared_prefill import shared_prefill
from longstraw.options import Options

__all__ = ["LongStrawGRPOTrainer", "completion_logps_and_entropies", "shuffle_groups"]


def shuffle_groups(batch: dict[str, Any], num_generations: int) -> dict[str, Any]:
    """TRL's `shuffle_sequence_dict`, permuting whole prompt groups.

    TRL's sampler yields each prompt's `num_generations` completions as
    consecutive rows; they stay consecutive so that an equal split of the
    batch keeps every group in one micro-batch. Blocks whose prompts differ
    are refused: the layout is not the one this relies on."""
    prompt_ids, prompt_mask = batch["prompt_ids"], batch["prompt_mask"]  # [N, P]
    rows = prompt_ids.shape[0]
    if rows % num_generations:
        raise InputError(f"the generation batch has {rows} rows, not a multiple of num_generations={num_generations}")
    blocks = rows // num_generations
    for block in range(blocks):
        start, stop = block * num_generations, (block + 1) * num_generations
        same_ids = bool((prompt_ids[start:stop] == prompt_ids[start]).all())
        same_mask = bool((prompt_mask[start:stop] == prompt_mask[start]).all())
        if not (same_ids and same_mask):
            raise InputError(
                f"rows {start}..{stop - 1} of the generation batch are not one prompt's {num_generations} "
                "completions; LongStrawGRPOTrainer relies on TRL's RepeatSampler layout (a custom sampler "
                "must yield each prompt num_generations times in a row)"
            )
    order = torch.randperm(blocks)  # [blocks]
    permutation = (order[:, None] * num_generations + torch.arange(num_generations)).reshape(-1)  # [N]

    def permute(value: Any) -> Any:
        if value is None or (isinstance(value, torch.Tensor) and value.ndim == 0):
            return value
        if isinstance(value, torch.Tensor):
            return value[permutation.to(value.device)]
        return [value[i] for i in permutation.tolist()]

    return {key: permute(value) for key, value in batch.items()}


class LongStrawGRPOTrainer(GRPOTrainer):
    """`GRPOTrainer` whose model calls run through `backend="longstraw"`.

    `longstraw_options`: the backend's options (`longstraw.Options` or a
    dict), e.g. `{"prompt_grad": "detached"}`. `share_prefill`: prefill each
    distinct prompt once when generating with HF's `generate`
    (`shared_prefill`). Refused at construction, with
    the setting to change: `gradient_checkpointing` (on by default in
    `GRPOConfig`), `use_liger_kernel`, `cast_lm_head_to_fp32`, an MoE
    router auxiliary loss, and `per_device_train_batch_size` not a multiple
    of `num_generations`; vision inputs are refused at the first call."""

    def __init__(self, *args: Any, longstraw_options: Options | Mapping[str, Any] | None = None,
                 share_prefill: bool = True, **kwargs: Any) -> None:
        self.longstraw_backend = Backend(longstraw_options)
        self.share_prefill = share_prefill
        super().__init__(*args, **kwargs)
        _check_settings(self)
        # dynamic sizes from the first call: every generation brings new prompt and completion lengths,
        # which LongStraw plans for without Dynamo tracing the scorer again
        self._longstraw_scorer = torch.compile(completion_logps_and_entropies, backend=self.longstraw_backend,
                                               dynamic=True)

    def _prepare_inputs(self, generation_batch: dict[str, Any]) -> dict[str, Any]:
        """TRL's `_prepare_inputs` in training, with groups shuffled whole
        (`shuffle_groups`) before the equal split into micro-batches."""
        if not self.model.training:
            return super()._prepare_inputs(generation_batch)
        steps = self.args.steps_per_generation
        if self._step % (steps * self.num_iterations) == 0 or self._buffered_inputs is None:
            generation_batch = self._generate_and_score_completions(generation_batch)
            generation_batch = shuffle_groups(generation_batch, self.num_generations)
            self._buffered_inputs = split_tensor_dict(generation_batch, steps)
        return self._buffered_inputs[self._step % steps]

    def _generate_single_turn(self, *args: Any, **kwargs: Any) -> Any:
        """TRL's, with HF's `generate` prefilling each distinct prompt once."""
        if not self.share_prefill or self.use_vllm or self.use_transformers_continuous_batching:
            return super()._generate_single_turn(*args, **kwargs)
        with shared_prefill(self.accelerator.unwrap_model(self.model_wrapped)):
            return super()._generate_single_turn(*args, **kwargs)

    def _get_per_token_logps_and_entropies(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None = None,
        compute_entropy: bool = False,
        compute_aux_loss: bool = False,
        **vision_inputs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        """TRL's hook, computed by the compiled scorer over the whole batch.
        `batch_size` (TRL's row chunking) is not applied: LongStraw holds one
        prompt group's state at a time and runs each completion's LM head in
        position chunks, so the `[B, R, V]` logits never exist whole."""
        given = sorted(name for name, value in vision_inputs.items() if value is not None)
        if given:
            raise LongStrawError(
                f"LongStrawGRPOTrainer runs text-only models; the batch has vision inputs {given}. "
                "Use trl.GRPOTrainer for vision-language models."
            )
        if compute_aux_loss:
            raise LongStrawError("the MoE router auxiliary loss is not computed; set GRPOConfig(router_aux_loss_coef=0.0)")
        with self.accelerator.autocast():
            logps, entropies = self._longstraw_scorer(model, input_ids, attention_mask, logits_to_keep, self.temperature)
        return logps, entropies if compute_entropy else None, None


def _check_settings(trainer: LongStrawGRPOTrainer) -> None:
    """Refuse the settings whose model calls the scorer does not reproduce,
    and batch sizes that would split a prompt group across micro-batches."""
    args = trainer.args
    if args.use_liger_kernel:
        raise ValueError(
            "LongStrawGRPOTrainer: use_liger_kernel=True replaces the model's layers; set use_liger_kernel=False"
        )
    if args.gradient_checkpointing:
        raise ValueError(
            "LongStrawGRPOTrainer: gradient_checkpointing=True (GRPOConfig's default) buys nothing here, as "
            "LongStraw replays the completions anyway, and transformers adds a forward hook each time TRL "
            "re-enables it after generation, so Dynamo would recompile the scorer at every generation; "
            "set gradient_checkpointing=False"
        )
    if args.cast_lm_head_to_fp32:
        raise ValueError(
            "LongStrawGRPOTrainer: cast_lm_head_to_fp32=True is not supported (the scorer computes the "
            "log-softmax in float32 already); set cast_lm_head_to_fp32=False"
        )
    if trainer.aux_loss_enabled:
        raise ValueError(
            "LongStrawGRPOTrainer: the MoE router auxiliary loss is not computed; "
            "set GRPOConfig(router_aux_loss_coef=0.0)"
        )
    if args.per_device_train_batch_size % trainer.num_generations:
        raise ValueError(
            f"LongStrawGRPOTrainer: per_device_train_batch_size={args.per_device_train_batch_size} is not a "
            f"multiple of num_generations={trainer.num_generations}, so a prompt's completions would be split "
            "across micro-batches; make it a multiple"
        )
