"""Keeping the forward's autograd graphs for the backward
(`Options.keep_graphs`, longstraw/runtime/backward.py, `KeptChunk`, `GroupCall.branches`):
the backward differentiates each kept branch instead of replaying it, and
in exact mode each kept prompt chunk, last to first, instead of running
its forward again. Float64 parity against eager with NaN-filled
uninitialised memory and `verify_state`; where a graph is not kept (a
carried state, layer-wise recomputation, no room, outer-graph inputs
with a gradient) the replays and the reverse pass run as before, with
the same gradients.
"""

from __future__ import annotations

import ast
import contextlib
import pathlib
from collections.abc import Iterator

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import longstraw
from longstraw import pipeline
from longstraw.passes.mla import LatentAttentionPass
from longstraw.planning.sizing import KeptRoom
from longstraw.runtime import backward
from longstraw.runtime.phases import phase_of
from longstraw.runtime.runner import GroupRunner

from helpers.batches import batch_loss, detached_batch_reference, make_batch
from helpers.compare import assert_grads_close
from helpers.families import FAMILIES
from helpers.harness import assert_parity, compile_loss, compiled_loss_and_grads
from helpers.padding import check_padding_parity, padded_group
from helpers.parity import deterministic_algorithms

TOL = 1e-6


@contextlib.contextmanager
def phases() -> Iterator[list[str]]:
    """The runtime phases (`longstraw.runtime.runner.phase_of`) of the steps run
    inside, in order; not the planner's simulation (on fake tensors)."""
    seen: list[str] = []

    @contextlib.contextmanager
    def record(where: str) -> Iterator[None]:
        if not any(isinstance(mode, FakeTensorMode) for mode in _get_current_dispatch_mode_stack()):
            seen.append(phase_of(where))
        yield

    with longstraw.around_steps(record):
        yield seen


KEPT, REVERSE = "differentiating the kept prompt", "in the reverse pass"
KEPT_BRANCH, REPLAY = "differentiating the kept branch", "replaying branch"


def run_batch(family: str, sizes: list[int], chunk: int, **options) -> list[str]:
    fam = FAMILIES[family]
    model = fam.build()
    batch = make_batch(sizes, P=13, R=3, vocab=model.config.vocab_size)
    backend = longstraw.Backend(prefix_chunk_size=chunk, verify_state=True, **options)
    with fam.bind(), deterministic_algorithms(True), phases() as seen:
        assert_parity(batch_loss, backend, detached_batch_reference, model, *batch, tol=TOL, what=f"{family} loss")
    return seen


# CI: three groups of 2, 3 and 2 (every group's prompt and each of its branches kept); `-m slow` one group of 4
@pytest.mark.parametrize("sizes", [pytest.param([4], marks=pytest.mark.slow), [2, 3, 2]])
def test_kept_graph_matches_eager_without_the_reverse_forward(sizes):
    """Every group's prompt, in chunks of 4 of its 12 positions, and every
    branch are differentiated from the forward's graphs: no reverse-pass
    step and no replay runs."""
    seen = run_batch("qwen3", sizes, 4, recompute_layers=False, keep_graphs=True)
    assert seen.count(KEPT) == 3 * len(sizes) and REVERSE not in seen
    assert seen.count(KEPT_BRANCH) == sum(sizes) and REPLAY not in seen


def test_kept_graph_gives_the_reverse_pass_gradients():
    """The same gradients as the reverse pass, to rounding (float64)."""
    fam = FAMILIES["qwen3"]
    model = fam.build()
    batch = make_batch([3, 2], P=13, R=3, vocab=model.config.vocab_size)
    grads = []
    for keep in (True, False):
        backend = longstraw.Backend(prefix_chunk_size=4, recompute_layers=False, keep_graphs=keep)
        with deterministic_algorithms(True):
            grads.append(compiled_loss_and_grads(compile_loss(batch_loss, backend), model, *batch))
    assert torch.allclose(grads[0][0], grads[1][0], rtol=1e-12, atol=0)
    assert_grads_close(grads[0][1], grads[1][1], 1e-12)


