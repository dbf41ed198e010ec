"""The simulated step's peak as a function of the keys attention reads
(`longstraw.planning.simulation.Peak`), and fla's kernels in the simulation (their
fake entry points)."""

from __future__ import annotations

import sys

import pytest
import torch
import transformers
from torch._subclasses.fake_tensor import FakeTensorMode

import longstraw
from longstraw.models import qwen3_5
from longstraw.passes import gated_delta
from longstraw.planning.simulation import Peak, fla_families
from longstraw.runtime.kernels import KernelPolicy, attention, fla_causal_conv, fla_gated_delta

from helpers.losses import grpo_loss_f64
from helpers.paths import REPO


def test_a_peak_reads_its_workspaces_off_for_more_keys():
    """`at` grows each workspace with the keys up to its block's cap and
    never goes under the simulated peak; `largest` and `extrapolated`
    combine per workspace."""
    peak = Peak(1000, ((10, 64, 500), (1, 1 << 20, 900)))
    assert peak.at(0) == peak.at(40) == 1000  # 500 + 400 and 900 + 40: under the simulated peak
    assert peak.at(64) == 500 + 10 * 64  # the first at its cap
    assert peak.at(10_000) == 900 + 10_000  # the first capped, the second not
    assert peak.at(1 << 30) == 900 + (1 << 20)
    assert peak.less(600) == Peak(400, ((10, 64, 0), (1, 1 << 20, 300)))
    other = Peak(1200, ((10, 64, 700),))
    assert Peak.largest([peak, other]) == Peak(1200, ((1, 1 << 20, 900), (10, 64, 700)))
    two, three = Peak(100, ((10, 64, 50),)), Peak(130, ((10, 64, 60),))
    assert Peak.extrapolated(two, three, 6) == Peak(220, ((10, 64, 90),))
    assert Peak.extrapolated(two, Peak(130, ((20, 64, 60),)), 6) is None


def _model() -> transformers.PreTrainedModel:
    """Many query heads over two key/value heads and narrow layers: flash
    attention's backward workspace (dK/dV expanded to 32 heads) is most of
    a step's activations."""
    config = transformers.Qwen3Config(num_hidden_layers=2, hidden_size=64, intermediate_size=64, num_attention_heads=32,
                                      num_key_value_heads=2, head_dim=64, vocab_size=64, max_position_embeddings=4096)
    with torch.device("meta"):
        model = transformers.Qwen3ForCausalLM._from_config(config, dtype=torch.bfloat16)
    model.config.use_cache = False
    return model


def _report(model, P: int) -> longstraw.ExplainReport:
    meta = torch.device("meta")
    prompt = torch.zeros(P, dtype=torch.long, device=meta)
    responses = torch.zeros(4, 16, dtype=torch.long, device=meta)
    weights = torch.zeros(4, dtype=torch.bfloat16, device=meta)
    return longstraw.explain(grpo_loss_f64, model, prompt, responses, weights, weights[:, None].expand(4, 16),
                             options={"prefix_chunk_size": 32, "recompute_layers": False})


