"""Values at a new length from Dynamo's symbolic example values
(longstraw/trace/symbolic_values.py): they equal FakeTensor propagation's
node for node, a graph that writes in place is always propagated, and a
loop of new lengths planned from them gives eager's loss and gradients."""

from __future__ import annotations

import pytest
import torch

import longstraw
from longstraw.models import qwen3_5
from longstraw.trace import specialize as specialize_module
from longstraw.trace import symbolic_values
from longstraw.trace.specialize import specialize
from longstraw.trace.symbolic_values import ValueTemplates, templates_of

from helpers.compare import assert_close, assert_grads_close
from helpers.harness import compile_loss, compiled_loss_and_grads
from helpers.losses import grpo_loss_f64
from helpers.reference import detached_at_attention, eager_loss_and_grads
from helpers.tiny_models import make_group, make_qwen3, make_qwen3_5

LENGTHS = [(3, 20, 5), (3, 27, 6), (3, 34, 4), (3, 23, 7)]  # (G, P, R): Dynamo makes P and R dynamic at the second
HF_TOL = 1e-6


def dynamo_graphs(loss_fn, model, lengths, pad=False):
    """[(graph, the arguments Dynamo called it with)] for each of `lengths`,
    through a backend that runs the graph as traced."""
    calls = []

    def backend(gm, example_inputs):
        def run(*args):
            calls.append((gm, args))
            return gm(*args)
        return run

    compiled = torch.compile(loss_fn, backend=backend)
    for G, P, R in lengths:
        compiled(model, *make_group(G, P, R, pad=pad, seed=P))
    return calls


def assert_same_values(fast, slow):
    nodes = [(a, b) for a, b in zip(fast.gm.graph.nodes, slow.gm.graph.nodes)]
    assert fast.gm.code == slow.gm.code and len(nodes) == len(slow.gm.graph.nodes)
    for a, b in nodes:
        assert symbolic_values.same_value(a.meta.get("longstraw_value"), b.meta.get("longstraw_value")), a.name


@pytest.mark.parametrize("make", [make_qwen3, make_qwen3_5], ids=["dense", "hybrid"])
def test_values_at_new_lengths_are_the_propagated_ones(make):
    """The dynamic graph's first plan learns the templates; at every later
    length the specialised graph and each node's value (sizes, strides,
    dtype, device, requires_grad) are propagation's."""
    calls = dynamo_graphs(grpo_loss_f64, make(), LENGTHS, pad=True)
    dynamic = [(gm, args) for gm, args in calls if gm is calls[1][0]]
    assert len(dynamic) == 3
    specialize(*dynamic[0])
    learned, templates = templates_of(dynamic[0][0])
    assert learned and templates is not None
    for gm, args in dynamic[1:]:
        assert_same_values(specialize(gm, args), specialize(gm, args, templates=False))


def test_sizes_and_tuples_of_values(monkeypatch):
    """A `torch.Size` value and an operator returning a named tuple
    (`max(dim)`) are rebuilt as their own types at new lengths."""

    def loss(model, prompt, responses, advantages, mask):
        ids = torch.cat([prompt.expand(responses.shape[0], -1), responses], 1)
        logits = model(input_ids=ids).logits[:, prompt.shape[0] - 1:-1]
        shape = logits.size()
        top = logits.max(-1)
        centred = (logits - top.values[..., None]).reshape(shape)
        logp = torch.log_softmax(centred, -1).gather(-1, responses[..., None]).squeeze(-1)
        return -(logp * advantages[:, None] * mask).sum() / mask.sum() + 0.0 * top.indices.sum()

    calls = dynamo_graphs(loss, make_qwen3(), LENGTHS)
    dynamic = [(gm, args) for gm, args in calls if gm is calls[1][0]]
    specialize(*dynamic[0])
    assert templates_of(dynamic[0][0])[1] is not None
    fills = counted_fills(monkeypatch)
    kinds = {type(n.meta.get("longstraw_value")) for n in specialize(*dynamic[1]).gm.graph.nodes}
    assert torch.return_types.max in kinds and fills == [True]
    for gm, args in dynamic[1:]:
        assert_same_values(specialize(gm, args), specialize(gm, args, templates=False))


def test_templates_refuse_an_argument_of_another_signature(monkeypatch):
    """An argument whose requires_grad is not the one learned leaves the
    call to propagation (the templates hold later nodes' requires_grad)."""
    gm, args = dynamo_graphs(grpo_loss_f64, make_qwen3(), LENGTHS[:3])[-1]
    specialize(gm, args)
    assert templates_of(gm)[1] is not None
    flipped = [a.detach().requires_grad_(not a.requires_grad) if isinstance(a, torch.Tensor) and a.is_floating_point()
               else a for a in args]
    fills = counted_fills(monkeypatch)
    specialize(gm, flipped)
    specialize(gm, args)
    assert fills == [False, True]


