"""What a traced attention mask is (`analysis/mask_bands.py`): a band of
key offsets proved from the operators that build it (checked against the
mask's own values), None for anything the proof does not cover; the one
key padding factor of a padded causal mask; and which attention masks are
a top-k selection."""

from __future__ import annotations

import math
from typing import Any, Callable

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from longstraw.analysis.mask_bands import band_of, key_padding_of, reads_input, selected_by_topk
from longstraw.nodes import is_sdpa

from helpers.recorded import ValueRecorder

L = 12
PAD = torch.ones(2, L, dtype=torch.bool)  # [B, keys]: true where a key may be attended to


def _built(build: Callable[..., fx.Proxy], *inputs: torch.Tensor) -> fx.Node:
    """The node `build(call, *inputs)` returns, where `call(torch.arange, 12)` records a call with
    constant arguments (Dynamo's form once sizes are folded); every node holds its value."""
    graph = fx.Graph()
    tracer = fx.proxy.GraphAppendingTracer(graph)

    def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> fx.Proxy:
        return fx.Proxy(graph.call_function(fn, args, kwargs), tracer)

    out = build(call, *(fx.Proxy(graph.placeholder(f"input_{i}"), tracer) for i in range(len(inputs))))
    graph.output(out.node)
    ValueRecorder(fx.GraphModule(torch.nn.Module(), graph)).run(*inputs)
    return out.node


def _rows_cols(call, start: int = 0) -> tuple[fx.Proxy, fx.Proxy]:
    return call(torch.arange, start, start + L)[:, None], call(torch.arange, L)[None, :]


def _causal(call) -> fx.Proxy:
    i, j = _rows_cols(call)
    return j <= i


@pytest.mark.parametrize("build, band", [
    (_causal, (0, math.inf)),
    (lambda call: (lambda i, j: j < i)(*_rows_cols(call)), (1, math.inf)),
    (lambda call: (lambda i, j: i <= j)(*_rows_cols(call)), (-math.inf, 0)),
    (lambda call: (lambda i, j: i > j)(*_rows_cols(call)), (1, math.inf)),
    (lambda call: (lambda i, j: i < j)(*_rows_cols(call)), (-math.inf, -1)),
    (lambda call: (lambda i, j: i == j)(*_rows_cols(call)), (0, 0)),
    (lambda call: (lambda i, j: j == i + 1)(*_rows_cols(call)), (-1, -1)),
    (lambda call: (lambda i, j: (j <= i) & (j > i - 4))(*_rows_cols(call)), (0, 3)),
    (lambda call: (lambda i, j: (i - 2 >= j).logical_and(j + 5 >= i))(*_rows_cols(call)), (2, 5)),
    (lambda call: (lambda i, j: j <= i)(*_rows_cols(call, start=3)), (-3, math.inf)),
    (lambda call: call(torch.arange, L).unsqueeze(0) <= call(torch.arange, L).unsqueeze(-1), (0, math.inf)),
    (lambda call: call(torch.arange, 2 * L)[5:5 + L][:, None] >= call(torch.arange, L), (-5, math.inf)),
    (lambda call: call(torch.ones, L, L, dtype=torch.bool) & _causal(call), (0, math.inf)),
    (lambda call: _causal(call).expand(2, 1, L, L).to(torch.bool), (0, math.inf)),
    (lambda call: (lambda p: p[p][:, None] >= p)(call(torch.arange, L)), (0, math.inf)),
], ids=["causal", "strictly-causal", "later-keys", "strictly-causal-flipped",
        "strictly-later-keys", "diagonal", "next-key", "window-4", "offsets-2-to-5", "rows-from-3",
        "unsqueezed", "sliced-positions", "and-all-true", "expanded-and-cast-to-bool", "gathered-in-range"])
def test_a_band_is_proved_and_is_where_the_mask_is_true(build, band):
    mask = _built(build)
    assert band_of(mask) == band
    lo, hi = band
    offsets = torch.arange(L)[:, None] - torch.arange(L)[None, :]
    want = (offsets >= lo) & (offsets <= hi)
    assert torch.equal(mask.meta["longstraw_value"], want.expand_as(mask.meta["longstraw_value"]))


def _packed_check(call, positions: fx.Proxy) -> fx.Proxy:
    """HF's packed-sequence check: a new sequence wherever positions do not count up by one."""
    sequence = (torch.diff(positions, prepend=positions[:1] - 1) != 1).cumsum(-1)
    return (sequence[:, None] == sequence[None, :]) & _causal(call)


