"""What the partition refuses (`longstraw/analysis/refusals.py`), one
cause at a time on a small attention loss: each refusal names the
operator and the real cause, and a graph the analysis understands is
classified without one."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from longstraw.analysis.partition import classify
from longstraw.errors import UnsupportedGraphError
from longstraw.trace.specialize import specialize

G, P, R, C, VOCAB = 3, 8, 4, 8, 16


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _explicit(q, k, v):
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    return torch.softmax(scores.masked_fill(~causal, float("-inf")), -1) @ v


def _loss(attend=_sdpa, mix=lambda x: x, read=slice(P - 1, -1)):
    """One attention layer over `[prompt; response]`; `mix` runs on the
    hidden states before it, `read` picks the positions the loss reads."""

    def loss(emb, wq, head, prompt, responses):
        ids = torch.cat([prompt.expand(responses.shape[0], -1), responses], 1)
        x = mix(emb[ids])
        q = (x @ wq)[:, None]
        logits = (x + attend(q, q, q)[:, 0]) @ head
        return torch.log_softmax(logits[:, read], -1).sum()

    return loss


def _classify(loss):
    gen = torch.Generator().manual_seed(0)
    args = [torch.randn(*s, generator=gen, dtype=torch.float64).requires_grad_() for s in ((VOCAB, C), (C, C), (C, VOCAB))]
    args += [torch.randint(0, VOCAB, (P,), generator=gen), torch.randint(0, VOCAB, (G, R), generator=gen)]
    captured = []
    torch._dynamo.reset()
    torch.compile(loss, backend=lambda gm, example: captured.append((gm, list(example))) or gm.forward,
                  fullgraph=True)(*args)
    gm, example = captured[0]
    special = specialize(gm, example).gm
    params = {p for p, a in zip(special.graph.find_nodes(op="placeholder"), example) if a.requires_grad}
    return classify(special, params)


def test_a_loss_the_analysis_understands_is_classified():
    part = _classify(_loss())
    assert part.first_consumed == P - 1 and part.claims


@pytest.mark.parametrize("loss, cause", [
    (_loss(attend=_explicit), r"softmax.*explicit matmul and softmax.*attn_implementation"),
    (_loss(mix=lambda x: x.cumsum(1)), r"cumsum.*mixes values across sequence positions"),
    (_loss(mix=lambda x: x.unflatten(1, (-1, 2)).flip(2).flatten(1, 2)),
     r"scaled_dot_product_attention.*runs over positions that are a product of several axes"),
    (_loss(read=slice(P - 1, -1, 2)), r"reads every k-th position of the sequence"),
], ids=["explicit-attention", "cumsum", "chunked", "strided-read"])
def test_a_refusal_names_the_operator_and_its_cause(loss, cause):
    with pytest.raises(UnsupportedGraphError, match=cause):
        _classify(loss)
