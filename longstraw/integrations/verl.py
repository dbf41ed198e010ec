"""verl's FSDP actor with its log-probs and entropies computed through LongStraw.

    from longstraw.integrations.verl import register
    register({"prompt_grad": "exact"})  # in every worker process, before verl builds its engines

verl 0.9.1's actor is an engine (`FSDPEngineWithLMHead`) that verl's
`TrainingWorker` makes from `EngineRegistry` by `actor.strategy`. `register`
puts `LongStrawActorEngine` there for `strategy=fsdp2`. The engine's
`forward_step`, the one place verl runs the policy, scores each micro-batch
with a function compiled with `backend="longstraw"` and hands verl's own
loss function (`ppo_loss`, unchanged) the per-token log-probs and entropies
in the layout verl's model path returns: nested `[rows, j]` tensors over
each row's `[prompt; response]` tokens, the value predicting token t+1 at t.
LongStraw scores only what predicts response tokens; the other positions
hold NaN, so a loss that read them would fail loudly rather than train on
made-up values. Old and reference log-probs (`infer_batch`, under
`no_grad`) go through the same function.

Sharding: FSDP2's hooks cannot be traced, so the model is sharded at its
root only (not per layer, verl's wrap policy is not applied) and the
compiled unit is the root module itself: its class gains a scoring forward
(`forward(..., longstraw_score=True)`; any other call is the model's own
forward), so parameter names, checkpoints and weight sync stay verl's.
Parameters, gradients and optimizer state stay sharded between steps; the
step gathers the whole model, as `longstraw.LossModule` under FSDP2 does.

Groups: a micro-batch in which a prompt has a single response is refused.
Rows of one prompt must be adjacent (verl's `rollout.n` repeats are, unless
`actor.shuffle=True`); with dynamic batch size the engine keeps each block
of one prompt's rows in one micro-batch (`force_group_size`), and a fixed
micro-batch size must leave no prompt alone in a micro-batch (a multiple
of `rollout.n` does).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from typing import Any, Callable

import torch
from tensordict import TensorDict
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from verl.utils import tensordict_utils as tu
from verl.utils.dataset.dataset_utils import DatasetPadMode
from verl.utils.device import get_device_id, get_device_name
from verl.utils.fsdp_utils import fsdp2_load_full_state_dict
from verl.utils.torch_dtypes import PrecisionType
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.engine.utils import detach_tree
from verl.workers.utils.padding import left_right_2_no_padding

from longstraw.backend import Backend
from longstraw.errors import InputError, LongStrawError
from longstraw.integrations.packed import PackedSegments
from longstraw.integrations.scoring import completion_logps_and_entropies
from longstraw.options import Options

__all__ = ["LongStrawActorEngine", "longstraw_engine", "recorded_batch", "register"]


class LongStrawActorEngine(FSDPEngineWithLMHead):
    """verl's FSDP2 actor engine whose policy scoring runs through LongStraw.

    Built by verl as its own engine is, from (model, engine, optimizer,
    checkpoint) configs; `longstraw_engine(options)` binds LongStraw's
    options. Refused at construction, with the setting to change: a strategy
    other than `fsdp2`, Ulysses sequence parallelism, fused kernels,
    activation offload, gradient checkpointing (verl's default), and a value
    model. Refused at the call: vision inputs, Σπ² and top-k distillation
    outputs, rows of one prompt that are not adjacent, and a fixed
    micro-batch size that splits a group. LoRA
    (`lora_rank > 0`) trains its adapters as verl's engine does.
    `longstraw_backend` is the backend object (its `plans`, `fallbacks`)."""

    longstraw_options: Options = Options()

    def __init__(self, model_config: Any, engine_config: Any, optimizer_config: Any, checkpoint_config: Any) -> None:
        _check_settings(model_config, engine_config)
        super().__init__(model_config, engine_config, optimizer_config, checkpoint_config)
        self.longstraw_backend = Backend(self.longstraw_options)
        self._scorer: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None

    def _build_lora_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """verl's LoRA adapters, without the hook that makes the embeddings'
        output require grad (`enable_input_require_grads`): it serves
        gradient checkpointing over frozen embeddings, which this engine
        does not run, and `requires_grad_` inside the model breaks the graph."""
        module = super()._build_lora_module(module)
        module.disable_input_require_grads()
        return module

    def _build_fsdp_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """FSDP2 at the root only, with verl's mixed precision and offload
        policy; the root's class gains the scoring forward first."""
        module.__class__ = _scoring_class(type(module))
        precision = self.engine_config.mixed_precision or {}
        param_dtype = PrecisionType.to_dtype(precision.get("param_dtype", "bf16"))
        reduce_dtype = PrecisionType.to_dtype(precision.get("reduce_dtype", "fp32"))
        self._autocast_dtype = param_dtype
        if param_dtype == torch.float16:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(growth_interval=400)
        offload = None
        if self.engine_config.offload_policy or self.engine_config.forward_only:
            self._is_offload_param = self._is_offload_optimizer = False
            offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
            self._uses_fsdp2_cpu_offload_policy = True
        full_state = module.state_dict()
        fully_shard(module, mesh=self.device_mesh, offload_policy=offload or OffloadPolicy(),
                    mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                                   cast_forward_inputs=True),
                    reshard_after_forward=self.engine_config.reshard_after_forward)
        fsdp2_load_full_state_dict(module, full_state, self.device_mesh, offload)
        return module

    def forward_backward_batch(self, data: TensorDict, loss_function: Callable, forward_only: bool = False) -> Any:
        """verl's micro-batch loop, with every micro-batch holding at least
        two responses of each prompt in it: dynamic batch size balances
        whole blocks of one prompt (`force_group_size`); a fixed micro-batch
        size that leaves a prompt alone in a micro-batch is refused."""
        prompts = _prompts(data)
        block = _block_size(prompts)
        if tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True):
            tu.assign_non_tensor(data, force_group_size=block)
        elif (lonely := _lonely_row(prompts, rows := data["micro_batch_size_per_gpu"])) is not None:
            raise InputError(
                f"micro-batch {lonely[0]} of {rows} rows holds row {lonely[1]} but no other response to its prompt, "
                "and LongStraw refuses a micro-batch in which a prompt has one response: set "
                "actor.ppo_micro_batch_size_per_gpu (and log_prob_micro_batch_size_per_gpu) to a multiple of "
                f"rollout.n ({block} here), or use_dynamic_bsz=True"
            )
        return super().forward_backward_batch(data, loss_function, forward_only=forward_only)

    def forward_step(self, micro_batch: TensorDict, loss_function: Callable | None,
                     forward_only: bool) -> tuple[torch.Tensor, dict[str, Any]]:
        """The micro-batch's log-probs (and entropies) through LongStraw, then
        verl's loss function on them, as verl's `forward_step` returns them."""
        micro_batch = micro_batch.to(get_device_id())
        _check_batch(micro_batch)
        input_ids = micro_batch["input_ids"]  # nested [rows, j]: each row's prompt and response tokens
        offsets = input_ids.offsets()  # [rows + 1]
        tokens = input_ids.values()  # [N]
        segments = PackedSegments.from_prompt_lengths(offsets, _prompt_lengths(micro_batch), tokens)
        layout = segments.padded(tokens)
        autocast = (contextlib.nullcontext() if self._autocast_dtype == torch.float32
                    else torch.autocast(device_type=get_device_name(), dtype=self._autocast_dtype))
        with autocast:
            logps, entropies = self._compiled_scorer()(
                layout.input_ids, layout.attention_mask, layout.logits_to_keep, _temperature(micro_batch),
                layout.position_ids, longstraw_score=True,
            )  # [rows, R] each
            model_output = {"log_probs": _as_verl_output(segments.packed(logps, shift=-1, fill=float("nan")), offsets)}
            if tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=False):
                model_output["entropy"] = _as_verl_output(segments.packed(entropies, shift=-1, fill=float("nan")),
                                                          offsets)
            if loss_function is None:
                if not forward_only:
                    raise LongStrawError("verl asked for a training step without a loss function")
                loss, metrics = torch.tensor(1.0, device=get_device_name()), {}
            else:
                loss, metrics = loss_function(model_output=model_output, data=micro_batch,
                                              dp_group=self.get_data_parallel_group())
        return loss, {"model_output": detach_tree(model_output), "loss": loss.detach().item(), "metrics": metrics}

    def _compiled_scorer(self) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
        """The root module compiled with LongStraw, made at the first step
        (verl builds the module in `initialize`). Dynamic sizes from the first
        call: every rollout brings new prompt and response lengths."""
        if self._scorer is None:
            self._scorer = torch.compile(self.module, backend=self.longstraw_backend, dynamic=True)
        return self._scorer