def test_positions_that_count_up_by_one_are_one_sequence():
    assert band_of(_built(lambda call: _packed_check(call, call(torch.arange, L)))) == (0, math.inf)


@pytest.mark.parametrize("build", [
    lambda call: (lambda i, j: i != j)(*_rows_cols(call)),
    lambda call: (lambda i, j: (j <= i) | (j < 3))(*_rows_cols(call)),
    lambda call: call(torch.arange, 2 * L)[::2, None] >= call(torch.arange, L),
    lambda call: call(torch.arange, 0, L, 1)[:, None] >= call(torch.arange, L),
    lambda call: _causal(call).to(torch.float32),
    lambda call: _causal(call).to(torch.long) > 0,
    lambda call: call(torch.ones, L, L, dtype=torch.bool).tril(),
    lambda call: (lambda p: p[p - 1][:, None] >= p)(call(torch.arange, L)),
    lambda call: _packed_check(call, call(torch.arange, L) % 6),
], ids=["not-equal", "prefix-lm", "every-other-row", "arange-with-step", "float", "cast-to-long", "tril",
        "gathered-out-of-range", "packed"])
def test_a_mask_the_proof_does_not_cover_has_no_band(build):
    assert band_of(_built(build)) is None


def test_a_mask_that_reads_an_input_has_no_band():
    mask = _built(lambda call, x: _causal(call) & (x[None, :] > 0), torch.ones(L))
    assert reads_input(mask) and band_of(mask) is None


def _key(pad: fx.Proxy) -> fx.Proxy:
    return pad[:, None, None, :]  # [B, 1, 1, keys]


def test_a_node_reads_an_input_when_a_graph_input_is_among_its_ancestors():
    mask = _built(lambda call, pad: _causal(call) & _key(pad), PAD)
    causal, key = mask.args
    assert reads_input(mask) and reads_input(key) and not reads_input(causal)


@pytest.mark.parametrize("build, pad", [
    (lambda call, pad: _causal(call) & _key(pad), PAD),
    (lambda call, pad: (_causal(call) & _key(pad)).expand(2, 1, L, L).to(torch.bool), PAD),
    (lambda call, pad: torch.logical_and(_key(pad).expand(2, 1, L, L), _causal(call)), PAD),
    (lambda call, pad: _causal(call) & _key(pad > 0), torch.ones(2, L)),
], ids=["and", "expanded-and-cast-to-bool", "logical_and-of-an-expanded-key-mask", "key-mask-computed-from-an-input"])
def test_the_key_padding_of_a_padded_causal_mask_is_its_one_input_factor(build, pad):
    mask = _built(build, pad)
    (key,) = [n for n in mask.graph.nodes if getattr(n.meta.get("longstraw_value"), "shape", None) == (2, 1, 1, L)]
    assert key_padding_of(mask) is key


@pytest.mark.parametrize("build, inputs", [
    (lambda call, pad: _causal(call), [PAD]),
    (lambda call, pad, other: _causal(call) & _key(pad) & _key(other), [PAD, PAD]),
    (lambda call, full: _causal(call) & full[:, None], [torch.ones(2, L, L, dtype=torch.bool)]),
    (lambda call, pad: _causal(call) | _key(pad), [PAD]),
    (lambda call, pad: (_causal(call) & _key(pad)).to(torch.float32), [PAD]),
], ids=["positions-only", "two-input-factors", "per-query-input", "or", "float"])
def test_a_mask_other_than_positions_and_one_key_mask_has_no_key_padding(build, inputs):
    assert key_padding_of(_built(build, *inputs)) is None


def _attention(mask: Callable[[Any, fx.Proxy], fx.Proxy | None]) -> Callable[..., fx.Proxy]:
    def build(call, q):
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask(call, q))
    return build


def _top2(call, q: fx.Proxy) -> fx.Proxy:
    chosen = (q @ q.transpose(-1, -2)).topk(2, -1)[1]
    return call(torch.zeros, 1, 1, 4, 4, dtype=torch.bool).scatter(-1, chosen, True)


def test_an_attention_whose_mask_is_built_with_a_top_k_is_a_selection():
    q = torch.ones(1, 1, 4, 8)
    selected = _built(_attention(_top2), q)
    assert is_sdpa(selected) and selected_by_topk(selected)
    assert not selected_by_topk(selected, hops=1)  # the top-k is two operators up from the mask
    assert not selected_by_topk(selected.kwargs["attn_mask"])  # the mask itself is no attention
    for other in (_attention(lambda call, q: call(torch.ones, 4, 4, dtype=torch.bool).tril()),
                  _attention(lambda call, q: None)):
        assert not selected_by_topk(_built(other, q))