def test_kept_graph_with_left_padding_and_ragged_completions():
    """TRL's layout: the chunk that ends the left padding and the chunks
    after it are kept and differentiated; gradients are eager's."""
    with phases() as seen:
        check_padding_parity("qwen3", "exact", padded_group(2, 41, 5, 13, [5, 3]), 8, deterministic=True)
    assert REVERSE in seen  # keep_graphs=None: nothing is planned on the CPU, nothing kept
    seen.clear()
    with phases() as seen:
        model = FAMILIES["qwen3"].build()
        group = padded_group(2, 41, 5, 13, [5, 3])
        from helpers.padding import detached_reference, trl_grpo_loss

        backend = longstraw.Backend(prefix_chunk_size=8, keep_graphs=True, verify_state=True)
        with deterministic_algorithms(True):
            assert_parity(trl_grpo_loss, backend, detached_reference, model, *group, tol=TOL)
    assert seen.count(KEPT) == 5 and REVERSE not in seen
    assert seen.count(KEPT_BRANCH) == 2 and REPLAY not in seen


@pytest.mark.parametrize("why", ["layer-wise recomputation", "detached"])
def test_where_the_graph_is_not_kept_the_reverse_pass_runs(why):
    """Layer-wise recomputation keeps no graph, asked or not; detached mode
    keeps the branches' only. The gradients are still eager's (or the
    detached reference's)."""
    options = {
        "layer-wise recomputation": {"recompute_layers": True},
        "detached": {"recompute_layers": False, "prompt_grad": "detached"},
    }[why]
    seen = run_batch("qwen3", [2, 2], 4, keep_graphs=True, **options)
    assert KEPT not in seen
    assert (REVERSE in seen) == (why != "detached")
    assert (seen.count(KEPT_BRANCH), seen.count(REPLAY)) == ((4, 0) if why == "detached" else (0, 4))


# carried state: Gated DeltaNet and a short convolution, Mamba-2's scan, LFM2's convolution; a sliding window
CARRIED = ["qwen3_5", pytest.param("mamba2", marks=pytest.mark.slow), "lfm2", "mistral",
           pytest.param("gemma3", marks=pytest.mark.slow), "gpt_oss"]


@pytest.mark.parametrize("family", CARRIED)
def test_carried_state_keeps_graphs(family):
    """A carried operator's kept prompt chunk reads the boundary's carry the
    capture kept, and a kept branch the prompt's carry, as the reverse pass
    and the replays do: eager's gradients with every graph kept. A sliding
    window (Mistral; Gemma 3's sliding layers beside full ones; gpt-oss's
    with sinks) carries its last W-1 keys and values, which a branch's
    backward reads at the prompt's end as the replay would."""
    seen = run_batch(family, [2, 2], 4, keep_graphs=True, recompute_layers=False)
    assert seen.count(KEPT) == 6 and REVERSE not in seen
    assert (seen.count(KEPT_BRANCH), seen.count(REPLAY)) == (4, 0)


@pytest.mark.parametrize("family", ["deepseek_v3", pytest.param("glm_moe_dsa", marks=pytest.mark.slow)])
def test_latent_attention_keeps_branch_graphs(family):
    """MLA, and DSA's selection over it: a kept branch's backward reads the prompt's
    latents and rope keys from the state and its own from what it saved
    (`latent_attention._keys`), as a replay does: eager's gradients with
    every graph kept."""
    seen = run_batch(family, [2, 2], 4, keep_graphs=True, recompute_layers=False)
    assert seen.count(KEPT) == 6 and REVERSE not in seen
    assert (seen.count(KEPT_BRANCH), seen.count(REPLAY)) == (4, 0)