class _Scoring:
    """Placed before the model's class: `forward(..., longstraw_score=True)`
    returns the completions' log-probs and entropies
    (`completion_logps_and_entropies` over the model's own forward); any
    other call is the model's forward."""

    def forward(self, *args: Any, longstraw_score: bool = False, **kwargs: Any) -> Any:
        if not longstraw_score:
            return super().forward(*args, **kwargs)
        model_forward = super().forward
        return completion_logps_and_entropies(lambda **inputs: model_forward(**inputs), *args, **kwargs)


_SCORING_CLASSES: dict[type, type] = {}


def _scoring_class(cls: type) -> type:
    """`cls` with `_Scoring`'s forward: one class per model class, so that
    Dynamo's guards see the same type for every engine of that model."""
    if issubclass(cls, _Scoring):
        return cls
    if cls not in _SCORING_CLASSES:
        _SCORING_CLASSES[cls] = type(f"LongStrawScoring{cls.__name__}", (_Scoring, cls), {})
    return _SCORING_CLASSES[cls]


def _check_settings(model_config: Any, engine_config: Any) -> None:
    """Refuse, at construction, the settings whose model calls the compiled
    scorer does not reproduce."""
    refusals = []
    if engine_config.strategy != "fsdp2":
        refusals.append(f"strategy={engine_config.strategy!r}: LongStraw's engine shards with FSDP2 at the model's "
                        "root (FSDP1 and per-layer sharding put hooks inside the graph); set actor.strategy=fsdp2")
    if getattr(engine_config, "ulysses_sequence_parallel_size", 1) > 1:
        refusals.append("Ulysses sequence parallelism (ulysses_sequence_parallel_size > 1) is not supported; set it "
                        "to 1 (LongStraw's own context parallelism splits the prompt state instead)")
    if getattr(model_config, "model_type", "language_model") != "language_model":
        refusals.append(f"model_type={model_config.model_type!r}: only the policy (language_model) is scored")
    if getattr(model_config, "use_fused_kernels", False):
        refusals.append("use_fused_kernels=True replaces the LM head's forward; set use_fused_kernels=False")
    if getattr(model_config, "enable_activation_offload", False):
        refusals.append("enable_activation_offload=True wraps the layers in offload hooks; set it to False "
                        "(LongStraw keeps only the prompt's state)")
    if getattr(model_config, "enable_gradient_checkpointing", False):
        refusals.append("enable_gradient_checkpointing=True (verl's default) buys nothing here, as LongStraw "
                        "replays the responses anyway; set actor_rollout_ref.model.enable_gradient_checkpointing=False")
    if refusals:
        raise ValueError("LongStrawActorEngine: " + "; ".join(refusals))


