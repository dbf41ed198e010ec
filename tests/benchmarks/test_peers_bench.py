"""benchmarks/peers_bench.py's modes on a tiny model on the CPU: every peer
computes TRL's loss and gradients on TRL's micro-batch (two prompts, one
left-padded, right-padded completions), LongStraw detached aside."""

from __future__ import annotations

import sys

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("prefix_grouper")

from helpers.paths import BENCHMARKS  # noqa: E402

sys.path.insert(0, str(BENCHMARKS))
from grpo.models import build_model  # noqa: E402
from grpo.parity import compare, grads_of  # noqa: E402
from peers.batch import trl_micro_batch  # noqa: E402
from peers.modes import PeerRunner  # noqa: E402

CPU = torch.device("cpu")
N_PROMPTS, G, P, R = 2, 3, 24, 6


def loss_and_grads(model, mode, batch):
    with PeerRunner(model, mode, N_PROMPTS * G, G, R) as runner:
        loss = runner.step(batch)
    return loss, grads_of(model)


def test_peers_compute_trls_loss_and_gradients():
    model = build_model("dense", True, torch.float64, CPU)
    batch = trl_micro_batch(N_PROMPTS, G, P, R, model.config.vocab_size, CPU)
    assert (batch["prompt_mask"] == 0).any() and (batch["completion_mask"] == 0).any()
    want_loss, want = loss_and_grads(model, "trl_eager", batch)
    for mode in ("trl_ckpt", "prefix_grouper", "longstraw_exact"):
        loss, got = loss_and_grads(model, mode, batch)
        torch.testing.assert_close(loss, want_loss, rtol=1e-9, atol=0, msg=lambda m: f"{mode}: {m}")
        result = compare(got, want)
        # HF's RoPE and norms round through float32 (as in the parity tests)
        assert result["max_rel_l2"] < 1e-6, (mode, result)
    loss, got = loss_and_grads(model, "longstraw_detached", batch)
    torch.testing.assert_close(loss, want_loss, rtol=1e-9, atol=0)
    assert compare(got, want)["max_rel_l2"] > 1e-3  # the prompt's term is dropped by design


def test_length_loop_bench_runs_on_the_cpu(tmp_path, monkeypatch):
    """benchmarks/length_loop_bench.py end to end on tiny shapes: the warm
    step, the loop of new lengths, and LongStraw's count of Dynamo
    compiles in the loop (none: the scorer is traced with dynamic sizes)
    and of plans (one per new length), the run in a process of its own
    (cuDNN's plans are per process)."""
    import json

    import length_loop_bench

    argv = ["length_loop_bench.py", "--tiny", "--P", "48", "--G", "2", "--R", "8", "--steps", "2",
            "--modes", "longstraw_exact", "--out-dir", str(tmp_path), "--name", "loop"]
    monkeypatch.setattr(sys, "argv", argv)
    length_loop_bench.main()
    runs = {run["mode"]: run for run in json.loads((tmp_path / "loop.json").read_text())["runs"]}
    assert all(run["ok"] for run in runs.values()), runs
    assert len(runs["longstraw_exact"]["loop_s"]) == 2
    assert runs["longstraw_exact"]["dynamo_graphs"] == 0 and runs["longstraw_exact"]["plans"] == 2
    assert runs["longstraw_exact"]["gated_attention_calls"] == {"cudnn": 0, "flash": 0}  # no fused kernel on the CPU
    assert "| longstraw_exact | 48 |" in (tmp_path / "loop.md").read_text()
    assert json.loads((tmp_path / "loop.json").read_text())["isolated"]


# detached mode's kept graphs against its replays: tests/runtime/test_backward.py in CI
@pytest.mark.parametrize("mode", ["longstraw_exact", pytest.param("longstraw_detached", marks=pytest.mark.slow)])
def test_kept_graphs_through_trl_give_trls_gradients(mode):
    """LongStraw with `keep_graphs=True` through TRL's `compute_loss`:
    exact gives TRL's gradients, detached its own (replayed) ones."""
    model = build_model("dense", True, torch.float64, CPU)
    batch = trl_micro_batch(N_PROMPTS, G, P, R, model.config.vocab_size, CPU)
    want_loss, want = loss_and_grads(model, "trl_eager" if mode == "longstraw_exact" else mode, batch)
    with PeerRunner(model, mode, N_PROMPTS * G, G, R, {"keep_graphs": True, "prefix_chunk_size": 8,
                                                        "recompute_layers": False}) as runner:
        loss = runner.step(batch)
        assert runner.trainer.longstraw_backend.plans[-1].runner.keeps_branch_graphs
    torch.testing.assert_close(loss, want_loss, rtol=1e-9, atol=0)
    assert compare(grads_of(model), want)["max_rel_l2"] < 1e-6, mode