@pytest.mark.parametrize("family", ["qwen3_5", "lfm2", "mistral"])
def test_carried_state_detached_kept_branches_give_the_replays_gradients(family):
    """Detached mode on a hybrid: kept branches against replayed ones, to rounding (float64)."""
    fam = FAMILIES[family]
    model = fam.build()
    batch = make_batch([3, 2], P=13, R=3, vocab=model.config.vocab_size)
    grads = []
    for keep in (True, False):
        backend = longstraw.Backend(prompt_grad="detached", prefix_chunk_size=4, recompute_layers=False,
                                    keep_graphs=keep)
        with fam.bind(), deterministic_algorithms(True):
            grads.append(compiled_loss_and_grads(compile_loss(batch_loss, backend), model, *batch))
    assert torch.allclose(grads[0][0], grads[1][0], rtol=1e-12, atol=0)
    assert_grads_close(grads[0][1], grads[1][1], 1e-12)


def test_planned_room_decides(monkeypatch):
    """`keep_graphs=None` with a budget: kept where the room beside the
    planned peak holds the graphs (each prompt chunk and each branch
    counted at the planned activations), and the first group's state with
    them; with room for three only, at most three are kept and the rest
    replay. Gradients are eager's either way."""
    sized = pipeline.size_plan
    seen_rooms = []

    def room_for_the_last_group(program, *args):
        options, room = sized(program, *args)
        seen_rooms.append(room)
        return options, KeptRoom(0, 3 * room.graph_chunk, room.graph_chunk)

    seen = run_batch("qwen3", [2, 2], 4, memory_budget_gb=100.0, branch_rows=1)  # recomputation planned: none
    assert seen.count(KEPT) == 6 and REVERSE not in seen and seen.count(KEPT_BRANCH) == 4 and REPLAY not in seen
    torch._dynamo.reset()
    monkeypatch.setattr(pipeline, "size_plan", room_for_the_last_group)
    seen = run_batch("qwen3", [2, 2], 4, memory_budget_gb=100.0, branch_rows=1)  # recomputation planned: none
    assert seen_rooms and seen_rooms[0].graph_chunk > 0 and seen_rooms[0].graphs > 3 * seen_rooms[0].graph_chunk
    kept = seen.count(KEPT) + seen.count(KEPT_BRANCH)
    assert 1 <= kept <= 3 and seen.count(KEPT) + seen.count(REVERSE) == 6 and seen.count(KEPT_BRANCH) + seen.count(REPLAY) == 4


def test_kept_graphs_are_counted_at_their_measured_bytes(monkeypatch):
    """Where the device tells what a step leaves allocated (CUDA; faked
    here), a kept graph is measured, and later graphs of its kind are
    counted at its bytes per branch row or prompt position instead of the
    planned activations (an upper bound; a prompt not measured yet at a
    branch's bytes per position): with room for three planned graphs, the
    first call keeps the first group's branches but not its prompt; at
    their measured bytes (a tenth of a planned graph) it keeps the second
    group's prompt and branches too, and the second call keeps every
    graph. Eager's gradients both times."""
    from helpers.kept_room import room_for_graphs

    planned = room_for_graphs(monkeypatch, 3)  # each kept step measured at a tenth of a planned graph
    fam = FAMILIES["qwen3"]
    model = fam.build()
    batch = make_batch([2, 2], P=13, R=3, vocab=model.config.vocab_size)
    backend = longstraw.Backend(prefix_chunk_size=4, memory_budget_gb=100.0, branch_rows=1, verify_state=True)
    counts = []
    for _ in range(2):
        with fam.bind(), deterministic_algorithms(True), phases() as seen:
            assert_parity(batch_loss, backend, detached_batch_reference, model, *batch, tol=TOL)
        counts.append((seen.count(KEPT), seen.count(KEPT_BRANCH)))
    runner = backend.plans[-1].runner
    # one row per step of 4 positions (R + 1): (after - before) per position
    assert runner.graph_bytes.measured["branch"] == planned["graph"] // 10 / 4
    assert counts == [(3, 4), (6, 4)], counts


