"""Property-based parity (hypothesis): random tiny decoders, random groups
and chunk sizes, compiled exact mode against eager in float64 and float32.
The plain decoder varies the rotary fraction, norms, K/V layouts and masks;
HF's Qwen3/Llama vary layers, heads, GQA ratio, head dims and tied
embeddings (their configs ignore a partial rotary factor).

Bounded for CI: LONGSTRAW_FUZZ_EXAMPLES examples per property (default 6);
set it higher (and LONGSTRAW_FUZZ_SEED to explore other draws) for a long run:

    LONGSTRAW_FUZZ_EXAMPLES=300 pytest tests/contract/test_fuzz_parity.py
"""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

import longstraw

from helpers.compare import assert_close, assert_grads_close
from helpers.harness import compile_loss, compiled_loss_and_grads
from helpers.losses import grpo_loss_f64
from helpers.models_under_test import hf_decoder
from helpers.plain_transformer import make_plain
from helpers.reference import eager_loss_and_grads
from helpers.tiny_models import make_group

EXAMPLES = int(os.environ.get("LONGSTRAW_FUZZ_EXAMPLES", "6"))
SEED = int(os.environ.get("LONGSTRAW_FUZZ_SEED", "0"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# float64 is exact up to reassociation; float32 rounds attention and norms differently per chunk
TOL = {torch.float64: 1e-9, torch.float32: 2e-4}
HF_TOL = {torch.float64: 1e-6, torch.float32: 2e-4}
# gradients that are zero in exact arithmetic (q/k when every query sees one key) are round-off:
# measure them against this fraction of the largest gradient norm (compare.assert_grads_close)
FLOOR = {torch.float64: 1e-6, torch.float32: 1e-3}


@st.composite
def groups(draw):
    G = draw(st.integers(1, 4))
    P = draw(st.integers(1, 40))
    R = draw(st.integers(1, 9))
    chunk = draw(st.integers(1, 48))
    pad = draw(st.booleans())
    return G, P, R, chunk, pad


@st.composite
def plain_decoders(draw):
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([2, 4, 8]))
    return dict(
        num_layers=draw(st.integers(1, 3)),
        num_kv_heads=kv_heads,
        num_heads=kv_heads * draw(st.sampled_from([1, 2, 3])),
        head_dim=head_dim,
        rotary_dim=draw(st.sampled_from([0, *range(2, head_dim, 2)])),  # 0: all dims rotate
        hidden_size=draw(st.sampled_from([8, 16, 24])),
        norm=draw(st.sampled_from(["rms", "layer"])),
        kv_mode=draw(st.sampled_from(["gqa", "repeat", "repeat_interleave"])),
        mask=draw(st.sampled_from(["causal", "explicit"])),
    )


def check(model, dtype, G, P, R, chunk, pad, tol):
    torch._dynamo.reset()  # every example compiles afresh (Dynamo's cache limit would fall back to eager)
    model = model.to(dtype)
    prompt, responses, advantages, mask = make_group(G, P, R, pad=pad)
    args = (prompt, responses, advantages.to(dtype), mask.to(dtype))
    backend = longstraw.Backend(prefix_chunk_size=chunk)
    got_loss, got = compiled_loss_and_grads(compile_loss(grpo_loss_f64, backend), model, *args)
    want_loss, want = eager_loss_and_grads(grpo_loss_f64, model, *args)
    assert backend.plans and backend.plans[-1].num_branches == G  # the backend ran, not an eager fallback
    assert_close(got_loss, want_loss, tol, "loss")
    assert_grads_close(got, want, tol, floor=FLOOR[dtype])


@seed(SEED)
@FUZZ
@given(cfg=plain_decoders(), group=groups(), dtype=st.sampled_from([torch.float64, torch.float32]), init=st.integers(0, 1000))
def test_plain_decoders(cfg, group, dtype, init):
    check(make_plain(seed=init, **cfg), dtype, *group, TOL[dtype])


@seed(SEED)
@FUZZ
@given(
    family=st.sampled_from(["qwen3", "llama"]),
    layers=st.integers(1, 3),
    kv_heads=st.sampled_from([1, 2]),
    ratio=st.sampled_from([1, 2]),
    head_dim=st.sampled_from([4, 8]),
    tied=st.booleans(),
    group=groups(),
    dtype=st.sampled_from([torch.float64, torch.float32]),
)
def test_hf_decoders(family, layers, kv_heads, ratio, head_dim, tied, group, dtype):
    model = hf_decoder(family, layers, kv_heads, kv_heads * ratio, head_dim, tied)
    check(model, dtype, *group, HF_TOL[dtype])
