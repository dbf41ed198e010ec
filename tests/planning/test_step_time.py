"""`longstraw.planning.step_time`: a step's FLOPs and operators as functions
of its sizes, fitted from one simulated step, against a real step's at
another prompt length; and the phases a plan's kept graphs leave."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import sys

import pytest
import torch

import longstraw
from longstraw.planning.planner import KeptGraphs
from longstraw.planning.step_time import StepCost, StepCount, StepWork, WorkRecorder, predict, simulate_work
from longstraw.models import qwen3_5
from longstraw.models.tiny import tiny_causal_lm
from longstraw.runtime.kernels import work

from helpers.losses import grpo_loss_f64
from helpers.tiny_models import make_group, make_qwen3_5

G, R, CHUNK = 3, 5, 8


def grpo_loss(model, prompt, responses, advantages):
    ids = torch.cat([prompt.expand(responses.shape[0], -1), responses], dim=1)
    logits = model(input_ids=ids).logits[:, prompt.shape[0] - 1 : -1]
    logp = torch.log_softmax(logits, -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    ratio = torch.exp(logp - logp.detach())
    return -(ratio * advantages[:, None]).mean()


def group(model, P: int):
    torch.manual_seed(P)
    vocab = model.config.vocab_size
    return (torch.randint(1, vocab, (P,)), torch.randint(1, vocab, (G, R)), torch.randn(G, dtype=torch.float64))


def counted_run(model, P: int, mode: str) -> list[StepCount]:
    """Every step's FLOPs and operators in a real compiled step at P (the CPU keeps no graphs)."""
    recorder = WorkRecorder()

    @contextlib.contextmanager
    def counting(where: str):
        with recorder, recorder.in_step(where):
            yield

    torch._dynamo.reset()
    step = torch.compile(grpo_loss, backend=longstraw.Backend(prompt_grad=mode, prefix_chunk_size=CHUNK))
    with longstraw.around_steps(counting):
        step(model, *group(model, P)).backward()
    return recorder.steps


@pytest.mark.parametrize("mode", ["exact", pytest.param("detached", marks=pytest.mark.slow)])
def test_predicted_work_matches_a_run_at_another_length(mode):
    """Fitted on a 24-token prompt, predicted for a 61-token one (a last
    chunk shorter than the others): the FLOPs and operators a real step
    counts, phase by phase."""
    model = tiny_causal_lm("qwen3", dtype=torch.float64)
    report = longstraw.explain(grpo_loss, model, *group(model, 24), options={"prefix_chunk_size": CHUNK,
                                                                            "prompt_grad": mode})
    time = report.plan(61, G=G, R=R, tflops=1.0, op_us=1.0).time
    steps = counted_run(model, 61, mode)
    flops, ops = sum(s.flops for s in steps), sum(s.ops for s in steps)
    assert time.flops == pytest.approx(flops, rel=0.025)
    assert time.ops == pytest.approx(ops, rel=0.15)
    by_phase = {p: f for p, f, _ in time.phases}
    capture = sum(s.flops for s in steps if s.where.startswith("capturing prompt chunk"))
    assert by_phase["capturing the prompt"] == pytest.approx(capture, rel=1e-6)
    # the prompt chunks skip the last layer's attention output (nothing reads it); the branches' count it
    branches = sum(s.flops for s in steps if s.where.startswith("running branch"))
    assert by_phase["running the branches"] == pytest.approx(branches, rel=0.01)
    reverse = [s for s in steps if s.where.startswith("in the reverse pass")]
    assert bool(reverse) == (mode == "exact")
    assert [p for p, *_ in time.phases] == ["capturing the prompt", "running the branches", "replaying the branches",
                                            *(["the reverse pass over the prompt"] if mode == "exact" else [])]


