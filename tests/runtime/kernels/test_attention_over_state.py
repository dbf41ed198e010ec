"""Attention over the prompt state's buffers (`longstraw/runtime/kernels/attention_over_state.py`):
`AttentionOverState`, `AttentionOverSpan` and `RowsOverState` are softmax attention over
the prompt's keys and the step's own (float64 outputs and dQ, dK, dV, d(state), d(sinks)
against autograd through a plain reference), with key blocks of one position, left padding
before `first` never read (NaN there), learned sinks and a mask block; the causal forward
operator's registration and FLOP count; the capture's kept outputs read back, and refused
by `verify_state` where the reverse pass differs."""

from __future__ import annotations

import pytest
import torch
from torch import fx
from torch.utils.flop_counter import FlopCounterMode

from longstraw.analysis.slots import SlotKind, StateSlot
from longstraw.runtime import mask_block
from longstraw.runtime.host_offload import HostAttentionOutputs
from longstraw.runtime.kernels import attention
from longstraw.runtime.kernels.attention_over_state import (
    AttentionOverSpan, AttentionOverState, RowsOverState, sink_grad, with_sinks,
)
from longstraw.runtime.prompt_state import PromptState, StepContext

from conftest import raises_longstraw

HEADS, KV_HEADS, DIM, VDIM = 4, 2, 8, 6
SCALE = 0.3


def _state(prompt: int, room: int, verify: bool = False, kept: HostAttentionOutputs | None = None) -> PromptState:
    """K and V slots [1, KV_HEADS, positions, DIM / VDIM] with room for `room` more positions, d(state) allocated;
    `verify`: buffers start NaN."""
    graph = fx.Graph()
    slots = [StateSlot(i, SlotKind.SEQUENCE, graph.placeholder(name), 2, 0, (1, KV_HEADS, prompt, dim), torch.float64,
                       f"attention:{name}") for i, (name, dim) in enumerate([("k", DIM), ("v", VDIM)])]
    state = PromptState(slots, capacity=prompt + room, prefix_len=prompt, device=torch.device("cpu"), verify=verify,
                        attention_outputs=kept)
    state.allocate_grads()
    return state


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _captured(state: PromptState, first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt's keys and values, written from `first` on (the buffers before it left as they are)."""
    prompt = state.prefix_len
    keys, values = _rand(1, KV_HEADS, prompt, DIM, seed=1), _rand(1, KV_HEADS, prompt, VDIM, seed=2)
    capture = StepContext(state, first, prompt - first, False)
    capture.write(0, keys[..., first:, :])
    capture.write(1, values[..., first:, :])
    return keys.requires_grad_(), values.requires_grad_()


def _own(state: PromptState, o: int, n: int, rows: int = 1) -> tuple[StepContext, list[torch.Tensor]]:
    """A branch step of `rows` rows at `[o, o+n)` and its leaves q [rows, HEADS, n, DIM], k, v
    [rows, KV_HEADS, n, DIM / VDIM]; a one-row step's keys and values written to the state, as
    the step graph does before its attention."""
    q, k, v = (_rand(rows, h, n, d, seed=s).requires_grad_()
               for s, (h, d) in enumerate([(HEADS, DIM), (KV_HEADS, DIM), (KV_HEADS, VDIM)]))
    step = StepContext(state, o, n, True, rows=rows)
    step.write(0, k)
    step.write(1, v)
    return step, [q, k, v]


def _assert_gradients(out, want_out, leaves, prompt, state, names):
    """`out` is `want_out`, and so are its gradients: of `leaves`, and of the `prompt`'s keys and values in d(state)."""
    grad_out = _rand(*out.shape, seed=9)
    got = [*torch.autograd.grad(out, leaves, grad_out), state.grads[0], state.grads[1]]
    want = torch.autograd.grad(want_out, [*leaves, *prompt], grad_out)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    for name, a, b in zip([*names, "(state k)", "(state v)"], got, want):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12, msg=f"d{name}")


def _reference(q, keys, values, allowed, sinks=None):
    """softmax(q k^T * SCALE) v over the keys `allowed` [n, T], query head j reading key head
    j // (Hq / Hkv); with `sinks`, one more logit per query head whose value is zero."""
    group = q.shape[1] // keys.shape[1]
    s = (q @ keys.repeat_interleave(group, 1).transpose(-1, -2)) * SCALE
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.view(1, -1, 1, 1).expand(*s.shape[:-1], 1)], -1)
    p = torch.softmax(s, -1)[..., :keys.shape[-2]]
    return p @ values.repeat_interleave(group, 1)


def _causal(n: int, o: int, first: int = 0) -> torch.Tensor:
    cols, rows = torch.arange(o + n)[None, :], torch.arange(o, o + n)[:, None]
    return (cols <= rows) & (cols >= first)


