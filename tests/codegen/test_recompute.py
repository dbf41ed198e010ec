"""`recompute_layers`: branch replays and reverse-pass chunks run layer by
layer under checkpoint. Same gradients as without (bit for bit on the CPU,
dropout included), and what a step holds under autograd stops growing with
depth."""

from __future__ import annotations

import pytest
import torch
import transformers

import longstraw
from longstraw.codegen.recompute import LayerwiseStep, segment_ids
from longstraw.models import qwen3_5
from longstraw.runtime.kernels import attention as attention_kernels

from helpers.compare import assert_close, assert_grads_close
from helpers.harness import compile_loss, compiled_loss_and_grads
from helpers.losses import grpo_loss_f64
from helpers.plain_transformer import make_plain
from helpers.reference import eager_loss_and_grads
from helpers.tiny_models import make_group, make_model


def make_hybrid() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.Qwen3_5ForCausalLM(qwen3_5.tiny_config()).double()


MODELS = {
    "plain": lambda: make_model("plain"),
    "qwen3": lambda: make_model("qwen3"),
    "plain_dropout": lambda: make_plain(dropout=0.3).train(),
    "qwen3_5": make_hybrid,
}


def run(model, group, mode: str, recompute: bool):
    backend = longstraw.Backend(prompt_grad=mode, prefix_chunk_size=4, recompute_layers=recompute, verify_state=True)
    torch.manual_seed(7)  # the same dropout masks in both runs
    loss, grads = compiled_loss_and_grads(compile_loss(grpo_loss_f64, backend), model, *group)
    return loss, grads, backend.plans[-1].runner


@pytest.mark.parametrize("mode", ["exact", pytest.param("detached", marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind", list(MODELS))
def test_recomputing_replay_gives_the_same_gradients(kind, mode):
    model = MODELS[kind]()
    group = make_group(3, 13, 5, pad=True)
    with qwen3_5.bound():
        loss, grads, _ = run(model, group, mode, recompute=False)
        torch._dynamo.reset()
        loss_rc, grads_rc, runner = run(model, group, mode, recompute=True)
    assert torch.equal(loss_rc, loss)
    for name in grads:
        assert torch.equal(grads_rc[name], grads[name]), f"{name} differs when recomputing"
    layers = model.config.num_hidden_layers if hasattr(model, "config") else model.cfg.num_layers
    # one segment before the first layer, then one per layer (the head joins the last)
    assert runner.replay_module("branch").depth == layers + 1
    if kind in ("plain", "qwen3") and mode == "exact":
        want_loss, want = eager_loss_and_grads(grpo_loss_f64, model, *group)
        assert_close(loss_rc, want_loss, 1e-6)
        assert_grads_close(grads_rc, want, 1e-6)


def test_segments_are_contiguous_and_follow_the_layers():
    model = make_model("qwen3")
    backend = longstraw.Backend(prefix_chunk_size=4, recompute_layers=True)
    compile_loss(grpo_loss_f64, backend)(model, *make_group(2, 9, 3)).backward()
    graph = backend.plans[-1].runner.prefix.module.graph
    ids = segment_ids(graph)
    order = [ids[n] for n in graph.nodes if n in ids]
    assert order == sorted(order) and set(order) == {0, 1, 2}
    layer_nodes = [n for n in graph.nodes if "layers.1" in str(n.meta.get("nn_module_stack", ""))]
    assert layer_nodes and {ids[n] for n in layer_nodes} == {2}


def _activations(layers: int, mode: str) -> dict[bool, int]:
    """Simulated activations without and with recomputation, from one trace."""
    torch._dynamo.reset()
    model = make_plain(num_layers=layers, hidden_size=64, intermediate_size=256)
    report = longstraw.explain(grpo_loss_f64, model, *make_group(2, 65, 64), options={"prefix_chunk_size": 32})
    return {rc: report.plan(P=65, G=2, R=64, prompt_grad=mode, recompute_layers=rc).activations for rc in (False, True)}


@pytest.mark.parametrize("mode", ["exact", pytest.param("detached", marks=pytest.mark.slow)])
def test_what_a_replay_holds_stops_growing_with_depth(mode):
    """Simulated peak of a step under autograd, 2 against 8 layers: without
    recomputation every layer's activations stay; with it only each layer's
    input (the residual stream, 64 x 64 x 8 bytes per layer here) does."""
    held = {(layers, rc): held for layers in (2, 8) for rc, held in _activations(layers, mode).items()}
    grow = held[8, False] - held[2, False]
    grow_rc = held[8, True] - held[2, True]
    residual = 64 * 64 * 8
    assert grow > 40 * residual
    assert grow_rc <= 6 * (2 * residual + 64 * 64 * 8), (grow_rc, grow)
    assert held[8, True] < 0.4 * held[8, False]


def test_every_segment_but_the_last_is_recomputed(monkeypatch):
    """Each checkpointed segment runs twice (forward, recomputation in
    backward); the last one (the last layer and the head) once: it is
    differentiated right after its forward, so recomputing it saves nothing."""
    from longstraw.codegen import recompute

    calls: list[int] = []
    original = recompute.checkpoint
    monkeypatch.setattr(recompute, "checkpoint", lambda fn, *a, **k: (calls.append(id(fn)), original(fn, *a, **k))[1])
    model = make_model("qwen3")
    backend = longstraw.Backend(prefix_chunk_size=64, recompute_layers=True, prompt_grad="detached")
    compile_loss(grpo_loss_f64, backend)(model, *make_group(2, 9, 3)).backward()
    branch = backend.plans[-1].runner.replay_module("branch")
    checkpointed = {id(s.module) for s in branch.segments[:-1]}
    assert set(calls) == checkpointed and id(branch.segments[-1].module) not in calls
    assert len(calls) == 2 * len(checkpointed)  # two branches replayed


def test_attention_forward_is_kept_through_recomputation(monkeypatch):
    """Selective checkpointing keeps the causal attention forward's outputs:
    under recomputation a replayed step runs it once per layer, as without
    (over a long prompt it is most of an attention layer's forward)."""
    from longstraw.codegen import recompute

    calls: list[int] = []
    original = attention_kernels.MathKernel.forward
    monkeypatch.setattr(attention_kernels.MathKernel, "forward", lambda self, *a: (calls.append(1), original(self, *a))[1])

    def backward_calls(recompute: bool) -> int:
        torch._dynamo.reset()
        backend = longstraw.Backend(prefix_chunk_size=4, recompute_layers=recompute)
        loss = compile_loss(grpo_loss_f64, backend)(make_model("qwen3"), *make_group(2, 9, 3))
        before = len(calls)
        loss.backward()
        return len(calls) - before

    kept, plain = backward_calls(True), backward_calls(False)
    monkeypatch.setattr(recompute, "_KEPT", {})
    assert kept == plain < backward_calls(True)


def test_layerwise_step_is_only_used_under_autograd():
    model = make_model("plain")
    backend = longstraw.Backend(prefix_chunk_size=4, recompute_layers=True)
    step = compile_loss(grpo_loss_f64, backend)
    with torch.no_grad():
        step(model, *make_group(2, 9, 3))
    assert backend.plans[-1].runner.replayed == {}
    assert isinstance(backend.plans[-1].runner.replay_module("prefix"), LayerwiseStep)


def test_option_is_validated():
    with pytest.raises(longstraw.LongStrawError, match="recompute_layers must be a bool or None"):
        longstraw.Backend(recompute_layers="yes")
