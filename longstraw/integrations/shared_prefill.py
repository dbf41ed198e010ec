"""HF `generate` over a GRPO batch, each distinct prompt prefilled once.

TRL's sampler repeats every prompt `num_generations` times, and HF's
`generate` prefills every row: G forwards over the same prompt, and G rows of
its activations at once (at 64K tokens and 8 rows, a 10.6 GiB MLP
activation; left padding adds an explicit `[B, 1, P, P]` attention mask).
`generate_with_shared_prefill` prefills each distinct prompt alone, without
its left padding (so no explicit mask), up to its last token, lays the K/V
out as the padded batch would hold them (zeros where the attention mask
hides padding), and hands that cache to `generate`, which runs the last
prompt token and the sampling as before. The tokens are the same up to
rounding: every position's keys, values and rotary positions are those of
the padded batch.

Linear-attention layers (Qwen3.5's Gated DeltaNet: a convolution window and
a recurrent matrix) hold a state with no positions: the prompt's, copied to
each row of its group, is the padded batch's too, since HF zeroes the hidden
states at padding, which leaves both the window and the matrix as they
start. Caches this cannot lay out (sliding windows, static or quantized
caches, a model's own cache class such as MiniMax's or Mamba's
`cache_params`), inputs other than token ids and an attention mask, and
batches with no repeated prompt run HF's `generate` unchanged; the reason
is logged at INFO on `longstraw.integrations.shared_prefill`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import DynamicCache, cache_utils
from transformers.cache_utils import DynamicLayer

log = logging.getLogger("longstraw.integrations.shared_prefill")

LinearAttentionLayer = getattr(cache_utils, "LinearAttentionLayer", None)  # absent from older transformers
LAID_OUT = tuple(t for t in (DynamicLayer, LinearAttentionLayer) if t is not None)


def generate_with_shared_prefill(
    model: torch.nn.Module, generate: Callable[..., Any], input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None, **kwargs: Any,
) -> Any:
    """`generate(input_ids=..., attention_mask=..., **kwargs)`, with the
    prompt's K/V prefilled once per distinct prompt row (module docstring)."""
    reason = _not_shared(model, input_ids, attention_mask, kwargs)
    if reason is None:
        prompts, rows_of = torch.unique(torch.cat([input_ids, attention_mask], 1), dim=0, return_inverse=True)
        reason = "no prompt repeats in the batch" if prompts.shape[0] == input_ids.shape[0] else None
    if reason is not None:
        log.info("generating without a shared prefill: %s", reason)
        return generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    width = input_ids.shape[1]
    caches = [_prefill(model, p[:width], p[width:]) for p in prompts]  # one per distinct prompt
    cache = _batched(model, caches, width, rows_of)
    return generate(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, **kwargs)


@contextlib.contextmanager
def shared_prefill(model: torch.nn.Module) -> Iterator[None]:
    """Within: `model.generate` is `generate_with_shared_prefill` over the
    model's own `generate`."""
    model.generate = functools.partial(generate_with_shared_prefill, model, model.generate)
    try:
        yield
    finally:
        del model.generate


def _not_shared(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                kwargs: dict[str, Any]) -> str | None:
    """Why this call cannot share its prefill (besides having no repeated prompt), or None."""
    extra = sorted(k for k, v in kwargs.items() if v is not None and k not in ("generation_config",))
    if extra:
        return f"inputs besides input_ids and attention_mask: {extra}"
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    if getattr(config, "cache_implementation", None) is not None:
        return f"generation_config.cache_implementation={config.cache_implementation!r}"
    if (getattr(config, "num_beams", None) or 1) != 1 or (getattr(config, "num_return_sequences", None) or 1) != 1:
        return "beam search or num_return_sequences > 1"
    settings = (config, getattr(model, "generation_config", None), model.config)  # generate's order of precedence
    if next((s.use_cache for s in settings if getattr(s, "use_cache", None) is not None), True) is False:
        return "generate runs without a cache (use_cache=False)"
    if attention_mask is None or input_ids.ndim != 2 or input_ids.shape[1] < 2:
        return "no 2-D attention mask over prompts of two tokens or more"
    real = attention_mask.bool()
    if not bool((real[:, 1:] >= real[:, :-1]).all()) or not bool(real[:, -2:].all()):
        return "prompts are not left-padded with two real tokens or more"
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT passes keywords through
    parameters = inspect.signature(base.forward).parameters
    if "logits_to_keep" not in parameters:
        return f"{type(base).__name__}.forward takes no logits_to_keep"
    if "past_key_values" not in parameters:  # Mamba's `cache_params`
        return f"{type(base).__name__}.forward takes no past_key_values"
    dynamic = getattr(type(base), "_supports_default_dynamic_cache", None)  # HF's own test, where it has one
    if dynamic is not None and not dynamic():
        return f"{type(base).__name__} keeps a cache of its own class, not a DynamicCache"
    layers = DynamicCache(config=model.config).layers
    kinds = sorted({type(layer).__name__ for layer in layers if type(layer) not in LAID_OUT})
    if kinds:
        return f"the model's cache holds {kinds} layers (full-attention K/V and linear-attention state are laid out)"
    return None


def _prefill(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> DynamicCache:
    """The K/V of one prompt's real tokens but its last, run alone, at the
    positions `generate` gives them (counted from the first real token)."""
    tokens = ids[mask.bool()][:-1]  # [n - 1]
    cache = DynamicCache(config=model.config)
    positions = torch.arange(tokens.shape[0], device=ids.device)[None]
    model(input_ids=tokens[None], position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache


def _batched(model: torch.nn.Module, caches: list[DynamicCache], width: int, rows_of: torch.Tensor) -> DynamicCache:
    """One cache over the batch's rows: row b holds its prompt's K/V at its
    real positions and zeros at its padding (masked in every step), over the
    first `width - 1` positions, the part `generate` then does not run, and
    its prompt's linear-attention state."""
    cache = DynamicCache(config=model.config)
    for index, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            keys, values = (torch.cat([_left_padded(getattr(c.layers[index], name), width - 1) for c in caches])[rows_of]
                            for name in ("keys", "values"))  # [B, heads, width - 1, head_dim]
            layer.update(keys, values)
            continue
        for i in range(layer.number_of_states):
            prefilled = [c.layers[index] for c in caches]
            conv = torch.cat([p.conv_states[i] for p in prefilled])[rows_of] \
                if prefilled[0].is_conv_states_initialized[i] else None  # [B, channels, kernel]
            recurrent = torch.cat([p.recurrent_states[i] for p in prefilled])[rows_of] \
                if prefilled[0].is_recurrent_states_initialized[i] else None  # [B, heads, d_k, d_v]
            layer.lazy_initialization(conv_states=conv, recurrent_states=recurrent, state_idx=i,
                                      conv_kernel_size=None if conv is None else conv.shape[-1])
            if conv is not None:
                layer.conv_states[i].copy_(conv)
            if recurrent is not None:
                layer.recurrent_states[i].copy_(recurrent)
            layer.has_previous_state[i] = prefilled[0].has_previous_state[i]
    return cache


def _left_padded(x: torch.Tensor, length: int) -> torch.Tensor:
    """`x` ([1, heads, n, head_dim]) behind zeros, `length` positions in all."""
    return torch.nn.functional.pad(x, (0, 0, length - x.shape[-2], 0))