def test_inputs_embeds_with_a_gradient_keep_no_graph():
    """Data that needs a gradient and reaches the steps through the outer
    graph (embeddings computed in the loss from a trainable table passed
    in): the forward ran the outer graph without autograd, so no graph is
    kept; the backward runs it again and the gradients are eager's."""
    fam = FAMILIES["qwen3"]
    model = fam.build()
    ids, advantages, mask = make_batch([3], P=13, R=3, vocab=model.config.vocab_size)
    table = model.get_input_embeddings().weight.detach().clone().requires_grad_(True)

    def embeds_loss(model, table, ids, advantages, mask):
        R = mask.shape[1]
        out = model(inputs_embeds=torch.nn.functional.embedding(ids, table) * 1.5)
        from helpers.losses import grpo_tail, logits_of

        return grpo_tail(logits_of(out)[:, -R - 1 : -1], ids[:, -R:], advantages, mask)

    backend = longstraw.Backend(prefix_chunk_size=4, recompute_layers=False, keep_graphs=True)
    with deterministic_algorithms(True), phases() as seen:
        assert_parity(embeds_loss, backend, None, model, table, ids, advantages, mask, tol=TOL)
    assert KEPT not in seen and KEPT_BRANCH not in seen and REVERSE in seen


def test_the_option_is_validated():
    with pytest.raises(longstraw.LongStrawError, match="keep_graphs must be a bool or None"):
        longstraw.Backend(keep_graphs="yes")


@pytest.mark.parametrize("keep,mode,says", [
    (True, "exact", "the prompt's and the branches' graphs kept for the backward (keep_graphs=True)"),
    (True, "detached", "the branches' graphs kept for the backward (keep_graphs=True)"),
    (None, "exact", "the backward replays the branches and runs the reverse pass"),
])
def test_the_plan_says_what_it_keeps(keep, mode, says):
    model = FAMILIES["qwen3"].build()
    batch = make_batch([3], P=13, R=3, vocab=model.config.vocab_size)
    backend = longstraw.Backend(prefix_chunk_size=4, recompute_layers=False, keep_graphs=keep, prompt_grad=mode)
    compiled_loss_and_grads(compile_loss(batch_loss, backend), model, *batch)
    assert f"schedule: recompute_layers=False, {says}" in backend.plans[-1].summary()


def _padded_trl_case(device: str):
    from helpers.padding import detached_reference, trl_grpo_loss

    group = tuple(t.to(device) for t in padded_group(3, 41, 6, 13, [6, 3, 1]))
    return trl_grpo_loss, detached_reference, group


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["exact", "detached"])
def test_cuda_kept_graphs_match_eager(mode):
    """Float64 on CUDA, TRL's padded layout: every graph kept, eager's gradients."""
    loss_fn, detached, group = _padded_trl_case("cuda")
    backend = longstraw.Backend(prompt_grad=mode, prefix_chunk_size=8, keep_graphs=True, verify_state=True)
    with deterministic_algorithms(False), phases() as seen:
        assert_parity(loss_fn, backend, detached, FAMILIES["qwen3"].build().cuda(), *group, tol=TOL)
    assert REPLAY not in seen and REVERSE not in seen


@pytest.mark.gpu
@pytest.mark.parametrize("keep", [True, False])
def test_cuda_bf16_fused_kernels_with_padding_are_as_accurate_as_eager(keep):
    """bf16 on CUDA, TRL's padded layout in chunks of 8 (one of padding only,
    one ending it): the fused attention kernels everywhere, graphs kept or
    replayed; against float64, the worst parameter's gradient is no further
    off than eager bf16's (within a factor 2)."""
    import copy

    from helpers.compare import rel_err
    from helpers.reference import eager_loss_and_grads

    loss_fn, _, group = _padded_trl_case("cuda")
    truth_model = FAMILIES["qwen3"].build().cuda()
    model = copy.deepcopy(truth_model).to(torch.bfloat16)
    _, truth = eager_loss_and_grads(loss_fn, truth_model, *group)
    _, eager = eager_loss_and_grads(loss_fn, model, *group)
    backend = longstraw.Backend(prefix_chunk_size=8, recompute_layers=False, keep_graphs=keep)
    _, got = compiled_loss_and_grads(compile_loss(loss_fn, backend), model, *group)
    worst = lambda grads: max(rel_err(grads[n].double(), truth[n]) for n in truth if truth[n] is not None)  # noqa: E731
    assert worst(got) <= 2 * worst(eager), (worst(got), worst(eager))


