"""Sliding-window attention: `longstraw.analysis.mask.band_of` proves a mask is a
window from the operators that build it, and `SlidingWindowAttentionPass`
keeps only the last W-1 keys and values (fixed bytes, none per position),
with eager parity in both modes for Mistral and Gemma3's alternating layers."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from transformers import masking_utils

import longstraw
from longstraw.analysis.mask_bands import band_of

from helpers.compare import assert_close, assert_grads_close
from helpers.harness import compile_loss, compiled_loss_and_grads
from helpers.losses import grpo_loss_f64
from helpers.reference import detached_at_attention, eager_loss_and_grads
from helpers.tiny_models import make_group, make_mistral

TOL = 1e-6  # HF norms and RoPE round through float32


def _mask_node(build) -> torch.fx.Node:
    """The node of `build(x)`'s result in Dynamo's graph, with the values
    the backend records (`longstraw_value`)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    torch.compile(build, backend=backend)(torch.ones(12))
    graph = graphs[0].graph
    for node in graph.nodes:
        node.meta["longstraw_value"] = node.meta.get("example_value")
    (output,) = graph.find_nodes(op="output")
    return output.args[0][0]


def _rows_cols(start: int = 0):
    return torch.arange(start, start + 12)[:, None], torch.arange(start, start + 12)[None, :]


@pytest.mark.parametrize(
    "build, band",
    [
        (lambda x: (lambda i, j: j <= i)(*_rows_cols()), (0, math.inf)),
        (lambda x: (lambda i, j: (j <= i) & (j > i - 4))(*_rows_cols()), (0, 3)),
        (lambda x: (lambda i, j: (j > i - 4) & (i >= j))(*_rows_cols(5)), (0, 3)),  # positions from 5
        (lambda x: (lambda i, j: (j <= i) | (j < 3))(*_rows_cols()), None),  # a prefix-LM mask
        (lambda x: (lambda i, j: (j <= i).float())(*_rows_cols()), None),  # a float mask is added, not applied
        (lambda x: (lambda i, j: (j <= i) & (x[None, :] > 0))(*_rows_cols()), None),  # reads an input
        (lambda x: (lambda i, j: (j <= 2 * i))(*_rows_cols()), None),  # not a function of row - column
    ],
    ids=["causal", "window-4", "window-from-5", "prefix-lm", "float", "input", "not-a-band"],
)
def test_band_of(build, band):
    assert band_of(_mask_node(build)) == band


LLAMA = transformers.LlamaConfig(num_hidden_layers=1, attn_implementation="sdpa")


def _hf_mask(positions):
    """HF's causal mask without a cache or an attention_mask: traced, it
    cannot skip its packed-sequence check of the position ids, so the mask
    compares positions remapped through them and their sequence numbers
    (`cumsum(diff(positions) != 1)`)."""
    return lambda x: masking_utils.create_causal_mask(
        config=LLAMA, inputs_embeds=x.view(1, 12, 1), attention_mask=None, past_key_values=None,
        position_ids=positions(x), allow_is_causal_skip=False)


@pytest.mark.parametrize(
    "positions, band",
    [
        (lambda x: torch.arange(12)[None], (0, math.inf)),
        (lambda x: torch.arange(12)[None] + 3, (0, math.inf)),  # counting up from 3: still one sequence
        (lambda x: torch.arange(12)[None] % 6, None),  # two packed sequences
        (lambda x: x.long().cumsum(-1)[None], None),  # read from an input
    ],
    ids=["arange", "arange-from-3", "packed", "input"],
)
def test_band_of_hf_mask_without_cache(positions, band):
    assert band_of(_mask_node(_hf_mask(positions))) == band


def _plan_with_parity(model: torch.nn.Module, **options) -> longstraw.GroupPlan:
    """The compiled loss and every gradient equal eager's (the detached
    reference in detached mode) on a padded group; returns the plan."""
    group = make_group(3, 30, 9, vocab=64, pad=True)
    backend = longstraw.Backend(**options)
    got_loss, got = compiled_loss_and_grads(compile_loss(grpo_loss_f64, backend), model, *group)
    reference = eager_loss_and_grads if options["prompt_grad"] == "exact" else detached_at_attention
    want_loss, want = reference(grpo_loss_f64, model, *group)
    assert_close(got_loss, want_loss, TOL)
    assert_grads_close(got, want, TOL)
    return backend.plans[-1]


def test_disabling_the_window_pass_by_name_keeps_every_position():
    """`disable_passes` leaves the sliding-window pass out: the causal
    attention pass, which it overrides, takes its layers, keeping every
    prompt position's K/V, with eager's gradients still."""
    plan = _plan_with_parity(make_mistral(window=5), prompt_grad="exact", prefix_chunk_size=8,
                             disable_passes=["sliding_window_attention"])
    assert {p.name for p in plan.partition.claims.values()} == {"causal_attention"}
    assert plan.state_bytes_per_position > 0 and plan.state_fixed_bytes == 0


@pytest.mark.parametrize("mode,chunk", [  # in CI each mode and each chunk size once; `-m slow` the rest
    ("exact", 8), ("detached", 64),
    pytest.param("exact", 64, marks=pytest.mark.slow), pytest.param("detached", 8, marks=pytest.mark.slow),
])
def test_mistral_parity_with_fixed_state(mode, chunk):
    plan = _plan_with_parity(make_mistral(window=5), prompt_grad=mode, prefix_chunk_size=chunk, verify_state=True)
    assert {p.name for p in plan.partition.claims.values()} == {"sliding_window_attention"}
    assert plan.state_bytes_per_position == 0
    # per layer: the last 4 positions of K and V (the 2 K/V heads, before HF's repeat_kv to the 4 query heads;
    # 8 + 8 values) and a flag, float64
    assert plan.state_fixed_bytes == 2 * 2 * 4 * (8 + 8 + 1) * 8


def test_mistral_without_the_cache():
    """`use_cache=False`: HF's window mask then goes through its
    packed-sequence check of the position ids, which `band_of` follows, so
    the state is still the last W-1 keys and values (before: full K/V)."""
    model = make_mistral(window=5)
    model.config.use_cache = False
    plan = _plan_with_parity(model, prompt_grad="exact", prefix_chunk_size=8, verify_state=True)
    assert {p.name for p in plan.partition.claims.values()} == {"sliding_window_attention"}
    assert plan.state_bytes_per_position == 0


def test_a_window_wider_than_the_sequence_is_plain_causal_attention():
    model, group = make_mistral(window=64), make_group(2, 20, 5, vocab=64)
    backend = longstraw.Backend()
    compiled_loss_and_grads(compile_loss(grpo_loss_f64, backend), model, *group)
    plan = backend.plans[-1]
    assert {p.name for p in plan.partition.claims.values()} == {"causal_attention"}
    assert plan.state_bytes_per_position > 0


@pytest.mark.parametrize("mode", ["exact", pytest.param("detached", marks=pytest.mark.slow)])
def test_gemma3_alternating_sliding_and_full_layers(mode):
    config = transformers.Gemma3TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=6, layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    plan = _plan_with_parity(transformers.Gemma3ForCausalLM(config).double(), prompt_grad=mode, prefix_chunk_size=8)
    kinds = sorted(slot.kind for slot in plan.partition.slots)
    assert kinds == ["carry", "sequence", "sequence"]  # the sliding layer's window; the full layer's K and V