def test_fit_and_kept_graphs():
    """Exact costs from chunks of two lengths at three offsets and branches
    after four prompts; kept graphs leave the backward only (the replay or
    the reverse pass less its forward)."""
    truth = StepCost(0.0, 7.0, 3.0, 2.0, 11.0)
    head = StepCost(100.0, 8.0, 3.0, 2.0, 13.0)
    chunks = ((0, 8), (8, 8), (16, 5))
    steps = [StepCount(f"capturing prompt chunk [{o}, {o + n})", truth.flops(o, n), truth.ops) for o, n in chunks]
    steps += [StepCount(f"in the reverse pass over prompt chunk [{o}, {o + n}); no .grad was changed",
                        3 * truth.flops(o, n), 2 * truth.ops) for o, n in chunks[::-1]]
    for o in (21, 16, 11):  # three groups' branches, all ending at 25
        steps.append(StepCount(f"running branch 0 of 4 over [{o}, 25)", head.flops(o, 25 - o), head.ops))
        steps.append(StepCount(f"replaying branch 0 of 4 over [{o}, 25); no .grad was changed",
                               3 * head.flops(o, 25 - o), 2 * head.ops))
    work = StepWork.fitted(steps)
    for got, want in ((work.capture, truth), (work.branch, head)):
        assert dataclasses.astuple(got) == pytest.approx(dataclasses.astuple(want), abs=1e-6)
    assert work.reverse.per_earlier_key == pytest.approx(9.0) and work.replay.fixed == pytest.approx(300.0)

    replayed = predict(work, 101, 4, 6, True, 16, None, 1.0, 0.0)
    kept = predict(work, 101, 4, 6, True, 16, KeptGraphs(7, True, 3, 4, True), 1.0, 0.0)
    flops = {p: f for p, f, _ in replayed.phases}
    capture, branches = flops["capturing the prompt"], flops["running the branches"]
    assert replayed.flops == pytest.approx(4 * (capture + branches))  # a replay or reverse chunk: 3x its forward
    # 3 of 4 branches kept (their backward: 2x their forward), 1 replayed (3x), the prompt's graph kept (2x)
    assert kept.flops == pytest.approx(3 * capture + (1 + 0.75 * 2 + 0.25 * 3) * branches)
    detached = predict(work, 101, 4, 6, False, 16, None, 1.0, 0.0)
    assert "the reverse pass over the prompt" not in [p for p, *_ in detached.phases]
    assert dataclasses.replace(replayed, op_seconds=1e-3).seconds == pytest.approx(replayed.flops + 1e-3 * replayed.ops)


def test_branches_count_the_attention_the_prompt_chunks_skip():
    """A branch's cost per earlier key is the prompt chunks' plus the
    attention per earlier key only the branches run: on chunks that count no
    attention (a hybrid slice whose only attention layer is its last, which
    the chunks skip), all of the branches'. Without the attention FLOPs
    told apart, the branches' would be the chunks' (none)."""
    chunk = StepCost(0.0, 7.0, 0.0, 0.0, 11.0)
    head = StepCost(100.0, 8.0, 5.0, 5.0, 13.0)
    steps = [StepCount(f"capturing prompt chunk [{o}, {o + n})", chunk.flops(o, n), chunk.ops)
             for o, n in ((0, 8), (8, 8), (16, 5))]
    for o in (21, 16, 11):  # three groups' branches, all ending at 25
        n = 25 - o
        steps.append(StepCount(f"running branch 0 of 4 over [{o}, 25)", head.flops(o, n), head.ops, 5.0 * n * (o + n)))
        steps.append(StepCount(f"replaying branch 0 of 4 over [{o}, 25); no .grad was changed",
                               3 * head.flops(o, n), 2 * head.ops, 5.0 * n * (o + n)))
    work = StepWork.fitted(steps)
    assert dataclasses.astuple(work.branch) == pytest.approx(dataclasses.astuple(head), abs=1e-6)
    assert work.replay.per_earlier_key == pytest.approx(5.0)
    blind = StepWork.fitted([dataclasses.replace(s, attention_flops=0.0) for s in steps])
    assert blind.branch.per_earlier_key == pytest.approx(0.0, abs=1e-9)


def test_a_kernel_that_counts_its_own_arithmetic_replaces_what_it_dispatches():
    """Inside `kernels.work.counted_as`, a step counts the kernel's own
    FLOPs, once, and not those of the products it dispatches or of a kernel
    it runs that counts itself; its operators still count. With no
    recorder listening the count is never asked for."""
    a = torch.ones(4, 8)
    recorder = WorkRecorder()
    with recorder:
        with recorder.in_step("capturing prompt chunk [0, 4)"):
            a @ a.T
            with work.counted_as(lambda: 1000.0):
                a @ a.T
                with work.counted_as(lambda: 50.0):  # inside the outer kernel: part of its count
                    a @ a.T
    (step,) = recorder.steps
    assert (step.flops, step.ops) == (2 * 4 * 8 * 4 + 1000.0, 3)
    with work.counted_as(lambda: pytest.fail("counted with no recorder listening")):
        a @ a.T


