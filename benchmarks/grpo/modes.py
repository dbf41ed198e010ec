"""The modes compared: eager, eager with checkpointing, an eager shared-prefix step, LongStraw detached and exact."""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch
from transformers.integrations import moe as moe_integration

import longstraw
from longstraw.models import qwen3_5

from .models import MOE_KINDS, Group, grpo_loss, policy_loss

MODES = ("eager", "eager_ckpt", "eager_shared_prefix", "longstraw_detached", "longstraw_exact")
# GLM-5's shared-prefix step would need a packed sparse-attention mask or HF's indexed cache repeated per branch: not built
_UNSHARED = tuple(m for m in MODES if m != "eager_shared_prefix")
MODES_OF = {"dense": MODES, "hybrid": MODES, "glm5": _UNSHARED, "hybrid_moe": _UNSHARED, "nemotron_h": _UNSHARED}


def eager_step(model, group: Group) -> torch.Tensor:
    return grpo_loss(model, group.input_ids, group.advantages, group.mask, group.responses.shape[1])


def shared_prefix_dense(model, group: Group) -> torch.Tensor:
    """Packed [prompt, r_1[:-1] .. r_G[:-1]]: each response token attends to
    the prompt and its own response; the prompt's last logit is shared."""
    from torch.nn.attention.flex_attention import create_block_mask

    (P,), (G, R) = group.prompt.shape, group.responses.shape
    device = group.prompt.device
    ids = torch.cat([group.prompt, group.responses[:, :-1].flatten()])[None]
    positions = torch.cat([torch.arange(P, device=device), (P + torch.arange(R - 1, device=device)).repeat(G)])[None]
    segment = torch.cat([torch.zeros(P, dtype=torch.long, device=device), torch.arange(1, G + 1, device=device).repeat_interleave(R - 1)])

    def same_branch_or_prompt(b, h, q, kv):
        return (kv <= q) & ((segment[kv] == 0) | (segment[kv] == segment[q]))

    n = ids.shape[1]
    block_mask = create_block_mask(same_branch_or_prompt, None, None, n, n, device=device, _compile=True)
    logits = model(input_ids=ids, position_ids=positions, attention_mask=block_mask, logits_to_keep=G * (R - 1) + 1).logits[0]
    first, rest = logits[:1].float(), logits[1:].float().view(G, R - 1, -1)
    per_branch = torch.cat([first.expand(G, 1, -1), rest], 1)  # [G, R, V]
    logp = per_branch.gather(-1, group.responses.unsqueeze(-1)).squeeze(-1) - per_branch.logsumexp(-1)
    return policy_loss(logp, group.advantages, group.mask)