def test_step_profile_runs_on_the_cpu(tmp_path, monkeypatch):
    """benchmarks/step_profile.py end to end on tiny shapes: per mode the
    first and warm steps, the operator tables, LongStraw's phases (here
    the kept graphs' differentiation in place of replays) and its plan."""
    import json

    import step_profile

    argv = ["step_profile.py", "--tiny", "--P", "48", "--G", "2", "--R", "8", "--modes", "longstraw_exact,prefix_grouper",
            "--options", '{"keep_graphs": true, "recompute_layers": false, "prefix_chunk_size": 16}', "--top", "3",
            "--new-length", "--in-process", "--out-dir", str(tmp_path), "--name", "profile"]
    monkeypatch.setattr(sys, "argv", argv)
    step_profile.main()
    runs = {run["mode"]: run for run in json.loads((tmp_path / "profile.json").read_text())["runs"]}
    assert all(run["ok"] for run in runs.values()), runs
    exact = runs["longstraw_exact"]
    assert exact["plan"]["keeps_graphs"] and {"differentiating the kept prompt", "differentiating the kept branch"} <= set(exact["phases_s"])
    assert "replaying branch" not in exact["phases_s"] and "in the reverse pass" not in exact["phases_s"]
    assert "host profile" in (tmp_path / "profile.txt").read_text()
    assert exact["host_syncs"] == 0  # counted from the profile's runtime calls: the CPU has no device to wait on
    # the warm step's steps by kind: one capture per prompt, every branch kept and differentiated
    steps = exact["steps"]
    assert steps["capturing prompt chunk"] >= 1 and steps["differentiating the kept prompt chunk"] >= 1
    running = sum(n * int(k.split()[1].split("-")[0]) for k, n in steps.items() if k.startswith("running "))
    kept = sum(n * int(k.split()[3].split("-")[0]) for k, n in steps.items() if k.startswith("differentiating the kept ")
               and k.endswith("branch steps"))
    assert running == kept == 4, steps  # 2 prompts x G = 2
    assert exact["first"]["dynamo_compiles"] >= 1 and exact["first"]["plans"] == 1
    assert 0 < exact["first"]["plan_s"] and 0 < exact["first"]["dynamo_s"] < exact["first"]["s"]
    new = exact["new_length"]
    assert new["lengths"] == [39, 32] and new["first_s"] > 0 and "differentiating the kept branch" in new["phases_s"]
    assert new["next"]["plans"] == 1 and new["next"]["dynamo_compiles"] == 0  # dynamic sizes since the second length
    assert "first call at prompt lengths [39, 32]" in (tmp_path / "profile.txt").read_text()


def test_trainer_loop_bench_runs_on_the_cpu(tmp_path, monkeypatch):
    """benchmarks/trainer_loop_bench.py end to end on tiny shapes: TRL's
    default and LongStraw train two steps each, generation included, and
    each step's parts add up to its time."""
    import json

    import trainer_loop_bench

    argv = ["trainer_loop_bench.py", "--tiny", "--P", "40", "--R", "6", "--steps", "2",
            "--out-dir", str(tmp_path), "--name", "loop"]
    monkeypatch.setattr(sys, "argv", argv)
    trainer_loop_bench.main()
    runs = {run["mode"]: run for run in json.loads((tmp_path / "loop.json").read_text())["runs"]}
    assert set(runs) == {"trl_ckpt", "longstraw_exact"} and all(run["ok"] for run in runs.values()), runs
    for run in runs.values():
        assert len(run["steps"]) == 2
        for step in run["steps"]:
            assert all(step[part] >= 0 for part in trainer_loop_bench.PARTS), step
            assert abs(sum(step[part] for part in trainer_loop_bench.PARTS) - step["total"]) < 1e-6
            assert step["generation"] > 0 and step["loss"] > 0 and step["backward"] > 0
    assert runs["longstraw_exact"]["plans"] >= 1
    assert "| longstraw_exact | 40 |" in (tmp_path / "loop.md").read_text()