@pytest.mark.slow  # CI's real fit of this is the qwen3 case of test_predicted_work_matches_a_run_at_another_length
def test_the_hybrid_s_branches_count_its_last_layer_s_attention():
    """The tiny Qwen3.5 hybrid whose one attention layer is its last: the
    branches' cost per earlier key is the chunks' plus that layer's
    attention, 4 x heads x head_dim FLOPs per query and key."""
    model = make_qwen3_5(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    with qwen3_5.bound():
        report = longstraw.explain(grpo_loss_f64, model, *make_group(4, 40, 6))
        work = simulate_work(report.group_plan.program, report.options, False, torch.device("cpu"), None)
    per_key = 4 * model.config.num_attention_heads * model.config.head_dim
    assert work.branch.per_earlier_key - work.capture.per_earlier_key == pytest.approx(per_key, rel=0.02)


def test_rates_predict_the_measured_steps():
    """`RATES` against the H200 steps they were fitted to (the dense slice
    on the meta device, 2 prompts of P and 7P/8 x G = 8, R = 1024, the
    prompt's graph kept, the branches replayed): within 15%."""
    benchmarks = pathlib.Path(__file__).parents[2] / "benchmarks"
    sys.path.insert(0, str(benchmarks))
    from grpo.models import build_model, grpo_loss

    measured = json.loads((benchmarks / "results/step_profile_dense_b_h200.json").read_text())
    warm = {run["P"]: run["warm_s"] for run in measured["runs"] if run["mode"] == "longstraw_exact"}
    model = build_model("dense", tiny=False, dtype=torch.bfloat16, device=torch.device("meta"))
    model.config.use_cache = False
    ids = torch.zeros(8, 96 + 1024, dtype=torch.long, device="meta")
    adv, mask = torch.zeros(8, device="meta"), torch.ones(8, 1024, device="meta")
    report = longstraw.explain(grpo_loss, model, ids, adv, mask, 1024, options={"prefix_chunk_size": 32})
    for P, seconds in warm.items():
        steps = [report.plan(p, G=8, R=1024, device="cuda", prefix_chunk_size=8192) for p in (P, P - P // 8)]
        kept = [dataclasses.replace(s.time, phases=tuple(_kept_prompt(s.time.phases))) for s in steps]
        assert sum(t.seconds for t in kept) == pytest.approx(seconds, rel=0.15), (P, [t.lines() for t in kept])


def _kept_prompt(phases):
    """The phases with the prompt's graph kept: the reverse pass less the capture's forward."""
    capture = next((f, o) for p, f, o in phases if p == "capturing the prompt")
    for phase, f, o in phases:
        if phase == "the reverse pass over the prompt":
            yield "differentiating the kept prompt", f - capture[0], o - capture[1]
        else:
            yield phase, f, o


def test_costs_that_come_out_negative_give_no_time():
    """A fit whose cost per own key is negative holds at short spans and not
    at long ones: there `predict` refuses instead of printing a negative
    time, naming the cause by where the negative cost is. In the prompt
    chunks' fit: an operator counted in whole blocks that does not count
    its own arithmetic; in the branches' alone: attention the chunks skip
    that no attention operator counted."""
    capture = StepCost(0.0, 7.0, 0.0, 0.0, 11.0)
    reverse = StepCost(0.0, 21.0, 0.0, -0.5, 30.0)
    branch = StepCost(100.0, 8.0, 0.0, 0.0, 13.0)
    work = StepWork(capture, reverse, branch, StepCost(300.0, 24.0, 0.0, 0.0, 40.0))
    assert predict(work, 33, 4, 6, True, 16, None, 1.0, 0.0).flops > 0
    with pytest.raises(ValueError, match="the reverse pass over the prompt negative FLOPs at P=4097, R=6: the prompt "
                                         "chunks' counted FLOPs do not grow"):
        predict(work, 4097, 4, 6, True, 4096, None, 1.0, 0.0)
    short_branch = StepWork(capture, None, StepCost(100.0, 8.0, 0.0, -0.5, 13.0), branch)
    assert predict(short_branch, 33, 4, 6, True, 16, None, 1.0, 0.0).flops > 0
    with pytest.raises(ValueError, match="running the branches negative FLOPs at P=33, R=64: the branches' fit "
                                         "does not hold"):
        predict(short_branch, 33, 4, 64, True, 16, None, 1.0, 0.0)


@pytest.mark.slow  # CI's cases of this: the formula (test_gated_delta_kernel.py) and the recorder's own count above
def test_the_hybrid_s_gated_delta_rule_is_counted_per_position():
    """The tiny Qwen3.5 hybrid fitted at a 24-position prompt: its chunked
    gated delta rule (PyTorch's, on the CPU) computes in 64-position blocks
    but counts its products per position (`gated_delta_flops`), so the
    prompt chunks' fit holds at every length. Predicted for 61 positions,
    the FLOPs a real step counts; at a million, a time. Counted in blocks,
    every chunk of the fit cost one block, and the capture at 61 positions
    was predicted at 59% of what a real step counted."""
    model = make_qwen3_5(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    with qwen3_5.bound():
        report = longstraw.explain(grpo_loss, model, *group(model, 24), options={"prefix_chunk_size": CHUNK})
        time = report.plan(61, G=G, R=R, tflops=1.0, op_us=1.0).time
        steps = counted_run(model, 61, "exact")
    by_phase = {p: f for p, f, _ in time.phases}
    capture = sum(s.flops for s in steps if s.where.startswith("capturing prompt chunk"))
    assert by_phase["capturing the prompt"] == pytest.approx(capture, rel=1e-6)
    reverse = sum(s.flops for s in steps if s.where.startswith("in the reverse pass"))
    assert by_phase["the reverse pass over the prompt"] == pytest.approx(reverse, rel=1e-6)
    assert time.flops == pytest.approx(sum(s.flops for s in steps), rel=0.025)
    long = report.plan(1 << 20, G=8, R=1024, tflops=1.0, op_us=1.0, budget_gb=None, prefix_chunk_size=8192,
                       recompute_layers=False)
    assert long.time is not None and long.time.flops > 0
