"""Packed (padding-free) rows scored through LongStraw
(longstraw/integrations/packed.py): float64 parity of log-probs, entropies
and gradients with eager's packed run (dense, MLA) or with each sequence
run alone (the Qwen3.5 hybrid, whose HF recurrence without fla mixes packed
sequences), under NaN-filled uninitialised memory; groups not adjacent in
the row; bad packing refused naming the sequence, `.grad` untouched."""

from __future__ import annotations

import contextlib

import pytest
import torch

import longstraw
from longstraw.errors import InputError
from longstraw.integrations.packed import PackedSegments, packed_logps_and_entropies
from longstraw.integrations.scoring import completion_logps_and_entropies
from longstraw.models import qwen3_5

from conftest import raises_longstraw
from helpers.compare import assert_close, assert_grads_close
from helpers.parity import deterministic_algorithms
from helpers.reference import with_fresh_grads
from helpers.tiny_models import make_deepseek_v3, make_qwen3, make_qwen3_5

TOL = 1e-6  # HF's norms and RoPE round through float32 (helpers.tiny_models.parity_tol)
# (prompt, completion length) in packing order: the two prompts' sequences interleaved
LAYOUT = [(0, 3), (1, 4), (0, 5), (1, 2), (0, 4)]


def packed_row(prompt_lengths=(7, 5), layout=LAYOUT, seed=0, vocab=64):
    """input_ids, position_ids, completion_mask [1, N] of `layout`'s sequences, and their bounds."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (n,), generator=g) for n in prompt_lengths]
    ids, positions, marked, bounds = [], [], [], []
    for prompt, completion in layout:
        sequence = torch.cat([prompts[prompt], torch.randint(0, vocab, (completion,), generator=g)])
        start = sum(len(s) for s in ids)
        bounds.append((start, start + len(sequence), len(prompts[prompt])))
        ids.append(sequence)
        positions.append(torch.arange(len(sequence)))
        marked.append(torch.arange(len(sequence)) >= len(prompts[prompt]))
    return torch.cat(ids)[None], torch.cat(positions)[None], torch.cat(marked)[None], bounds


def token_scores(logits, ids, marked):
    """(log-prob, entropy) of each marked token [1, N] from logits [1, N, V] at the positions before it."""
    logp_all = torch.log_softmax(logits[:, :-1].float(), -1)  # float32, as the scorer (TRL's) computes it
    logps = torch.zeros(ids.shape, dtype=logp_all.dtype)
    entropies = torch.zeros(ids.shape, dtype=logp_all.dtype)
    logps[:, 1:] = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
    entropies[:, 1:] = -(logp_all.exp() * logp_all).sum(-1)
    return torch.where(marked, logps, 0.0), torch.where(marked, entropies, 0.0)


def eager_packed(model, ids, positions, marked, bounds):
    """HF's own packed run: one row, its mask built from the restarting position ids."""
    return token_scores(model(input_ids=ids, position_ids=positions).logits, ids, marked)


def eager_alone(model, ids, positions, marked, bounds):
    """Each sequence run alone, its results at its packed positions."""
    logps, entropies = [], []
    for start, stop, _ in bounds:
        part = slice(start, stop)
        got = token_scores(model(input_ids=ids[:, part]).logits, ids[:, part], marked[:, part])
        logps.append(got[0])
        entropies.append(got[1])
    return torch.cat(logps, 1), torch.cat(entropies, 1)


def loss_of(scores, weights):
    logps, entropies = scores
    return (logps * weights).sum() + 0.1 * entropies.sum()


MODELS = {"dense": (make_qwen3, eager_packed, contextlib.nullcontext),
          "latent": (make_deepseek_v3, eager_packed, contextlib.nullcontext),
          "hybrid": (make_qwen3_5, eager_alone, qwen3_5.bound)}  # eager on LongStraw's kernels, as the family suite


@pytest.mark.parametrize("kind", ["dense", "latent", "hybrid"])
def test_packed_row_matches_eager(kind):
    """Log-probs, entropies and gradients of a loss over them, against eager
    on the same packed row, with the two prompts' sequences interleaved."""
    make, reference, kernels = MODELS[kind]
    model = make()
    model.config.use_cache = False  # HF builds the packed-sequence mask only without a cache
    ids, positions, marked, bounds = packed_row()
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    backend = longstraw.Backend(prefix_chunk_size=4, verify_state=True)
    scorer = torch.compile(completion_logps_and_entropies, backend=backend, dynamic=True)
    got = {}

    def compiled():
        got["scores"] = packed_logps_and_entropies(scorer, model, ids, marked, position_ids=positions)
        loss = loss_of(got["scores"], weights)
        loss.backward()
        return loss

    def eager():
        got["want"] = reference(model, ids, positions, marked, bounds)
        loss = loss_of(got["want"], weights)
        loss.backward()
        return loss

    with kernels():
        with deterministic_algorithms(True):
            got_loss, got_grads = with_fresh_grads(model, compiled)
        want_loss, want_grads = with_fresh_grads(model, eager)
    assert len(backend.plans) == 1 and not backend.fallbacks
    assert_close(got["scores"][0], got["want"][0], TOL, "log-probs")
    assert_close(got["scores"][1], got["want"][1], TOL, "entropies")
    assert_close(got_loss, want_loss, TOL, "loss")
    assert_grads_close(got_grads, want_grads, TOL)