def _check_batch(micro_batch: TensorDict) -> None:
    """Refuse, at the call, what the scorer does not compute."""
    flag = lambda key: tu.get_non_tensor_data(data=micro_batch, key=key, default=False)  # noqa: E731
    pad_mode = tu.get_non_tensor_data(data=micro_batch, key="pad_mode", default=DatasetPadMode.NO_PADDING)
    if pad_mode != DatasetPadMode.NO_PADDING:
        raise InputError(f"pad_mode={pad_mode!r}: verl's actor batches are no-padding (nested) rows")
    for key, what in (("use_fused_kernels", "fused kernels"), ("calculate_sum_pi_squared", "Σπ² of the policy"),
                      ("distillation_use_topk", "top-k distillation outputs")):
        if flag(key):
            raise InputError(f"{key}=True: LongStraw's engine does not compute {what}; turn it off")
    if micro_batch.get("multi_modal_inputs", None) is not None:
        raise InputError("the batch has multi_modal_inputs; LongStraw's engine runs text-only models")
    if micro_batch["position_ids"].dim() == 3:
        raise InputError("3-D (multimodal RoPE) position ids are not supported; LongStraw's engine runs text-only "
                         "models")


def _prompt_lengths(data: TensorDict) -> list[int]:
    """Each row's prompt length, as verl's `no_padding_2_padding` reads it."""
    prompts = data["prompts"]
    if prompts.is_nested:
        return prompts.offsets().diff().tolist()
    return data["attention_mask"][:, :prompts.shape[1]].sum(1).tolist()  # attention_mask: [rows, P + R]


def _prompts(data: TensorDict) -> list[tuple[int, ...]]:
    """Each row's prompt tokens."""
    offsets = data["input_ids"].offsets().tolist()
    tokens = data["input_ids"].values()
    return [tuple(tokens[start:start + n].tolist()) for start, n in zip(offsets, _prompt_lengths(data))]


