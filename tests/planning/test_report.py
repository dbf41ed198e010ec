"""longstraw.explain (longstraw/planning/report.py): the report's state sizes are
the bytes the runtime captures, the memory plan adds up, and the graph
views show the three regions and the state edges."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import sys

import pytest
import torch
import transformers

import longstraw
from longstraw.models import qwen3_5
from longstraw.runtime import prompt_state as state_module

from conftest import raises_longstraw
from helpers import browser
from helpers.families import FAMILIES
from helpers.harness import compile_loss
from helpers.losses import grpo_loss_f64, pg_tail
from helpers.paths import REPO
from helpers.tiny_models import make_group, make_model

sys.path.insert(0, str(REPO / "benchmarks"))
from grpo import models as grpo_models  # noqa: E402
from grpo.measure import GiB  # noqa: E402
from grpo.models import build_model, grpo_loss  # noqa: E402


def make_hybrid():
    torch.manual_seed(0)
    return transformers.Qwen3_5ForCausalLM(qwen3_5.tiny_config()).double()


MODELS = {"qwen3": lambda: make_model("qwen3"), "llama_tied": lambda: make_model("llama_tied"), "qwen3_5": make_hybrid}


def captured_bytes(model, args, monkeypatch):
    """(bytes per position, fixed bytes) of the state the runtime allocates."""
    made = []
    init = state_module.PromptState.__init__

    def recording(self, slots, capacity, prefix_len, device, **kwargs):
        init(self, slots, capacity, prefix_len, device, **kwargs)
        made.append((self, capacity))

    monkeypatch.setattr(state_module.PromptState, "__init__", recording)
    compile_loss(grpo_loss_f64, longstraw.Backend())(model, *args)
    (state, capacity), = made
    per_position = sum(b.numel() * b.element_size() for b in state.buffers.values()) // capacity
    fixed = sum(c[0].numel() * c[0].element_size() for c in state.carries.values())
    return per_position, fixed


@pytest.mark.parametrize("kind", list(MODELS))
def test_planned_state_is_what_the_runtime_captures(kind, monkeypatch):
    with qwen3_5.bound():
        model = MODELS[kind]()
        args = make_group(3, 40, 6)
        report = longstraw.explain(grpo_loss_f64, model, *args)
        per_position, fixed = captured_bytes(model, args, monkeypatch)
    assert report.state_bytes_per_position == per_position > 0
    assert report.state_fixed_bytes == fixed
    assert (fixed > 0) == (kind == "qwen3_5")
    assert sum(t.bytes_per_position for t in report.state) == per_position
    assert all(t.layer and t.operator and t.source for t in report.state)


def test_explain_runs_nothing():
    model = make_model("qwen3")
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    longstraw.explain(grpo_loss_f64, model, *make_group(2, 20, 4))
    assert calls == []  # Dynamo traces without running hooks; planning stops before the first step
    assert all(p.grad is None for p in model.parameters())


def test_memory_plan_adds_up_and_finds_the_largest_prompt():
    report = longstraw.explain(grpo_loss_f64, make_model("qwen3"), *make_group(2, 20, 4))
    R = report.traced_response_len
    plan = report.plan(P=4096, G=8, budget_gb=0.05)
    assert plan.peak == plan.weights + plan.grads + plan.state + plan.state_grad + plan.activations
    assert plan.state == report.state_bytes_per_position * (4096 - 1 + R)  # no fixed state in a dense model
    assert plan.state_grad == report.state_bytes_per_position * 4095
    assert plan.activations > 0
    largest = plan.largest_prompt
    assert largest is not None
    sized = {"prefix_chunk_size": plan.prefix_chunk_size, "recompute_layers": plan.recompute_layers}
    assert report.plan(P=largest, **sized).peak <= plan.budget < report.plan(P=largest + 1, **sized).peak
    detached = report.plan(P=4096, prompt_grad="detached")
    assert detached.state_grad == 0 and detached.peak < plan.peak
    # G does not change the prediction
    assert report.plan(P=4096, G=2).peak == report.plan(P=4096, G=64).peak
    table = plan.table()
    assert "predicted peak" in table and "largest P that fits" in table


def test_the_plan_reports_the_graphs_kept_in_the_room_beside_the_peak():
    """With a budget, the plan says what a run keeps for the backward in the
    room beside its peak, as the runner's `GraphSpending` decides: the
    prompt's graph first (exact mode), then branch graphs one by one; none
    without room, under layer-wise recomputation, or with keep_graphs=False;
    no prompt graph in detached mode."""
    report = longstraw.explain(grpo_loss_f64, make_model("qwen3"), *make_group(2, 20, 4))
    report.options = dataclasses.replace(report.options, branch_rows=1)  # steps of several rows: the next test
    sized = {"prefix_chunk_size": 8, "recompute_layers": False}
    base = report.plan(P=64, G=6, **sized)
    assert base.kept is None  # no budget on the CPU: nothing to keep against
    graph, chunks = base.activations, 8  # (64 - 1) positions in chunks of 8
    for room, prompt, branches in [(0, False, 0), (chunks * graph, True, 0), (chunks * graph + 3 * graph, True, 3),
                                   (10 ** 12, True, 6)]:
        plan = report.plan(P=64, G=6, budget_gb=(base.peak + room) / 1e9, **sized)
        assert (plan.kept.prompt, plan.kept.branches, plan.kept.prompt_chunks) == (prompt, branches, chunks), room
    roomy = (base.peak + 10 ** 12) / 1e9
    detached = report.plan(P=64, G=6, budget_gb=roomy, prompt_grad="detached", **sized).kept
    assert not detached.prompt and detached.branches == 6
    assert report.plan(P=64, G=6, budget_gb=roomy, prefix_chunk_size=8, recompute_layers=True).kept.branches == 0
    table = report.plan(P=64, G=6, budget_gb=(base.peak + chunks * graph + 3 * graph) / 1e9, **sized).table()
    assert "the prompt's graph (8 chunks): kept" in table and "branch graphs kept: 3 of 6" in table
    assert "forwards: the prompt 1x, the branches 9 for 6" in table
    report.options = dataclasses.replace(report.options, keep_graphs=False)
    unkept = report.plan(P=64, G=6, budget_gb=roomy, **sized).kept
    assert not unkept.prompt and unkept.branches == 0


H200_RESULTS = REPO / "benchmarks" / "results"
# per benchmark model, the files of each mode's sweep (gradients accumulated in place, one set live)
H200_SWEEPS = {
    "dense": {"longstraw_detached": ["grpo_bench_dense_f_h200.json"],
              "longstraw_exact": ["grpo_bench_dense_f_h200.json", "grpo_bench_dense_g_h200.json"]},
    "hybrid": {"longstraw_detached": ["grpo_bench_hybrid_e_h200.json"], "longstraw_exact": ["grpo_bench_hybrid_e_h200.json"]},
}


def test_the_plan_reports_branch_rows_from_the_room(monkeypatch):
    """With a budget and `branch_rows=None`, as many rows per branch step as
    the room beside the peak holds at one branch's graph per row beyond the
    first, as the runner decides (`kept_graphs.rows_per_step`); where graphs
    may be kept, the rows give way to them (one row per step where the
    rows' room would keep graphs over fewer positions) and, where both fit,
    the graphs kept come out of what is left. MLA's steps hold rows too,
    and a pass that does not declare `branches_batched` holds one."""
    report = longstraw.explain(grpo_loss_f64, make_model("qwen3"), *make_group(2, 20, 4))
    sized = {"prefix_chunk_size": 8, "recompute_layers": False, "prompt_grad": "detached"}
    base = report.plan(P=64, G=6, **sized)
    graph = base.activations
    for keep, room, rows, kept in [(False, 0, 1, 0), (False, 3 * graph, 4, 0), (False, 10 ** 12, 6, 0),
                                   (None, 3 * graph, 1, 3), (None, 12 * graph, 6, 6), (None, 10 ** 12, 6, 6)]:
        report.options = dataclasses.replace(report.options, keep_graphs=keep)
        plan = report.plan(P=64, G=6, budget_gb=(base.peak + room + graph // 2) / 1e9, **sized)
        assert (plan.kept.rows, plan.kept.branches) == (rows, kept), (keep, room)
    report.options = dataclasses.replace(report.options, keep_graphs=False)
    table = report.plan(P=64, G=6, budget_gb=(base.peak + 3 * graph + graph // 2) / 1e9, **sized).table()
    assert "branch steps: 2 of up to 4 rows for 6 branches" in table
    latent = longstraw.explain(grpo_loss_f64, FAMILIES["deepseek_v3"].build(), *make_group(2, 20, 4))
    assert latent.plan(P=64, G=6, budget_gb=1000.0, **sized).kept.rows == 6
    from longstraw.passes.mla import LatentAttentionPass

    monkeypatch.setattr(LatentAttentionPass, "branches_batched", False)
    assert latent.plan(P=64, G=6, budget_gb=1000.0, **sized).kept.rows == 1


# The hybrid's simulation runs the Gated DeltaNet reference loop on fake
# tensors at 27B layer shapes (about three minutes on a CPU): `-m slow`.
@pytest.fixture(scope="module", params=[pytest.param(k, marks=[pytest.mark.slow] if k == "hybrid" else []) for k in sorted(H200_SWEEPS)])
def h200_predictions(request) -> tuple[str, list[tuple[str, dict, object]]]:
    """(model, [(mode, measured run, plan)]) for every successful H200 sweep
    run of a benchmark model; one explain per model for every mode and P."""
    kind = request.param
    meta = torch.device("meta")
    model = build_model(kind, False, torch.bfloat16, meta)
    model.config.use_cache = False  # Dynamo cannot trace an empty cache tensor on the meta device
    R = 1024
    group = grpo_models.make_group(8, 4 * 8192, R, model.config.vocab_size, meta)
    with qwen3_5.bound():  # the sweeps predate the chunked LM head: their replays ran it whole
        report = longstraw.explain(grpo_loss, model, group.input_ids, group.advantages, group.mask, R,
                                   options={"head_chunk_size": None})
    predictions = []
    for mode, names in H200_SWEEPS[kind].items():
        for name in names:
            measured = json.loads((H200_RESULTS / name).read_text())
            for run in (r for r in measured["sweep"][mode]["runs"] if r["ok"]):
                plan = report.plan(P=run["P"], G=run["G"], prompt_grad=mode.removeprefix("longstraw_"), device="cuda")
                predictions.append((mode, run, plan))
    return kind, predictions


def test_a_prompt_without_values_ends_where_the_loss_starts_reading():
    """TRL-style token ids on the meta device: whether the rows share a
    prefix cannot be checked, so the traced prompt is every position before
    the first logit the loss reads, as in the simulation."""
    meta = torch.device("meta")
    model = build_model("dense", True, torch.float32, meta)
    model.config.use_cache = False
    group = grpo_models.make_group(3, 40, 6, model.config.vocab_size, meta)
    report = longstraw.explain(grpo_loss, model, group.input_ids, group.advantages, group.mask, 6)
    assert (report.traced_prompt_len, report.traced_response_len) == (40, 7)  # a branch runs R + 1 positions
    plan = report.plan(P=1000)
    assert plan.R == 7
    assert plan.state_grad == report.state_bytes_per_position * 999


def test_predicted_peak_matches_the_h200_measurements(h200_predictions):
    """The benchmark slices (4-layer Qwen3-8B-shaped dense, 3+1-layer
    Qwen3.5 hybrid), traced on the meta device (no weights, no GPU),
    predict the peaks the H200 measured for them within 10%, in both modes
    and at every P of the sweeps (8K to 1M)."""
    kind, predictions = h200_predictions
    for mode, run, plan in predictions:
        assert abs(plan.peak / 1e9 - run["peak_gb"]) <= 0.1 * run["peak_gb"], (kind, mode, run["P"], plan.table())
    assert {mode for mode, _, _ in predictions} == set(H200_SWEEPS[kind])
    assert {mode for mode, run, _ in predictions if run["P"] == 1 << 20} == set(H200_SWEEPS[kind])
    assert len(predictions) >= 14


# benchmarks/context_parallel_bench.py on the H200: two gloo ranks sharing the GPU, so each rank's peak
# is measured (the allocator's, per process) while their times are not a two-GPU step's. Not dense g
# and hybrid e: there the second rank dropped the branches' gradients, replicated then, for the
# reverse pass's rounds; the branches run in rounds since, and i, j and g measure the same steps now.
# j also has each process's one-process step (`--baseline`, "ranks": 1).
H200_CP_RUNS = {"dense": ["cp_bench_dense_b_h200.json", "cp_bench_dense_d_h200.json", "cp_bench_dense_f_h200.json",
                          "cp_bench_dense_i_h200.json", "cp_bench_dense_j_h200.json"],
                "hybrid": ["cp_bench_hybrid_a_h200.json", "cp_bench_hybrid_b_h200.json", "cp_bench_hybrid_c_h200.json",
                           "cp_bench_hybrid_f_h200.json", "cp_bench_hybrid_g_h200.json"]}
# the runs of today's runtime (rounds in the reverse pass and the branches, the convolution's carries
# copied), held closer: the dense slice's within 3% (planned from a trace at 32K, the largest shares'
# attention workspaces are read off `simulation.Peak`: without, 131K was 5.2% under); the hybrid's
# within 3% too, from 5% (the simulation runs fla's Gated DeltaNet backward through fake entry points:
# 21.41 GB planned against 21.17 measured, +1.2%; with the PyTorch kernel's backward 20.29, -4.2%)
H200_CP_CURRENT = {"dense": (["cp_bench_dense_i_h200.json", "cp_bench_dense_j_h200.json"], 0.03),
                   "hybrid": (["cp_bench_hybrid_g_h200.json"], 0.03)}


# under `-m slow` (40 s and 32 s on a CPU): CI plans one rank of a context-parallel run through
# `explain` (tests/test_cli.py) and checks the one-GPU predictions against the H200's runs above
@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(H200_CP_RUNS))
def test_predicted_per_rank_peak_matches_the_h200_context_parallel_runs(kind):
    """Context parallelism over 2 ranks: the plan of one rank
    (`plan(P, ranks=2)`) predicts each rank's measured peak within 10%, in
    both modes, from 32K to 1M positions, and today's runtime closer
    (`H200_CP_CURRENT`), with the one-process runs of the same command by
    the one-process plan; the one-process plan would overstate the larger
    two-rank runs by more than 10% (the state halves)."""
    meta = torch.device("meta")
    model = build_model(kind, False, torch.bfloat16, meta)
    model.config.use_cache = False
    R = 1024
    group = grpo_models.make_group(8, 4 * 8192, R, model.config.vocab_size, meta)
    with qwen3_5.bound():
        report = longstraw.explain(grpo_loss, model, group.input_ids, group.advantages, group.mask, R,
                                   options={"prefix_chunk_size": 8192, "recompute_layers": False})
    current, close = H200_CP_CURRENT[kind]
    runs = []
    for name in H200_CP_RUNS[kind]:
        measured = json.loads((H200_RESULTS / name).read_text())
        assert (measured["ranks"], measured["shared_gpu"], measured["prefix_chunk_size"]) == (2, True, 8192)
        runs += [(name, r) for r in measured["runs"] if r["ok"]]
    for name, run in runs:
        ranks = run.get("ranks", 2)
        plan = report.plan(P=run["P"], G=run["G"], prompt_grad=run["mode"], device="cuda", ranks=ranks)
        assert plan.ranks == ranks
        for peak in run["peak_gb_per_rank"]:
            bound = close if name in current else 0.1
            assert abs(plan.peak / 1e9 - peak) <= bound * peak, (kind, name, run["mode"], run["P"], plan.table())
    two = [run for _, run in runs if run.get("ranks", 2) == 2]
    largest = max(two, key=lambda r: r["P"])
    one_process = report.plan(P=largest["P"], G=largest["G"], prompt_grad=largest["mode"], device="cuda", ranks=1)
    assert one_process.peak / 1e9 > 1.1 * largest["peak_gb"]
    assert {r["mode"] for r in two} == {"detached", "exact"}
    assert largest["P"] >= (1 << 19)
    assert any(name in current for name, _ in runs)


# 64-layer runs of benchmarks/depth_bench.py on the H200 (LoRA, recompute_layers): exact from
# the code that keeps attention's forward through recomputation and graphs the spans (m, o; s
# with cuDNN's attention, whose memory the simulation models as flash's); u with the adapters
# in bf16 (peft's default is float32 for a bf16 base); w also with the chunked LM head and
# attention_outputs_on_host, which the simulation runs as attention's forward kept through
# recomputation (the fake tensors have no values to keep on the host); x as w, with the host
# outputs read through a window of two entries; y2 as x over two gloo ranks sharing the GPU
# (context parallelism: each rank's peak against the plan of one rank)
DEPTH_RUNS = {
    "float32_adapters": ["depth_bench_k_h200.json", "depth_bench_m_h200.json", "depth_bench_o_h200.json",
                         "depth_bench_s_h200.json"],
    "bf16_adapters": ["depth_bench_u_h200.json", "depth_bench_w_h200.json", "depth_bench_x_h200.json",
                      "depth_bench_y2_h200.json"],
}


@pytest.mark.slow
@pytest.mark.parametrize("adapters", list(DEPTH_RUNS))
def test_predicted_peak_matches_the_full_depth_h200_runs(adapters):
    """The full depth: 64 layers of Qwen3.5-27B shape with peft LoRA, traced
    on the meta device, predict the peaks the H200 measured within 10%, in
    both modes, from 32K to 786K positions and in chunks of 4096 and 8192,
    with peft's float32 adapters and with bf16 ones; and each rank's peak
    of the step over two ranks (context parallelism) by the plan of one."""
    import depth_bench

    results = [json.loads((H200_RESULTS / name).read_text()) for name in DEPTH_RUNS[adapters]]
    assert all(r.get("float32_adapters", True) == (adapters == "float32_adapters") for r in results)
    runs = [r for result in results for r in result["runs"] if r["ok"] and r["layers"] == 64]
    if adapters == "float32_adapters":
        assert {("detached", 786432), ("exact", 32768), ("exact", 262144)} <= {(r["mode"], r["P"]) for r in runs}
    else:
        assert {("exact", 262144), ("exact", 393216)} <= {(r["mode"], r["P"]) for r in runs}
    meta = torch.device("meta")
    with qwen3_5.bound():
        model = depth_bench.build(64, False, torch.bfloat16, meta, lora=True,
                                  float32_adapters=adapters == "float32_adapters")
        model.config.use_cache = False
        group = grpo_models.make_group(8, 2 * 8192, 1024, model.config.vocab_size, meta)
        reports = {
            head_chunk: longstraw.explain(grpo_loss, model, group.input_ids, group.advantages, group.mask, 1024,
                                          options={"head_chunk_size": head_chunk})
            for head_chunk in {r["options"].get("head_chunk_size") for r in runs}  # older runs: the head whole
        }
    for run in runs:
        ranks = run.get("ranks", 1)
        plan = reports[run["options"].get("head_chunk_size")].plan(
            P=run["P"], G=run["G"], prompt_grad=run["mode"], device="cuda",
            prefix_chunk_size=run["options"]["prefix_chunk_size"], recompute_layers=run["options"]["recompute_layers"],
            ranks=ranks)
        for peak in run.get("peak_gb_per_rank", [run["peak_gb"]]):
            assert abs(plan.peak / GiB - peak) <= 0.1 * peak, (run["mode"], run["P"], ranks, plan.table())
    if adapters == "bf16_adapters":
        assert {r["mode"] for r in runs if r.get("ranks", 1) == 2} >= {"detached"}


# Qwen3.5-27B shapes at 8, 32 and 64 layers, chunks of 4096, over two ranks sharing the GPU (and at 8
# layers one process): exact 16K, the 8- and 32-layer runs traced (`depth_bench ...:trace`), and the
# full depth also detached at 32K. t32r2 (40.4 GB per rank, kept) ran before `carry._round_forward`
# kept aliases of its carries: a reference cycle through the autograd context held every recomputed
# layer's graph through the chunk's backward, about 1 GB per period of four layers (t32r2b: 35.2, its
# reverse pass 35.0); at 64 layers z2 ran out of memory where z3 ran.
DEPTH_GROWTH_RUNS = ["depth_bench_t8r1_h200.json", "depth_bench_t8r2_h200.json", "depth_bench_t32r2b_h200.json",
                     "depth_bench_z3_h200.json", "depth_bench_z3d_h200.json"]


@pytest.mark.slow
def test_predicted_peak_grows_with_depth_as_the_h200_runs():
    """8, 32 and 64 layers of Qwen3.5-27B shape over one and two ranks:
    the plan of each depth predicts each rank's peak within 3%, exact at
    every depth and detached at the full depth."""
    import depth_bench

    by_layers: dict[int, list[dict]] = {}
    for name in DEPTH_GROWTH_RUNS:
        result = json.loads((H200_RESULTS / name).read_text())
        assert not result["float32_adapters"] and result["runs"]
        for run in result["runs"]:
            assert run["ok"] and ("live_at_peak" in run or run["layers"] == 64)
            by_layers.setdefault(run["layers"], []).append(run)
    assert sorted(by_layers) == [8, 32, 64]
    assert {r["mode"] for r in by_layers[64]} == {"exact", "detached"}
    meta = torch.device("meta")
    for layers, runs in by_layers.items():
        with qwen3_5.bound():
            model = depth_bench.build(layers, False, torch.bfloat16, meta, lora=True, float32_adapters=False)
            model.config.use_cache = False
            group = grpo_models.make_group(8, 2 * 8192, 1024, model.config.vocab_size, meta)
            report = longstraw.explain(grpo_loss, model, group.input_ids, group.advantages, group.mask, 1024,
                                       options={"head_chunk_size": 256})
        for run in runs:
            ranks = run["ranks"]
            plan = report.plan(P=run["P"], G=run["G"], prompt_grad=run["mode"], device="cuda", ranks=ranks,
                               prefix_chunk_size=run["options"]["prefix_chunk_size"],
                               recompute_layers=run["options"]["recompute_layers"])
            for peak in run.get("peak_gb_per_rank", [run["peak_gb"]]):
                assert abs(plan.peak / 1e9 - peak) <= 0.03 * peak, (layers, ranks, peak, plan.table())


# (layers, state B, decompressed K/V B) per layer and prompt position, bf16
FULL_MODELS = {"GLM-5.1": (78, (512 + 64 + 128) * 2, 64 * (192 + 64 + 256) * 2),
               "DeepSeek-V3": (61, (512 + 64) * 2, 128 * (128 + 64 + 128) * 2)}


# Every layer and routed expert on the meta device: Dynamo traces 78 (61)
# layers and the planner simulates them (about 80 s and 40 s on a CPU).
@pytest.mark.slow
@pytest.mark.parametrize("name", list(FULL_MODELS))
def test_state_at_full_glm5_1_and_deepseek_v3_shapes(name):
    """GLM-5.1 and DeepSeek-V3 from their full configs, traced on the meta
    device (`benchmarks/state_bytes.py`): every layer captures the latent
    and the rope key, and GLM's index key, never decompressed K/V."""
    import state_bytes

    config, layers = state_bytes.state_by_layer(name)
    index_key = getattr(config, "index_head_dim", 0)  # DSA's indexer (GLM); DeepSeek-V3 has none
    state = (config.kv_lora_rank + config.qk_rope_head_dim + index_key) * 2
    tensors = [config.kv_lora_rank * 2, config.qk_rope_head_dim * 2] + ([index_key * 2] if index_key else [])
    assert layers == {f"model.model.layers.{i}.self_attn": tensors for i in range(config.num_hidden_layers)}
    per_head = config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim  # key (nope + rope), value
    decompressed = config.num_attention_heads * per_head * 2
    assert state_bytes.decompressed_bytes(config) == decompressed
    assert (config.num_hidden_layers, state, decompressed) == FULL_MODELS[name]
    assert config.n_routed_experts == 256


def test_graph_views_show_regions_and_state_edges(tmp_path):
    report = longstraw.explain(grpo_loss_f64, make_model("qwen3"), *make_group(2, 20, 4))
    regions = {d["region"] for _, d in report.graph.nodes(data=True)}
    assert {"prefix", "branch", "tail", "state"} <= regions
    state_edges = [(a, b) for a, b, d in report.graph.edges(data=True) if d.get("state")]
    assert len(state_edges) >= 2 * len(report.state)  # captured node -> state -> reading operator
    dot = report.to_dot()
    assert "subgraph cluster_prefix" in dot and "subgraph cluster_branch" in dot and "subgraph cluster_tail" in dot
    assert dot.count('color="#d62728", penwidth=2') == len(state_edges)
    page = tmp_path / "plan.html"
    report.to_html(str(page), P=1 << 20, G=8, R=1024, budget_gb=141)
    text = page.read_text()
    assert "http://" not in text.replace("http://www.w3.org/2000/svg", "")  # self-contained
    data = json.loads(re.search(r"const DATA = (.*);\n", text).group(1).replace("<\\/", "</"))
    assert {n["region"] for n in data["nodes"]} >= {"prefix", "branch", "tail", "state"}
    assert len(data["stateEdges"]) == len(state_edges)
    assert "predicted peak" in text


def mixing_loss(model, prompt, responses, advantages, mask):
    """A running sum over positions before the model: no pass claims it."""
    ids = torch.cat([prompt.expand(responses.shape[0], -1), responses], dim=1)
    embeds = model.get_input_embeddings()(ids).cumsum(1)
    logits = model(inputs_embeds=embeds).logits[:, prompt.shape[0] - 1 : -1]
    return pg_tail(logits, responses, advantages, mask)


def test_explain_reports_unsupported_graphs():
    with raises_longstraw(r"cumsum.*on_unsupported"):
        longstraw.explain(mixing_loss, make_model("qwen3"), *make_group(2, 20, 4), options={"on_unsupported": "eager"})


ARTIFACTS = pathlib.Path(os.environ.get("LONGSTRAW_TEST_ARTIFACTS", REPO / "test-artifacts"))


def test_html_in_a_headless_browser(tmp_path):
    """The page loads in Chromium without console messages, draws the three
    regions and the state edges; a screenshot is kept in test-artifacts/."""
    try:
        browser.chromium()
    except browser.NoBrowser as err:
        pytest.skip(str(err))
    with qwen3_5.bound():
        report = longstraw.explain(grpo_loss_f64, make_hybrid(), *make_group(3, 40, 6))
    page = tmp_path / "plan.html"
    report.to_html(str(page), P=1 << 20, G=8, R=2048, budget_gb=141)
    url = page.as_uri()
    dom = browser.run(url, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert browser.console_messages(dom.stderr) == []
    for region in ("prefix", "branch", "tail", "state"):
        assert f'id="region-{region}"' in dom.stdout
    edges = dom.stdout.count('class="state-edge"')
    assert edges == sum(1 for *_, d in report.graph.edges(data=True) if d.get("state")) > 0
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "explain_qwen3_5.png"
    shot.unlink(missing_ok=True)
    done = browser.run(url, f"--screenshot={shot}", "--window-size=1400,1000")
    assert done.returncode == 0 and shot.stat().st_size > 10_000


def test_console_errors_are_caught(tmp_path):
    """The console check above can fail: a page with an error is reported."""
    try:
        browser.chromium()
    except browser.NoBrowser as err:
        pytest.skip(str(err))
    page = tmp_path / "bad.html"
    page.write_text("<html><body><script>undefinedFunction();</script></body></html>")
    result = browser.run(page.as_uri(), "--dump-dom")
    assert any("undefinedFunction" in line for line in browser.console_messages(result.stderr))


def test_explaining_for_several_models_leaves_the_loss_s_compiles_alone():
    """Each model is a new guard of the loss: explain compiles a copy of it,
    so explaining it for more models than `recompile_limit` allows neither
    raises nor leaves compiled code on the loss the user compiles, and the
    user's first compile of the loss afterwards is its only one."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    group = make_group(2, 9, 3)
    with torch._dynamo.config.patch(recompile_limit=2):
        for seed in range(3):
            report = longstraw.explain(grpo_loss_f64, make_model("plain", seed=seed), *group)
            assert report.state_bytes_per_position > 0
        assert _debug_get_cache_entry_list(grpo_loss_f64.__code__) == []
        compile_loss(grpo_loss_f64, longstraw.Backend())(make_model("plain", seed=3), *group)
        assert len(_debug_get_cache_entry_list(grpo_loss_f64.__code__)) == 1