def test_trainer_loop_bench_records_where_a_run_stopped(tmp_path, monkeypatch):
    """A run that fails (here generation running out of memory at the
    second step) is recorded with the part it failed in and the steps it
    finished; a step's prompts share one length (no padded generation batch)."""
    import json

    import trainer_loop_bench

    drawn = trainer_loop_bench.prompts(3, 2, 40, 64, seed=1)
    lengths = [len(p.split()) for p in drawn]
    assert len(lengths) == 6 and all(lengths[i] == lengths[i + 1] for i in range(0, 6, 2))
    assert all(35 <= n <= 40 for n in lengths)
    generate = trainer_loop_bench.LongStrawGRPOTrainer._generate
    calls = []

    def failing_generate(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 10.57 GiB (simulated)")
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(trainer_loop_bench.LongStrawGRPOTrainer, "_generate", failing_generate)
    argv = ["trainer_loop_bench.py", "--tiny", "--P", "40", "--R", "6", "--steps", "2", "--modes", "longstraw_exact",
            "--out-dir", str(tmp_path), "--name", "loop"]
    monkeypatch.setattr(sys, "argv", argv)
    trainer_loop_bench.main()
    (run,) = json.loads((tmp_path / "loop.json").read_text())["runs"]
    assert not run["ok"] and run["oom"] and run["failed_in"] == "generation" and run["steps_done"] == 1, run
    assert "| longstraw_exact | 40 | OOM in generation of step 2 |" in (tmp_path / "loop.md").read_text()


def test_hybrid_peers_compute_trls_loss_and_gradients():
    """peers_bench --model hybrid: LongStraw exact through TRL on the Qwen3.5
    hybrid slice (Gated DeltaNet and full attention, left-padded prompts)
    gives TRL's loss and gradients."""
    from longstraw.models import qwen3_5

    model = build_model("hybrid", True, torch.float64, CPU)
    batch = trl_micro_batch(N_PROMPTS, G, P, R, model.config.vocab_size, CPU)
    with qwen3_5.bound():
        want_loss, want = loss_and_grads(model, "trl_eager", batch)
        loss, got = loss_and_grads(model, "longstraw_exact", batch)
    torch.testing.assert_close(loss, want_loss, rtol=1e-9, atol=0)
    # HF's norms round through float32 in both (as in the family tests, 1e-6 there at their smaller
    # shapes); here the Gated DeltaNet gate's projection gathers 1.04e-6 of it over 24 prompt positions
    assert compare(got, want)["max_rel_l2"] < 2e-6, compare(got, want)


def test_trl_modes_call_hf_s_gated_delta_where_fla_does_not_apply():
    """The peers' Hopper-safe Gated DeltaNet (`peers.gated_delta`) stands in
    for HF's function during TRL's modes only, and off CUDA calls HF's own
    (here TRL's eager step on the hybrid slice, HF's function recorded)."""
    import importlib

    from peers import gated_delta

    module = importlib.import_module(gated_delta.HF_MODULES[0])
    hf = module.torch_chunk_gated_delta_rule
    calls = []
    module.torch_chunk_gated_delta_rule = lambda *a, **k: calls.append(1) or hf(*a, **k)
    try:
        model = build_model("hybrid", True, torch.float64, CPU)
        batch = trl_micro_batch(N_PROMPTS, G, P, R, model.config.vocab_size, CPU)
        with PeerRunner(model, "trl_eager", N_PROMPTS * G, G, R) as runner:
            assert module.torch_chunk_gated_delta_rule.__name__ == "chunk_gated_delta_rule"  # the drop-in
            runner.step(batch)
        assert calls and module.torch_chunk_gated_delta_rule.__name__ == "<lambda>"  # restored on exit
    finally:
        module.torch_chunk_gated_delta_rule = hf


@pytest.mark.gpu
def test_hopper_safe_gated_delta_matches_the_reference():
    """On CUDA in bf16: fla's forward and LongStraw's backward through HF's
    call signature give the float64 reference's output and input gradients
    (`gated_delta_rule_reference`), within fla's own forward error."""
    from peers import gated_delta

    from longstraw.runtime.kernels import fla_gated_delta
    from longstraw.runtime.kernels.gated_delta import gated_delta_rule_reference

    if fla_gated_delta.fla_ops() is None:
        pytest.fail("flash-linear-attention is not installed: this test checks its kernels")
    gen = torch.Generator().manual_seed(0)
    B, L, Hk, Hv, D = 2, 1000, 2, 4, 64
    bf16 = lambda *s: torch.randn(*s, generator=gen).cuda().bfloat16()  # noqa: E731
    q, k, v = bf16(B, L, Hk, D), bf16(B, L, Hk, D), bf16(B, L, Hv, D)
    g = (-torch.rand(B, L, Hv, generator=gen) * 0.2).cuda()
    beta = torch.rand(B, L, Hv, generator=gen).cuda().bfloat16()
    grad_out = bf16(B, L, Hv, D)
    inputs = [x.requires_grad_() for x in (q, k, v, g, beta)]
    fallback = lambda *a, **kw: pytest.fail("HF's function ran where fla applies")  # noqa: E731
    out, state = gated_delta.drop_in(fallback)(*inputs[:3], g=inputs[3], beta=inputs[4], use_qk_l2norm_in_kernel=True)
    assert state is None
    got = torch.autograd.grad(out, inputs, grad_out)
    exact = [x.detach().double().requires_grad_() for x in inputs]
    zero = torch.zeros(B, Hv, D, D, dtype=torch.float64, device="cuda")
    want_out, _ = gated_delta_rule_reference(*exact, zero, True)
    want = torch.autograd.grad(want_out, exact, grad_out.double())
    error = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
    forward = error(out, want_out)
    assert forward < 3e-2
    for name, a, b in zip("qkvgb", got, want):
        assert error(a, b) < max(3e-2, 10 * forward), name