def test_the_room_is_checked_at_every_call(monkeypatch):
    """The planned room is capped at each call by what the device can still
    allocate beside what is allocated, the step's own needs and the
    gradients not allocated yet: a trainer's optimizer states, allocated
    after the first step, come out of the room, not out of the step's."""
    from longstraw.runtime import device_memory
    from longstraw.runtime import runner as runtime

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(device_memory, "available_budget", lambda device: 100)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 30)
    assert device_memory.room_now(cuda, 50, 20, 10) == 40
    assert device_memory.room_now(cuda, 30, 20, 10) == 30
    assert device_memory.room_now(cuda, 50, 80, 0) == 0
    assert device_memory.room_now(cpu, 50, 80, 0) == 50

    missing = []

    def recording(device, planned, step_bytes, missing_grads):
        missing.append(missing_grads)
        return planned

    monkeypatch.setattr(runtime, "room_now", recording)
    model = FAMILIES["qwen3"].build()
    batch = make_batch([3], P=13, R=3, vocab=model.config.vocab_size)
    compiled = compile_loss(batch_loss, longstraw.Backend(prefix_chunk_size=4, recompute_layers=False, keep_graphs=True))
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    model.zero_grad(set_to_none=True)
    compiled(model, *batch).backward()
    compiled(model, *batch).backward()
    assert missing == [trainable, 0]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["exact", "detached"])
def test_cuda_hybrid_kept_graphs_match_the_replays(mode):
    """The Qwen3.5 hybrid on CUDA in float64 (chunk-boundary carries on the
    host, the reference kernels' backward as CUDA graphs): every graph kept
    gives the replays' and the reverse pass's gradients, and eager's in exact mode."""
    fam = FAMILIES["qwen3_5"]
    model = fam.build().cuda()
    batch = tuple(t.cuda() for t in make_batch([3, 2], P=13, R=3, vocab=model.config.vocab_size))
    grads = []
    for keep in (True, False):
        backend = longstraw.Backend(prompt_grad=mode, prefix_chunk_size=4, recompute_layers=False, keep_graphs=keep)
        with fam.bind(), phases() as seen:
            grads.append(compiled_loss_and_grads(compile_loss(batch_loss, backend), model, *batch))
        assert (REPLAY in seen) != keep
    assert_grads_close(grads[0][1], grads[1][1], 1e-12)
    if mode == "exact":
        from helpers.reference import eager_loss_and_grads

        with fam.bind():
            _, want = eager_loss_and_grads(batch_loss, model, *batch)
        assert_grads_close(grads[0][1], want, TOL)


def test_the_plan_says_nothing_is_kept_where_nothing_can_be(monkeypatch):
    """Detached mode on a model whose branches replay (MLA, its pass set to
    the default of a pass of one's own, `branch_graphs_kept = False`):
    `keep_graphs=True` keeps nothing, and the plan says the branches replay."""
    monkeypatch.setattr(LatentAttentionPass, "branch_graphs_kept", False)
    model = FAMILIES["deepseek_v3"].build()
    batch = make_batch([3], P=13, R=3, vocab=model.config.vocab_size)
    backend = longstraw.Backend(prefix_chunk_size=4, recompute_layers=False, keep_graphs=True, prompt_grad="detached")
    with phases() as seen:
        compiled_loss_and_grads(compile_loss(batch_loss, backend), model, *batch)
    assert KEPT_BRANCH not in seen and seen.count(REPLAY) == 3
    assert "schedule: recompute_layers=False, the backward replays the branches\n" in backend.plans[-1].summary() + "\n"


def test_backward_reads_only_what_it_declares():
    """`BackwardPass` runs the forward half's steps again; every attribute
    and method of `GroupRunner` it reads is declared on it (annotated, or an
    abstract method), so the runner cannot drop or rename one unnoticed."""
    tree = ast.parse(pathlib.Path(backward.__file__).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "BackwardPass")
    declared = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    declared |= {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)}
    read = {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id == "self"}
    assert read <= declared, f"BackwardPass reads undeclared {sorted(read - declared)}"
    assert not GroupRunner.__abstractmethods__