# one rank under -m slow: the two ranks' case runs the same workspace planning per rank
@pytest.mark.parametrize("ranks", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_a_short_trace_plans_the_attention_workspace_of_a_long_prompt(ranks, monkeypatch):
    """Traced at 65 positions (earlier keys of 32 a call) and planned for
    513 on CUDA, where the backward's key blocks (capped at 64 here) are
    twice as long: the plan is within 5% of the one traced at 513, and
    the simulated peak alone (`Peak.held`, the traced prompt's workspace)
    is more than 8% under it, one process or one rank of two."""
    monkeypatch.setattr(attention, "FLASH_KEY_BLOCK", 64)
    model = _model()
    short, long = _report(model, 65), _report(model, 513)
    planned = {name: r.plan(P=513, G=4, prompt_grad="exact", device="cuda", ranks=ranks).activations
               for name, r in (("short", short), ("long", long))}
    held = short.memory.activations("exact", 32, False, torch.device("cuda"), None, ranks).held
    assert abs(planned["short"] - planned["long"]) <= 0.05 * planned["long"], planned
    assert held < 0.92 * planned["long"], (held, planned)


def _fake_gated_delta_inputs(B: int, L: int, Hk: int, Hv: int, D: int) -> tuple[torch.Tensor, ...]:
    """(state, q, k, v, g, beta), bf16 but the float32 state, on the meta device."""
    bf16 = {"dtype": torch.bfloat16, "device": "meta"}
    return (torch.empty(B, Hv, D, D, device="meta"), torch.empty(B, L, Hk, D, **bf16), torch.empty(B, L, Hk, D, **bf16),
            torch.empty(B, L, Hv, D, **bf16), torch.empty(B, L, Hv, **bf16), torch.empty(B, L, Hv, **bf16))


@pytest.mark.parametrize("l2norm", [True, False])
def test_fla_fake_entry_points_have_fla_s_shapes(l2norm):
    """fla's fake entry points (`FAKE_OPS`), under FakeTensorMode (meta: a
    CPU-only PyTorch cannot index fake CUDA tensors, which `_dqkwg` does):
    the outputs fla 0.6 allocates, and `gated_delta_grads` and the
    convolution's run through them to gradients of their inputs' shapes and
    dtypes (grouped value heads, 200 positions: a last chunk of 8). Only
    inside `SWITCH.simulating()` do fake tensors take fla's path."""
    B, L, Hk, Hv, D = 2, 200, 2, 6, 16
    ops = fla_gated_delta.FAKE_OPS
    with FakeTensorMode():
        state, q, k, v, g, beta = _fake_gated_delta_inputs(B, L, Hk, Hv, D)
        assert not fla_gated_delta.applies(q)
        g_log2 = ops.chunk_local_cumsum(g, chunk_size=64, scale=ops.RCP_LN2)
        w, u, A = ops.chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=g_log2, beta=beta, chunk_size=64)
        h, v_new, _ = ops.chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=g_log2, initial_state=state, chunk_size=64)
        dh, dh0, dv = ops.chunk_gated_delta_rule_bwd_dhu(q=q, k=k, w=w, do=v, dv=v, g=g_log2, h0=state, chunk_size=64)
        dk, *_ = ops.prepare_wy_repr_bwd(k=k, v=v, beta=beta, A=A, dw=w, du=v, g=g_log2)
        got = {name: (tuple(x.shape), x.dtype) for name, x in
               {"g": g_log2, "w": w, "u": u, "A": A, "h": h, "v_new": v_new, "dh": dh, "dh0": dh0, "dv": dv, "dk": dk,
                "rstd": ops.l2norm_fwd(q)[1]}.items()}
        bf16, f32, chunks = torch.bfloat16, torch.float32, 4
        assert got == {"g": ((B, L, Hv), f32), "w": ((B, L, Hv, D), bf16), "u": ((B, L, Hv, D), bf16),
                       "A": ((B, L, Hv, 64), bf16), "h": ((B, chunks, Hv, D, D), bf16), "v_new": ((B, L, Hv, D), bf16),
                       "dh": ((B, chunks, Hv, D, D), bf16), "dh0": ((B, Hv, D, D), f32), "dv": ((B, L, Hv, D), bf16),
                       "dk": ((B, L, Hk, D), bf16), "rstd": ((B, L, Hk), f32)}

        with fla_gated_delta.SWITCH.simulating(), fla_causal_conv.SWITCH.simulating():
            assert fla_gated_delta.applies(q)
            with KernelPolicy(gated_delta="torch").active():
                assert not fla_gated_delta.applies(q)
            out, final = fla_gated_delta.gated_delta_forward(q, k, v, g, beta, state, l2norm)
            want = torch.ops.longstraw.gated_delta_rule(q, k, v, g, beta, state, l2norm)
            assert [(o.shape, o.dtype) for o in (out, final)] == [(o.shape, o.dtype) for o in want]
            grads = fla_gated_delta.gated_delta_grads(state, q, k, v, g, beta, out, final, use_qk_l2norm=l2norm)
            assert [(x.shape, x.dtype) for x in grads] == [(x.shape, x.dtype) for x in (state, q, k, v, g, beta)]

            shapes = ((B, 24, L), (24, 4), (B, 24, 3))
            x, weight, tail = (torch.empty(*s, dtype=torch.bfloat16, device="meta") for s in shapes)
            assert fla_causal_conv.applies(x, weight, None, "silu")
            out, new_tail = fla_causal_conv.causal_conv_forward(tail, x, weight, None, "silu")
            assert (out.shape, new_tail.shape) == (x.shape, tail.shape)
            grads = fla_causal_conv.causal_conv_grads(tail, x, weight, None, out, new_tail, "silu")
            assert [(d.shape, d.dtype) for d in grads[:3]] == [(t.shape, t.dtype) for t in (tail, x, weight)]
            assert grads[3] is None