def counted_fills(monkeypatch) -> list[bool]:
    """What each `ValueTemplates.fill` returns from now on, in order."""
    fills = []
    original = ValueTemplates.fill

    def fill(self, *args, **kwargs):
        fills.append(original(self, *args, **kwargs))
        return fills[-1]

    monkeypatch.setattr(ValueTemplates, "fill", fill)
    return fills


def test_a_graph_that_writes_in_place_propagates_what_functionalisation_rewrote(monkeypatch):
    """An in-place write into a view of a tensor the loss computed: the
    templates keep which values share storage, functionalisation rewrites
    the write from them, and only the rewritten nodes and what reads them
    propagate; the result is propagation's."""

    def writing_loss(model, prompt, responses, advantages, mask):
        weights = mask.clone()
        weights[:, :1].mul_(0.5)  # a write through a view
        return grpo_loss_f64(model, prompt, responses, advantages, weights)

    calls = dynamo_graphs(writing_loss, make_qwen3(), LENGTHS)
    dynamic = [(gm, args) for gm, args in calls if gm is calls[1][0]]
    specialize(*dynamic[0])
    assert templates_of(dynamic[0][0])[1] is not None
    propagated = []
    run_node = specialize_module._Recorder.run_node
    monkeypatch.setattr(specialize_module._Recorder, "run_node", lambda self, n: propagated.append(n) or run_node(self, n))
    for gm, args in dynamic[1:]:
        fast = specialize(gm, args)
        count = len(propagated)
        assert 0 < count < len(fast.gm.graph.nodes) / 4
        assert_same_values(fast, specialize(gm, args, templates=False))
        propagated.clear()


@pytest.mark.parametrize("kind,mode", [
    ("dense", "exact"), pytest.param("dense", "detached", marks=pytest.mark.slow),
    pytest.param("hybrid", "exact", marks=pytest.mark.slow),  # writes in place: functionalised, partly propagated
])
def test_a_loop_of_new_lengths_matches_eager(kind, mode, monkeypatch):
    """Every call of a loop of new prompt and completion lengths gives
    eager's loss and gradients; only the first plan of each Dynamo graph
    (the static one, then the dynamic one) propagates, the later plans read
    their values off the templates."""
    propagations = []
    record = specialize_module._record
    monkeypatch.setattr(specialize_module, "_record", lambda *a: propagations.append(a) or record(*a))
    model = make_qwen3() if kind == "dense" else make_qwen3_5()
    backend = longstraw.Backend(prompt_grad=mode, prefix_chunk_size=8, verify_state=True)
    step = compile_loss(grpo_loss_f64, backend)
    counts = []
    for G, P, R in LENGTHS:
        group = make_group(G, P, R, pad=True, seed=P)
        counts.append(len(propagations))
        with qwen3_5.bound():  # eager on LongStraw's Gated DeltaNet kernels, as the family suite compares
            got = compiled_loss_and_grads(step, model, *group)
            reference = eager_loss_and_grads if mode == "exact" else detached_at_attention
            want = reference(grpo_loss_f64, model, *group)
        assert_close(got[0], want[0], HF_TOL, "loss")
        assert_grads_close(got[1], want[1], HF_TOL)
    # the static graph's plan and the dynamic graph's first propagate (once more after functionalising writes)
    assert counts[1] > 0 and counts[2] > counts[1] and counts[3] == counts[2] == len(propagations)
    assert len(backend.plans) == len(LENGTHS)


def _family_cases():
    from helpers.families import SUPPORTED

    in_ci = {"mixtral", "deepseek_v3"}  # a write into a view of a routing result; writes into new_empty buffers
    return [pytest.param(f, id=f.name, marks=[] if f.name in in_ci else [pytest.mark.slow]) for f in SUPPORTED]


@pytest.mark.parametrize("family", _family_cases())
def test_every_family_reads_its_values_off_templates(family, monkeypatch):
    """Every supported family's dynamic graph keeps its templates, and at two
    new lengths they give propagation's specialised graph and values."""
    torch._dynamo.reset()
    fills = counted_fills(monkeypatch)
    with family.bind():
        model = family.build()
        model.config.use_cache = False
        calls = dynamo_graphs(grpo_loss_f64, model, LENGTHS)
        dynamic = [(gm, args) for gm, args in calls if gm is calls[1][0]]
        specialize(*dynamic[0])
        assert templates_of(dynamic[0][0])[1] is not None
        for gm, args in dynamic[1:]:
            fast = specialize(gm, args)
            assert fills[-1] is True
            assert_same_values(fast, specialize(gm, args, templates=False))