def _block_size(prompts: list[tuple[int, ...]]) -> int:
    """The largest block size that cuts the rows into blocks of one prompt
    each: the gcd of the runs of adjacent rows with equal prompts (a
    dataset's duplicate prompt makes a longer run, or a run elsewhere).
    Refused, naming the row, where it is 1."""
    runs, first = [], 0
    for row in range(1, len(prompts) + 1):
        if row == len(prompts) or prompts[row] != prompts[first]:
            runs.append((first, row - first))
            first = row
    block = math.gcd(*(n for _, n in runs))
    if block < 2:
        row = next(first for first, n in runs if n % 2)
        raise InputError(
            f"row {row}'s prompt is not repeated in the rows next to it: LongStraw's engine keeps each prompt's "
            "responses together in a micro-batch and needs them in adjacent rows, as verl's rollout.n repeats "
            "them (rollout.n > 1); set actor.shuffle=False"
        )
    return block


def _lonely_row(prompts: list[tuple[int, ...]], rows: int) -> tuple[int, int] | None:
    """The first (micro-batch, row) whose prompt no other row of its
    micro-batch of `rows` consecutive rows shares, if any."""
    for start in range(0, len(prompts), rows):
        chunk = prompts[start:start + rows]
        for row, prompt in enumerate(chunk):
            if chunk.count(prompt) == 1:
                return start // rows, start + row
    return None


def _temperature(micro_batch: TensorDict) -> float | torch.Tensor:
    """The micro-batch's sampling temperature: one float, or one per row
    `[rows]` where verl's per-sample temperatures differ."""
    value = micro_batch["temperature"]
    if not isinstance(value, torch.Tensor):
        return float(value)
    if value.numel() == 1 or bool((value == value.reshape(-1)[0]).all()):
        return float(value.reshape(-1)[0])
    return value.reshape(-1)


def _as_verl_output(packed: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`[1, N]` packed values as verl's nested `[rows, j]` model output."""
    return torch.nested.nested_tensor_from_jagged(packed.reshape(-1), offsets)


def longstraw_engine(options: Options | Mapping[str, Any] | None = None) -> type[LongStrawActorEngine]:
    """`LongStrawActorEngine` with LongStraw's `options` bound (verl builds
    engines from a class and its four configs)."""
    return type("LongStrawActorEngine", (LongStrawActorEngine,), {"longstraw_options": Options.from_any(options)})


def register(options: Options | Mapping[str, Any] | None = None, devices: tuple[str, ...] = ("cuda",)) -> None:
    """Make verl build `LongStrawActorEngine` for its policy with
    `strategy=fsdp2` on `devices`, in this process (call it in each worker,
    e.g. from a module named in `actor_rollout_ref.model.external_lib`)."""
    engine = longstraw_engine(options)
    backends = EngineRegistry._engines.setdefault("language_model", {}).setdefault("fsdp2", {})
    for device in devices:
        backends[device] = engine


def recorded_batch(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int,
                   advantages: torch.Tensor, old_log_probs: torch.Tensor, ref_log_prob: torch.Tensor | None = None,
                   **settings: Any) -> TensorDict:
    """A recorded rollout as verl's trainer hands it to the actor, for an
    update offline: `input_ids` and `attention_mask` `[rows, prompt_width +
    R]` (prompts left-padded to `prompt_width`, responses right-padded),
    `advantages` `[rows]` or `[rows, R]`, the old (and reference) policy's
    log-probs `[rows, R]`, converted to verl's no-padding layout
    (`left_right_2_no_padding`); `settings` are verl's non-tensor keys
    (temperature, micro-batch size, ...)."""
    rows, R = input_ids.shape[0], input_ids.shape[1] - prompt_width
    fields = {
        "input_ids": input_ids, "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "prompts": input_ids[:, :prompt_width], "responses": input_ids[:, prompt_width:],
        "response_mask": attention_mask[:, prompt_width:].float(), "old_log_probs": old_log_probs,
        "advantages": (advantages[:, None] if advantages.dim() == 1 else advantages).expand(rows, R).contiguous(),
    }
    if ref_log_prob is not None:
        fields["ref_log_prob"] = ref_log_prob
    batch = left_right_2_no_padding(TensorDict(fields, batch_size=[rows]))
    tu.assign_non_tensor(batch, **settings)
    return batch