@pytest.mark.parametrize("mode", ["exact", pytest.param("detached", marks=pytest.mark.slow)])
def test_packed_and_padded_give_the_same_loss_and_gradients(mode):
    """The packed row, and the same sequences as TRL's padded batch scored
    directly, through one compiled scorer."""
    model = make_qwen3()
    ids, positions, marked, _ = packed_row()
    segments = PackedSegments.from_position_ids(positions, marked, ids)
    layout = segments.padded(ids)
    scorer = torch.compile(completion_logps_and_entropies, backend=longstraw.Backend(prompt_grad=mode), dynamic=True)
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def packed():
        loss = loss_of(packed_logps_and_entropies(scorer, model, ids, marked, position_ids=positions), weights)
        loss.backward()
        return loss

    def padded():
        logps, entropies = scorer(model, layout.input_ids, layout.attention_mask, layout.logits_to_keep, 1.0,
                                  layout.position_ids)
        loss = loss_of((segments.packed(logps), segments.packed(entropies)), weights)
        loss.backward()
        return loss

    got_loss, got = with_fresh_grads(model, packed)
    want_loss, want = with_fresh_grads(model, padded)
    assert_close(got_loss, want_loss, 0.0, "loss")
    assert_grads_close(got, want, 0.0)


def test_the_padded_layout():
    """Prompts left-padded, completions right-padded, each sequence at its
    own positions from 0; `packed` puts each completion value back at its token."""
    ids, positions, marked, bounds = packed_row(prompt_lengths=(3, 2), layout=[(0, 2), (1, 1), (0, 1), (1, 2)])
    segments = PackedSegments.from_position_ids(positions, marked, ids)
    assert segments.starts == (0, 5, 8, 12) and segments.prompt_lengths == (3, 2, 3, 2)
    assert segments.completion_lengths == (2, 1, 1, 2)
    layout = segments.padded(ids)
    assert layout.logits_to_keep == 2 and layout.input_ids.shape == (4, 5)
    assert layout.attention_mask.tolist() == [[1, 1, 1, 1, 1], [0, 1, 1, 1, 0], [1, 1, 1, 1, 0], [0, 1, 1, 1, 1]]
    assert layout.position_ids[1].tolist() == [0, 0, 1, 2, 3] and layout.position_ids[0].tolist() == [0, 1, 2, 3, 4]
    assert layout.input_ids[1, 1:4].tolist() == ids[0, 5:8].tolist()
    values = torch.arange(8, dtype=torch.float64).reshape(4, 2) + 1
    assert segments.packed(values).tolist() == [[0, 0, 0, 1, 2, 0, 0, 3, 0, 0, 0, 5, 0, 0, 7, 8]]
    by_cuts = PackedSegments.from_cu_seqlens(torch.tensor([0, 5, 8, 12, 16]), marked, ids, positions)
    assert by_cuts == segments


@pytest.mark.parametrize("fault,match", [
    ("alone", r"packed sequence 1 \(tokens 10\.\.19\) has a prompt \(5 tokens\) that no other sequence"),
    ("late start", r"packed position ids must start at 0"),
    ("gap", r"packed sequence 1 \(tokens 10\.\.19\) is not one sequence: .*token 15 has position 7, not 5"),
    ("no completion", r"packed sequence 2 \(tokens 20\.\.31\) has no completion token"),
    ("cuts", r"cu_seqlens \[0, 10, 22, 32, 40\] and the position ids' restarts \[0, 10, 20, 32\]"),
])
def test_bad_packing_is_refused_naming_the_sequence(fault, match):
    """A prompt no other sequence shares, position ids that do not start at 0
    or skip inside a sequence, a sequence with nothing marked, cu_seqlens
    that disagree with the position ids: refused before any model call."""
    layout = [(0, 3), (1, 5), (0, 4), (1, 2)] if fault == "alone" else LAYOUT[:4]
    ids, positions, marked, bounds = packed_row(prompt_lengths=(7, 5) if fault == "alone" else (7, 6),
                                                layout=layout)
    cu_seqlens = None
    if fault == "alone":
        ids[0, bounds[3][0]] += 1  # the last sequence's prompt differs from the second's
    elif fault == "late start":
        positions = positions + 1
    elif fault == "gap":
        positions[0, 15:bounds[1][1]] += 2
    elif fault == "no completion":
        marked[0, bounds[2][0]:bounds[2][1]] = False
    else:
        cu_seqlens = torch.tensor([0, 10, 22, 32, 40])
    model = make_qwen3()
    with raises_longstraw(match):
        scorer = torch.compile(completion_logps_and_entropies, backend="longstraw", dynamic=True)
        packed_logps_and_entropies(scorer, model, ids, marked, position_ids=positions, cu_seqlens=cu_seqlens)
    assert all(p.grad is None for p in model.parameters())


def test_segments_from_prompt_lengths():
    """verl's rows, whose prompt lengths are known: the same segments as the
    completion mask gives; a sequence without a completion or a prompt, or a
    prompt no other sequence shares, refused naming it."""
    ids, positions, marked, bounds = packed_row()
    cu_seqlens = torch.tensor([start for start, _, _ in bounds] + [bounds[-1][1]])
    prompts = [prompt for _, _, prompt in bounds]
    assert (PackedSegments.from_prompt_lengths(cu_seqlens, prompts, ids)
            == PackedSegments.from_cu_seqlens(cu_seqlens, marked, ids))
    (start0, stop0, _), (start2, stop2, _) = bounds[0], bounds[2]
    first, third = rf"sequence 0 \(tokens {start0}\.\.{stop0 - 1}\)", rf"sequence 2 \(tokens {start2}\.\.{stop2 - 1}\)"
    for lengths, match in (([*prompts[:2], stop2 - start2, *prompts[3:]], third + " has no completion token"),
                           ([0, *prompts[1:]], first + " has no prompt token"),
                           ([prompts[0] - 1, *prompts[1:]], first + rf" has a prompt \({prompts[0] - 1} tokens\)")):
        with pytest.raises(InputError, match=match):
            PackedSegments.from_prompt_lengths(cu_seqlens, lengths, ids)