def test_the_simulation_assumes_fla_on_a_cuda_target_unless_it_plans_its_own_gpu(monkeypatch):
    """`simulation.fla_families`: none off CUDA; on a CUDA target both fla
    families where the planning process has no GPU (a plan for another
    machine), and where it has one, those installed here."""
    assert fla_families(torch.device("cpu")) == fla_families(torch.device("meta")) == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert fla_families(torch.device("cuda")) == [fla_gated_delta, fla_causal_conv]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    installed = [f for f in (fla_gated_delta, fla_causal_conv) if f.fla_ops() is not None]
    assert fla_families(torch.device("cuda")) == installed


def test_the_hybrid_plans_fla_s_gated_delta_backward(monkeypatch):
    """The Qwen3.5 hybrid slice of `context_parallel_bench` (27B layer
    shapes but 32 value heads), traced at 32K in chunks of 8192 and planned
    for 131K over two ranks on CUDA, as the H200 ran it (fla installed):
    the simulation runs `gated_delta_grads` through the fake entry points
    over whole chunks (`FLA_SPAN`), and plans more than with the PyTorch
    kernel's backward (the 1,024-position spans of autograd) by at least
    fla's chunk states h and dh and their float32 copies in `_dqkwg`
    (805 MB at 8192 positions; the plan grows by 1.1 GB)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from grpo import models as grpo_models
    from grpo.models import build_model, grpo_loss

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a plan for another machine, which has fla
    grads = fla_gated_delta.gated_delta_grads
    lengths = []
    monkeypatch.setattr(fla_gated_delta, "gated_delta_grads",
                        lambda *a, **k: (lengths.append(a[1].shape[1]), grads(*a, **k))[1])
    meta = torch.device("meta")
    model = build_model("hybrid", False, torch.bfloat16, meta)
    model.config.use_cache = False
    group = grpo_models.make_group(8, 4 * 8192, 1024, model.config.vocab_size, meta)
    planned = {}
    for kernel in ("auto", "torch"):
        with qwen3_5.bound():
            report = longstraw.explain(grpo_loss, model, group.input_ids, group.advantages, group.mask, 1024,
                                       options={"prefix_chunk_size": 8192, "recompute_layers": False,
                                                "kernels": {"gated_delta": kernel}})
        planned[kernel] = report.plan(P=131072, G=8, prompt_grad="exact", device="cuda", ranks=2).peak
        assert (max(lengths, default=0) == gated_delta.FLA_SPAN == 8192) == (kernel == "auto")
        lengths.clear()
    config = model.config
    heads, dim_k, dim_v = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
    states = 8192 // 64 * heads * dim_k * dim_v * (2 + 4) * 2  # h and dh, bf16 and float32
    assert planned["auto"] - planned["torch"] >= states, (planned, states)


@pytest.mark.slow  # 32 s on a CPU; a regression check of one past failure
def test_the_simulation_does_not_depend_on_when_python_collects_cycles():
    """Fake tensors and the simulation's own objects form reference cycles
    that hold storages until the cyclic collector runs; the simulation
    turns it off and collects at every step's end
    (`simulation.without_cyclic_gc`), so its peaks are the same whether
    the collector would run after every allocation or never (at 27B shapes
    the reverse pass's peak moved by 1.5 GB, and the planner's extrapolation
    over depth turned that into several GB at 64 layers)."""
    import gc

    from longstraw.planning.simulation import simulate_phases

    meta = torch.device("meta")
    config = qwen3_5.tiny_config(num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"])
    with torch.device(meta):
        model = transformers.Qwen3_5ForCausalLM._from_config(config, dtype=torch.bfloat16)
    model.config.use_cache = False
    prompt = torch.zeros(256, dtype=torch.long, device=meta)
    responses = torch.zeros(2, 16, dtype=torch.long, device=meta)
    weights = torch.zeros(2, dtype=torch.bfloat16, device=meta)
    with qwen3_5.bound():
        report = longstraw.explain(grpo_loss_f64, model, prompt, responses, weights, weights[:, None].expand(2, 16),
                                   options={"prefix_chunk_size": 64, "recompute_layers": True})
    memory = report.memory

    def simulated(threshold: int | None) -> dict:
        thresholds, enabled = gc.get_threshold(), gc.isenabled()
        gc.collect()
        if threshold is None:
            gc.disable()
        else:
            gc.set_threshold(threshold, 1, 1)
        try:
            phases = simulate_phases(memory.program, memory.options, "exact", 64, True, torch.device("cuda"),
                                     torch.bfloat16, ranks=2)
            return {p: peak.held for p, peak in phases.items()}
        finally:
            gc.set_threshold(*thresholds)
            if enabled:
                gc.enable()

    often, never = simulated(1), simulated(None)
    assert often == never
    assert simulated(1) == often