@pytest.mark.parametrize("block_scores", [1, 1 << 24], ids=["one-key-blocks", "one-block"])
@pytest.mark.parametrize("first", [0, 2], ids=["unpadded", "left-padded"])
def test_a_step_attends_causally_over_the_state_and_its_own_keys(block_scores, first, monkeypatch):
    """A branch of 3 positions after a prompt of 5 (GQA, 4 query heads over 2): output and
    dQ, dK, dV equal softmax attention's, the prompt's key and value gradients land in
    d(state). `first` 2: the buffers' positions before it hold NaN, and are never read."""
    monkeypatch.setattr(attention, "MATH_BLOCK_SCORES", block_scores)
    o, n = 5, 3
    state = _state(o, n, verify=True)
    prompt_k, prompt_v = _captured(state, first)
    step, (q, k, v) = _own(state, o, n)
    out = AttentionOverState.apply(step, q, k, v, None, 0, 1, SCALE, first, None)
    want_out = _reference(q, torch.cat([prompt_k, k], -2), torch.cat([prompt_v, v], -2), _causal(n, o, first))
    _assert_gradients(out, want_out, [q, k, v], [prompt_k, prompt_v], state, "qkv")
    assert not state.grads[0][..., :first, :].any() and not state.grads[1][..., :first, :].any()


def test_sinks_are_one_more_logit_of_value_zero():
    """Learned sinks (one per query head): output, dQ, dK, dV, d(state) and d(sinks)
    equal the softmax with the sink's logit appended."""
    o, n = 4, 3
    state = _state(o, n)
    prompt_k, prompt_v = _captured(state, 0)
    step, (q, k, v) = _own(state, o, n)
    sinks = _rand(HEADS, seed=7).requires_grad_()
    out = AttentionOverState.apply(step, q, k, v, None, 0, 1, SCALE, 0, sinks)
    want_out = _reference(q, torch.cat([prompt_k, k], -2), torch.cat([prompt_v, v], -2), _causal(n, o), sinks)
    _assert_gradients(out, want_out, [q, k, v, sinks], [prompt_k, prompt_v], state, ["q", "k", "v", "sinks"])


def test_a_row_that_sees_no_key_keeps_output_zero_under_a_sink():
    out = torch.zeros(1, 2, 1, 3, dtype=torch.float64)
    lse = torch.full((1, 2, 1), float("-inf"), dtype=torch.float64)
    sinks = torch.tensor([0.5, -1.0], dtype=torch.float64)
    merged, total = with_sinks(out, lse, sinks)
    assert torch.equal(merged, out) and torch.equal(total, sinks.view(1, 2, 1))
    grad = sink_grad(torch.ones_like(out), merged, total, sinks, True)
    assert torch.equal(grad, torch.zeros(2, dtype=torch.float64))
    assert with_sinks(out, lse, None) == (out, lse)
    assert sink_grad(out, out, lse, sinks, False) is None and sink_grad(out, out, lse, None, True) is None


def test_a_mask_block_takes_the_place_of_causality(monkeypatch):
    """A sliding window of 3 over positions (key blocks of two): attention and every gradient as under that mask."""
    monkeypatch.setattr(attention, "MATH_BLOCK_SCORES", HEADS * 3 * 2)
    o, n = 4, 3

    def tile(row_start, rows, col_start, cols):
        r = torch.arange(row_start, row_start + rows)[:, None]
        c = torch.arange(col_start, col_start + cols)[None, :]
        return ((c <= r) & (c > r - 3))[None, None]

    mask = mask_block.MaskTiles(fx.symbolic_trace(tile))(o, n)
    state = _state(o, n)
    prompt_k, prompt_v = _captured(state, 0)
    step, (q, k, v) = _own(state, o, n)
    out = AttentionOverState.apply(step, q, k, v, mask, 0, 1, SCALE, 0, None)
    window = _causal(n, o) & (torch.arange(o + n)[None, :] > torch.arange(o, o + n)[:, None] - 3)
    want_out = _reference(q, torch.cat([prompt_k, k], -2), torch.cat([prompt_v, v], -2), window)
    _assert_gradients(out, want_out, [q, k, v], [prompt_k, prompt_v], state, "qkv")


def test_queries_after_the_span_see_every_key(monkeypatch):
    """`AttentionOverSpan`: 2 queries (not the span's rows) after the span's 3 own keys and
    the prompt's from `first` 1 (NaN before it), with sinks, key blocks of one position."""
    monkeypatch.setattr(attention, "MATH_BLOCK_SCORES", 1)
    o, n, first = 4, 3, 1
    state = _state(o, n, verify=True)
    prompt_k, prompt_v = _captured(state, first)
    step, (_, k, v) = _own(state, o, n)
    q, sinks = _rand(1, HEADS, 2, DIM, seed=3).requires_grad_(), _rand(HEADS, seed=7).requires_grad_()
    out = AttentionOverSpan.apply(step, q, k, v, 0, 1, SCALE, first, sinks)
    seen = (torch.arange(o + n) >= first).expand(2, o + n)
    want_out = _reference(q, torch.cat([prompt_k, k], -2), torch.cat([prompt_v, v], -2), seen, sinks)
    _assert_gradients(out, want_out, [q, k, v, sinks], [prompt_k, prompt_v], state, ["q", "k", "v", "sinks"])


