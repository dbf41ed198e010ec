"""Property-based parity (hypothesis): random tiny decoders, random groups
and chunk sizes, compiled exact mode against eager in float64 and float32.
The plain decoder varies the rotary fraction, norms, K/V layouts and masks;
HF's Qwen3/Llama vary layers, heads, GQA ratio, head dims and tied
embeddings (their configs ignore a partial rotary factor). TRL's batches
(several prompts, each left-padded its own way, ragged completions, rows
shuffled) run under every runtime schedule the options can ask for (kept
graphs, branch steps of several rows, kept group states, layer-wise
recomputation, LM-head chunks), in both modes, with NaN-filled state,
and so does the integrations' scorer (exact mode, one temperature or one
per row).

Bounded for CI: LONGSTRAW_FUZZ_EXAMPLES examples per property (default 6; a
third of them for the properties over TRL's batches);
set it higher (and LONGSTRAW_FUZZ_SEED to explore other draws) for a long run:

    LONGSTRAW_FUZZ_EXAMPLES=300 pytest tests/contract/test_fuzz_parity.py
"""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, assume, given, seed, settings
from hypothesis import strategies as st

import longstraw
from longstraw.models import qwen3_5

from helpers.compare import assert_close, assert_grads_close
from helpers.harness import assert_parity, compile_loss, compiled_loss_and_grads
from helpers.losses import grpo_loss_f64
from helpers.models_under_test import hf_decoder
from helpers.padding import (
    MODELS, TOL as PADDING_TOL, detached_reference, padded_group, scored_grpo_loss, trl_grpo_loss,
)
from helpers.plain_transformer import make_plain
from helpers.reference import eager_loss_and_grads
from helpers.tiny_models import make_group

EXAMPLES = int(os.environ.get("LONGSTRAW_FUZZ_EXAMPLES", "6"))
SEED = int(os.environ.get("LONGSTRAW_FUZZ_SEED", "0"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FUZZ_BATCHES = settings(FUZZ, max_examples=max(1, EXAMPLES // 3))  # a batch of several prompts compiles longer

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


@st.composite
def trl_batches(draw):
    """TRL's micro-batch of several prompts: prompt i has `lengths[i]` real
    tokens after its own left padding (to the longest), `sizes[i]` rows; each
    completion its own length (at least one token), right-padded to R; the
    rows shuffled. Each prompt's group is `helpers.padding.padded_group`."""
    sizes = draw(st.lists(st.integers(2, 3), min_size=1, max_size=3))  # a prompt of one row is refused
    P = draw(st.integers(2, 24))
    lengths = [draw(st.integers(2, P)) for _ in sizes]
    R = draw(st.integers(1, 6))
    assume(sum(sizes) != P + R)  # static shapes: a batch as long as the sequence is refused (axes not told apart)
    assume(P + R > 4)  # HF's cache pads the hybrid's shorter sequences to its convolution's kernel: refused
    data_seed = draw(st.integers(0, 1000))
    groups = [padded_group(n, P, R, P - length, [draw(st.integers(1, R)) for _ in range(n)], seed=data_seed + i)
              for i, (length, n) in enumerate(zip(lengths, sizes))]
    order = torch.randperm(sum(sizes), generator=torch.Generator().manual_seed(data_seed))
    return tuple(torch.cat(parts)[order] for parts in zip(*groups))


@st.composite
def schedules(draw):
    """Options that choose how the runtime runs a step (None: as planned;
    nothing is planned on the CPU)."""
    return dict(
        prompt_grad=draw(st.sampled_from(["exact", "detached"])),
        prefix_chunk_size=draw(st.integers(1, 28)),
        keep_graphs=draw(st.sampled_from([None, True, False])),
        branch_rows=draw(st.sampled_from([None, 1, 2, 3])),
        keep_group_states=draw(st.sampled_from([None, True])),
        recompute_layers=draw(st.sampled_from([None, True])),
        head_chunk_size=draw(st.sampled_from([None, 1, 2, 256])),
    )


# HF's models cast norms, rotary and (Qwen3.5) the delta rule's gates to float32 inside a float64 model: a
# split of the sequence moves a value by an ulp of float64, and a float32 cast can round it to the next float32.
# With those casts made float64 the hybrid's worst gradient differed by 2e-11 (a drawn case that differed by
# 5e-6 at a gradient 1/70 the size of the largest).
TRL_TOL = {"qwen3": PADDING_TOL, "llama": PADDING_TOL, "qwen3_5": 2e-5}


@seed(SEED)
@FUZZ_BATCHES
@given(family=st.sampled_from(["qwen3", "llama", "qwen3_5"]), batch=trl_batches(), options=schedules(),
       init=st.integers(0, 1000))
def test_trl_batches_under_every_schedule(family, batch, options, init):
    """Float64 parity with eager (exact) or the detached contract through
    HF's cache, whatever the schedule."""
    torch._dynamo.reset()
    model = MODELS[family](seed=init)
    backend = longstraw.Backend(verify_state=True, **options)
    with qwen3_5.bound():
        assert_parity(trl_grpo_loss, backend, detached_reference, model, *batch, tol=TRL_TOL[family])
    assert backend.plans and backend.plans[-1].num_branches == batch[0].shape[0]


SCORER_TOL = 2e-5  # the scorer computes log-probs and entropies in float32 whatever the model's dtype, as TRL does


@seed(SEED)
@FUZZ_BATCHES
@given(family=st.sampled_from(["qwen3", "qwen3_5"]), batch=trl_batches(), options=schedules(),
       per_row=st.booleans(), init=st.integers(0, 1000))
def test_the_scorer_under_every_schedule(family, batch, options, per_row, init):
    """The integrations' scorer (a temperature, or one per row as verl
    samples) matches eager in exact mode whatever the schedule."""
    torch._dynamo.reset()
    model = MODELS[family](seed=init)
    rows = batch[0].shape[0]
    temperature = torch.linspace(0.5, 1.5, rows, dtype=torch.float64) if per_row else 0.7
    backend = longstraw.Backend(verify_state=True, **{**options, "prompt_grad": "exact"})
    with qwen3_5.bound():
        assert_parity(scored_grpo_loss, backend, None, model, *batch, temperature, tol=SCORER_TOL)
    assert backend.plans and backend.plans[-1].num_branches == rows
