"""The planning stages one at a time, on the graph of a small hand-written
attention loss: dimensions (`DimAnalysis`), classification (`classify`),
the state choice (`with_state`) and step generation (`build_*`). The end
to end tests prove the stages together; these say which stage decided what."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from longstraw.analysis.dims import DimAnalysis
from longstraw.analysis.partition import classify, with_state
from longstraw.codegen.graphs import build_outer, build_tail
from longstraw.codegen.stepgraph import build_step
from longstraw.nodes import is_sdpa, op_name
from longstraw.passes import DEFAULT_PASSES
from longstraw.trace.functionalize import is_updated
from longstraw.trace.specialize import specialize

G, P, R, C, HEADS, DIM, VOCAB = 3, 10, 4, 8, 2, 4, 16


def attention_loss(emb, wq, wk, wv, head, prompt, responses, advantages):
    """One attention layer, grouped K/V repeated to the query heads, a GRPO-style tail."""
    ids = torch.cat([prompt.expand(responses.shape[0], -1), responses], 1)
    x = emb[ids]  # [G, L, C]
    q = (x @ wq).unflatten(-1, (HEADS, DIM)).transpose(1, 2)  # [G, 2, L, 4]
    k = (x @ wk).unflatten(-1, (1, DIM)).transpose(1, 2).repeat_interleave(HEADS, dim=1)
    v = (x @ wv).unflatten(-1, (1, DIM)).transpose(1, 2).repeat_interleave(HEADS, dim=1)
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
    logits = (x + a) @ head
    logp = torch.log_softmax(logits[:, prompt.shape[0] - 1 : -1], -1).gather(-1, responses[..., None]).squeeze(-1)
    return -(logp.sum(1) * advantages).mean()


def _args():
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(*s, generator=gen, dtype=torch.float64).requires_grad_()
               for s in ((VOCAB, C), (C, C), (C, DIM), (C, DIM), (C, VOCAB))]
    prompt, responses = torch.randint(0, VOCAB, (P,), generator=gen), torch.randint(0, VOCAB, (G, R), generator=gen)
    return (*weights, prompt, responses, torch.randn(G, dtype=torch.float64, generator=gen))


@pytest.fixture(scope="module")
def graph():
    """The specialised graph, its example arguments and the parameter placeholders."""
    torch._dynamo.reset()
    graphs = []

    def capture(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    args = _args()
    torch.compile(attention_loss, backend=capture, fullgraph=True)(*args)
    gm, example = graphs[0]
    special = specialize(gm, example).gm
    params = {p for p, a in zip(special.graph.find_nodes(op="placeholder"), example) if a.requires_grad}
    return special, example, params


def _node(gm, predicate):
    (node,) = [n for n in gm.graph.nodes if predicate(n)]
    return node


def test_dims_tie_the_positions_of_ids_queries_and_logits(graph):
    gm, _, _ = graph
    an = DimAnalysis(gm.graph)
    ids = _node(gm, lambda n: op_name(n) == "cat")
    sdpa = _node(gm, is_sdpa)
    positions = an.classes(an.dims_of(ids)[1])
    assert an.classes(an.dims_of(sdpa.args[0])[2]) == positions  # q [G, H, L, D]
    assert an.classes(an.dims_of(sdpa.args[1])[2]) == positions  # k, after the head repeat
    assert an.classes(an.dims_of(ids)[0]) == an.classes(an.dims_of(sdpa)[0])  # the group's rows
    assert not an.unknown, [n.name for n in an.unknown]


def test_classify_finds_axes_regions_and_exits(graph):
    gm, _, params = graph
    part = classify(gm, params, DEFAULT_PASSES)
    ids, sdpa = _node(gm, lambda n: op_name(n) == "cat"), _node(gm, is_sdpa)
    assert part.token == part.dims.classes(part.dims.dims_of(ids)[1])[0]
    assert part.batch == part.dims.classes(part.dims.dims_of(ids)[0])[0]
    assert (part.seq_len, part.group_size) == (P + R, G)
    assert {p.name for p in part.claims.values()} == {"causal_attention"} and sdpa in part.claims
    assert sdpa in part.sequence and ids in part.sequence
    assert part.first_consumed == P - 1 and part.end == P + R - 1  # logits[:, P-1:-1]
    assert [op_name(e.node) for e in part.exits] == ["getitem"]
    assert any(op_name(n) == "mean" for n in part.tail)
    assert part.slots == [] and part.sites == {}  # no state before its stage


def test_with_state_captures_keys_and_values_before_the_head_repeat(graph):
    gm, _, params = graph
    part = with_state(classify(gm, params, DEFAULT_PASSES))
    assert [s.kind for s in part.slots] == ["sequence", "sequence"]
    # one K/V head of 4 float64 values per position, not the two repeated heads
    assert [s.bytes_per_position() for s in part.slots] == [DIM * 8, DIM * 8]
    assert all(op_name(s.node) != "repeat_interleave" for s in part.slots)
    (sites,) = part.sites.values()
    assert [site.transform for site in sites] == [HEADS, HEADS]  # the step repeats through SDPA's enable_gqa


def test_codegen_emits_the_steps(graph):
    gm, example, params = graph
    part = with_state(classify(gm, params, DEFAULT_PASSES))
    prefix, branch = build_step(part, "prefix"), build_step(part, "branch")
    calls = lambda step: [n.target for n in step.module.graph.nodes if n.op == "call_function"]  # noqa: E731
    names = lambda step: {getattr(t, "__name__", "") for t in calls(step)}  # noqa: E731
    # one layer: the capture needs only K and V, so its step never attends; a branch attends to the state
    assert "attention_step" not in names(prefix) and "attention_step" in names(branch)
    assert "scaled_dot_product_attention" not in names(prefix) | names(branch)
    (out,) = prefix.module.graph.find_nodes(op="output")
    assert len(out.args[0]) == len(part.slots)  # the prefix step returns what is captured
    assert build_outer(part).module.graph.find_nodes(op="placeholder")
    tail = build_tail(part)
    assert len(list(tail.module.graph.find_nodes(op="placeholder"))) == len(part.placeholders) + len(part.branch_outputs)


def _scatter_graph(write):
    """DimAnalysis of `write(x, idx)` after an embedding lookup, x `[G, L, C]`."""
    def fn(emb, ids, idx):
        return write(emb[ids], idx).sum()

    graphs = []
    torch._dynamo.reset()
    torch.compile(fn, backend=lambda gm, ex: graphs.append((gm, list(ex))) or gm.forward, fullgraph=True)(
        torch.randn(VOCAB, C), torch.randint(0, VOCAB, (G, P)), torch.randint(0, C, (G, P, 2)))
    gm = specialize(*graphs[0]).gm
    ids = next(n for n in gm.graph.find_nodes(op="placeholder") if "ids" in n.name)
    an = DimAnalysis(gm.graph)
    scatter = next(n for n in gm.graph.nodes if "scatter" in str(n.target) or is_updated(n) and "scatter" in n.args[1])
    return an, an.classes(an.dims_of(ids)[1])[0], scatter


@pytest.mark.parametrize("inplace", [False, True])
def test_a_scatter_along_channels_mixes_only_channels(inplace):
    """DeepSeek-V3's router marks its chosen expert groups with a scatter along the group axis."""
    write = (lambda x, idx: torch.zeros_like(x).scatter_(2, idx, 1.0)) if inplace else \
        (lambda x, idx: x.scatter(2, idx, torch.ones(idx.shape, dtype=x.dtype)))
    an, token, scatter = _scatter_graph(write)
    assert scatter not in an.unknown
    assert token in an.classes(an.dims_of(scatter)[1])
    assert token not in {c for d in an.mixes[scatter] for c in an.classes(d)}


def test_a_scatter_along_positions_mixes_positions():
    an, token, scatter = _scatter_graph(lambda x, idx: torch.zeros_like(x).scatter(1, idx[..., :1].expand(-1, -1, C) % P, x))
    assert token in {c for d in an.mixes[scatter] for c in an.classes(d)}


def test_a_scatter_over_some_positions_has_no_rule():
    """A shorter index along a dimension writes only its first rows: which rows depends on where a row is."""
    an, _, scatter = _scatter_graph(lambda x, idx: torch.zeros_like(x).scatter(2, idx[:, : P - 3], 1.0))
    assert scatter in an.unknown