def shared_prefix_cached(model, group: Group) -> torch.Tensor:
    """Prompt[:-1] once with a cache, then the G branches from that cache
    (repeated along the batch), all under autograd."""
    (P,), (G, R) = group.prompt.shape, group.responses.shape
    cache = model(input_ids=group.prompt[None, :-1], use_cache=True).past_key_values
    for layer in cache.layers:
        _repeat_layer(layer, G)
    ids = torch.cat([group.prompt[-1:].expand(G, 1), group.responses[:, :-1]], 1)
    positions = torch.arange(P - 1, P - 1 + R, device=ids.device)[None].expand(G, -1)
    logits = model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True).logits.float()
    logp = logits.gather(-1, group.responses.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
    return policy_loss(logp, group.advantages, group.mask)


def _repeat_layer(layer, G: int) -> None:
    """Repeat a cache layer G times along the batch, keeping autograd: HF's
    linear-attention layers update their states in place, which would
    overwrite tensors the prompt's backward needs, so the branch pass gets
    functional updates instead."""
    if hasattr(layer, "recurrent_states"):
        conv = layer.conv_states[0].repeat_interleave(G, 0)
        layer.recurrent_states[0] = layer.recurrent_states[0].repeat_interleave(G, 0)
        layer.update_conv_state = lambda new, state_idx=0, **kw: torch.cat([conv, new], -1)
        layer.update_recurrent_state = lambda state, state_idx=0, **kw: state
    else:
        layer.batch_repeat_interleave(G)


class Runner:
    """Builds the step of one mode for one model; `step(group)` runs loss + backward.
    The hybrid's Gated DeltaNet runs LongStraw's operators in the longstraw
    modes and, with `longstraw_operators`, in the eager ones too; else HF's own.
    GLM-5's experts run torch's grouped_mm in bf16 and HF's fallback in
    other dtypes (parity's float32 and float64 runs)."""

    def __init__(self, model, kind: str, mode: str, longstraw_operators: bool = False, context_parallel=None,
                 prefix_chunk_size: int = 8192) -> None:
        self.model, self.kind, self.mode = model, kind, mode
        self.context_parallel = context_parallel  # a process group: the longstraw modes shard the prompt state over it
        self.prefix_chunk_size = prefix_chunk_size
        self.longstraw_operators = longstraw_operators or mode.startswith("longstraw")
        self.compiled: Callable | None = None

    def __enter__(self):
        model = self.model
        if self.mode not in MODES_OF[self.kind]:
            raise ValueError(f"{self.mode} is not built for the {self.kind} slice (modes: {', '.join(MODES_OF[self.kind])})")
        if self.kind in MOE_KINDS:
            self._can_use_grouped_mm = _grouped_mm_fallback_unless_bf16()
        if self.kind in _GATED_DELTA_MODULES:
            module = _GATED_DELTA_MODULES[self.kind]
            self._unbind = qwen3_5.bind() if self.longstraw_operators else _torch_gated_delta(module)
        if self.mode == "eager_ckpt":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.mode == "eager_shared_prefix" and self.kind == "dense":
            model.set_attn_implementation("flex_attention")
        if self.mode.startswith("longstraw"):
            torch._dynamo.reset()
            # the sizes these benchmarks have always measured; left None, the backend would plan them per P
            backend = longstraw.Backend(prompt_grad=self.mode.removeprefix("longstraw_"),
                                        prefix_chunk_size=self.prefix_chunk_size, recompute_layers=False,
                                        context_parallel=self.context_parallel)
            self.compiled = torch.compile(grpo_loss, backend=backend)
        return self

    def __exit__(self, *exc):
        if self.mode == "eager_ckpt":
            self.model.gradient_checkpointing_disable()
        if self.mode == "eager_shared_prefix" and self.kind == "dense":
            self.model.set_attn_implementation("sdpa")
        if self.kind in _GATED_DELTA_MODULES:
            qwen3_5.unbind(self._unbind)
        if self.kind in MOE_KINDS:
            moe_integration._can_use_grouped_mm = self._can_use_grouped_mm
        self.compiled = None
        torch._dynamo.reset()

    def step(self, group: Group) -> torch.Tensor:
        model = self.model
        model.zero_grad(set_to_none=True)
        if self.compiled is not None:
            loss = self.compiled(model, group.input_ids, group.advantages, group.mask, group.responses.shape[1])
        elif self.mode == "eager_shared_prefix":
            loss = (shared_prefix_dense if self.kind == "dense" else shared_prefix_cached)(model, group)
        else:
            loss = eager_step(model, group)
        loss.backward()
        return loss.detach()


_GATED_DELTA_MODULES = {"hybrid": "transformers.models.qwen3_5.modeling_qwen3_5",
                        "hybrid_moe": "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe"}
"""The slices with Gated DeltaNet layers, and the HF module their layers call."""


def _torch_gated_delta(module: str):
    """Eager hybrid runs HF's own PyTorch kernels, whatever HF resolved at import."""
    hf = importlib.import_module(module)
    replaced = {}
    for name in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn"):
        fn = getattr(hf, name)
        replaced[(hf, name)] = fn
        setattr(hf, name, getattr(fn, "__wrapped__", fn))
    return replaced


def _grouped_mm_fallback_unless_bf16() -> Callable:
    """HF picks torch's grouped_mm kernel on CPU and CUDA in every dtype; the
    CPU kernel refuses float64 and torch's own checks of the CUDA kernel
    (its meta function) accept bf16 only. Other dtypes run HF's fallback,
    one matmul per expert (what tests/models/test_moe.py does for float64).
    Returns HF's own choice, to put back."""
    can_use = moe_integration._can_use_grouped_mm

    def only_bf16(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> bool:
        return weight.dtype == torch.bfloat16 and can_use(input, weight, offs)

    moe_integration._can_use_grouped_mm = only_bf16
    return can_use