@pytest.mark.parametrize("block_scores", [1, 1 << 24], ids=["one-key-blocks", "one-block"])
def test_branch_rows_attend_over_the_prompt_and_each_their_own_keys(block_scores, monkeypatch):
    """`RowsOverState`: 3 rows of 2 positions after a prompt of 4 from `first` 1 (NaN before it,
    and in the scratch room the rows never write): each row is causal attention over the
    prompt and its own keys; the prompt's gradients, summed over the rows, land in d(state)."""
    monkeypatch.setattr(attention, "MATH_BLOCK_SCORES", block_scores)
    o, n, rows, first = 4, 2, 3, 1
    state = _state(o, n, verify=True)
    prompt_k, prompt_v = _captured(state, first)
    step, (q, k, v) = _own(state, o, n, rows)
    out = RowsOverState.apply(step, q, k, v, 0, 1, SCALE, first)
    want_out = torch.cat([_reference(q[r:r + 1], torch.cat([prompt_k, k[r:r + 1]], -2),
                                     torch.cat([prompt_v, v[r:r + 1]], -2), _causal(n, o, first)) for r in range(rows)])
    _assert_gradients(out, want_out, [q, k, v], [prompt_k, prompt_v], state, "qkv")


def test_the_causal_forward_operator_is_registered_consistently():
    """Schema, fake kernel and the real one agree (`torch.library.opcheck`; no compiled checks, which take seconds)."""
    q = _rand(1, HEADS, 3, DIM, seed=0)
    keys, values = _rand(1, KV_HEADS, 5, DIM, seed=1), _rand(1, KV_HEADS, 5, VDIM, seed=2)
    torch.library.opcheck(torch.ops.longstraw.causal_attention_forward.default, (q, keys, values, SCALE, 2),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def _flops(n: int, keys: int, q_start: int) -> int:
    q, k, v = torch.zeros(2, HEADS, n, DIM), torch.zeros(2, KV_HEADS, keys, DIM), torch.zeros(2, KV_HEADS, keys, VDIM)
    with FlopCounterMode(display=False) as counter:
        torch.ops.longstraw.causal_attention_forward(q, k, v, None, q_start)
    return counter.get_total_flops()


def test_the_flop_count_is_two_products_over_the_causal_pairs():
    """Queries at [5, 8) over keys [0, 8): 6 + 7 + 8 pairs, each a DIM score and a VDIM weighted value."""
    assert _flops(3, 8, 5) == 2 * 2 * HEADS * (DIM + VDIM) * (6 + 7 + 8)


def test_the_flop_count_of_queries_after_every_key_is_every_pair():
    """Queries after all 8 keys (`q_start` 8): 3 x 8 pairs."""
    assert _flops(3, 8, 8) == 2 * 2 * HEADS * (DIM + VDIM) * (3 * 8)


def _prompt_chunk(state: PromptState, grad_enabled: bool, q: torch.Tensor) -> torch.Tensor:
    """The attention of a prompt chunk at [0, 3) (capture: `grad_enabled` False; reverse pass: True)."""
    k, v = _rand(1, KV_HEADS, 3, DIM, seed=1), _rand(1, KV_HEADS, 3, VDIM, seed=2)
    step = StepContext(state, 0, 3, grad_enabled)
    step.write(0, k)
    step.write(1, v)
    return AttentionOverState.apply(step, q, k, v, None, 0, 1, SCALE, 0, None)


def test_the_reverse_pass_reads_back_what_the_capture_kept():
    """With `attention_outputs_on_host`, a recomputed prompt chunk's causal forward is
    the capture's kept output, not run again (other queries show it)."""
    state = _state(3, 0, kept=HostAttentionOutputs(torch.device("cpu")))
    q = _rand(1, HEADS, 3, DIM, seed=0)
    with torch.no_grad():
        captured = _prompt_chunk(state, False, q)
    assert torch.equal(_prompt_chunk(state, True, q + 1), captured)


def test_verify_state_refuses_a_reverse_pass_that_differs_from_the_kept_output():
    state = _state(3, 0, verify=True, kept=HostAttentionOutputs(torch.device("cpu")))
    q = _rand(1, HEADS, 3, DIM, seed=0)
    with torch.no_grad():
        _prompt_chunk(state, False, q)
    _prompt_chunk(state, True, q)
    with raises_longstraw(r"verify_state: the reverse pass recomputed the attention of state slot 0 \(attention:k\) of "
                          r"`k` over positions \[0, 3\) with other values than the capture kept"):
        _prompt_chunk(state, True, q + 1)
