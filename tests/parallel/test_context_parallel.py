"""`sharded_attention` over gloo: 2 and 3 processes, each holding one shard
of the keys and values, against single-process autograd through SDPA over
all the keys concatenated in rank order (float64, relative error 1e-10).

Every rank draws the same full inputs from the case's seed, keeps its own
shard and runs forward and backward with the same output gradient; it saves
the output, dQ and its dK/dV, and the reference runs here. The shards have
unequal lengths, one of them empty; the queries are grouped (GQA) in all but
one case. The explicit-softmax kernel's key blocks are made a few keys long,
so forward and backward walk several blocks per shard.
"""

from __future__ import annotations

import dataclasses
import gc
import os
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

from helpers import gloo
from helpers.compare import assert_close

TOL = 1e-10


@dataclass(frozen=True)
class Case:
    name: str
    shards: tuple[int, ...]  # keys per rank of the group, in rank order
    hq: int
    hkv: int
    n: int = 3  # queries
    scale: float | None = None
    ranks: tuple[int, ...] | None = None  # a subgroup's ranks (None: the whole world)


CASES = {
    2: [
        Case("gqa", (5, 9), hq=4, hkv=2),
        Case("empty", (0, 7), hq=4, hkv=1, scale=0.3),
        Case("mha", (6, 2), hq=2, hkv=2, n=1),
    ],
    3: [
        Case("gqa", (4, 11, 3), hq=6, hkv=2, n=5),
        Case("empty", (8, 0, 5), hq=4, hkv=2, scale=0.7),
        Case("subgroup", (3, 6), hq=4, hkv=2, ranks=(0, 2)),
        Case("no keys", (0, 0, 0), hq=2, hkv=1),
    ],
}


def _inputs(case: Case, seed: int) -> tuple[torch.Tensor, ...]:
    """q [2, Hq, n, 8], all keys and values [2, Hkv, sum(shards), 8], the output gradient."""
    g = torch.Generator().manual_seed(seed)
    m = sum(case.shards)
    q = torch.randn(2, case.hq, case.n, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, case.hkv, m, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, case.hkv, m, 8, generator=g, dtype=torch.float64)
    return q, k, v, torch.randn(q.shape, generator=g, dtype=torch.float64)


def _worker(rank: int, world: int, port: int, out: str) -> None:
    gloo.init(rank, world, port)
    from longstraw.parallel.sharded_attention import sharded_attention
    from longstraw.runtime.kernels import attention

    attention.MATH_BLOCK_SCORES = 64  # blocks of 64 // (Hq * n) keys
    res = {}
    for seed, case in enumerate(CASES[world]):
        group = None if case.ranks is None else dist.new_group(list(case.ranks))  # every rank joins new_group
        if case.ranks is not None and rank not in case.ranks:
            continue
        index = rank if case.ranks is None else case.ranks.index(rank)
        q, k, v, grad_out = _inputs(case, seed)
        start = sum(case.shards[:index])
        q = q.requires_grad_()
        local_k = k.narrow(-2, start, case.shards[index]).clone().requires_grad_()
        local_v = v.narrow(-2, start, case.shards[index]).clone().requires_grad_()
        output = sharded_attention(q, local_k, local_v, group=group, scale=case.scale)
        output.backward(grad_out)
        res[case.name] = (output.detach(), q.grad, local_k.grad, local_v.grad)
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _reference(case: Case, seed: int) -> tuple[torch.Tensor, ...]:
    """SDPA over every key at once: output, dQ, dK, dV."""
    q, k, v, grad_out = (t.requires_grad_() for t in _inputs(case, seed))
    output = F.scaled_dot_product_attention(q, k, v, scale=case.scale, enable_gqa=True)
    output.backward(grad_out.detach())
    return output.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("world", sorted(CASES))
def test_sharded_attention(world, tmp_path):
    results = gloo.spawn(_worker, world, tmp_path)
    for seed, case in enumerate(CASES[world]):
        ranks = case.ranks or tuple(range(world))
        got = [results[r][case.name] for r in ranks]
        if sum(case.shards) == 0:  # a row that sees no key gives 0, and no gradient
            for output, grad_q, grad_k, grad_v in got:
                assert not output.any() and not grad_q.any() and grad_k.numel() == grad_v.numel() == 0
            continue
        output, grad_q, grad_k, grad_v = _reference(case, seed)
        for index, (rank_output, rank_grad_q, rank_grad_k, rank_grad_v) in enumerate(got):
            what = f"{case.name}, rank {ranks[index]}"
            assert_close(rank_output, output, TOL, f"{what}: output")
            assert_close(rank_grad_q, grad_q, TOL, f"{what}: dQ")
            start, m = sum(case.shards[:index]), case.shards[index]
            assert_close(rank_grad_k, grad_k.narrow(-2, start, m), TOL, f"{what}: dK")
            assert_close(rank_grad_v, grad_v.narrow(-2, start, m), TOL, f"{what}: dV")


# --- the runtime: Options.context_parallel ---------------------------------------------------------


@dataclass(frozen=True)
class StepCase:
    model: str  # "dense" (Qwen3), "lora" (Qwen3 under peft's LoRA), "hybrid" (Qwen3.5: Gated DeltaNet,
    # attention), "latent" (DeepSeek-V3: MLA, MoE), "sparse" (GLM-5: MLA, DSA with index_topk 8 < P, MoE),
    # "window" (Mistral: a sliding window of 6, a carry)
    mode: str
    G: int = 3
    P: int = 37  # chunks of 8: the shares hold several chunks, the last one short
    R: int = 5
    layerwise: bool = False  # recompute_layers and verify_state
    prompts: tuple[int, ...] = ()  # a trainer's batch of several prompts, this many completions each
    left: int = 0  # TRL's padding: the prompt left-padded by this much, completions right-padded
    host: bool = False  # attention_outputs_on_host
    reference: bool = False  # a KL term to a frozen reference model: two stages, the reference's captured first
    coupled: bool = False  # a tail that mixes the rows' log-probs non-linearly: each branch's output, in its row

    @property
    def name(self) -> str:
        return "-".join([self.model, self.mode, *([f"G{self.G}"] if self.G != 3 else []),
                         *([f"P{self.P}"] if self.P != 37 else []),
                         *(["layerwise"] if self.layerwise else []),
                         *([f"prompts{len(self.prompts)}"] if self.prompts else []),
                         *([f"padded{self.left}"] if self.left else []), *(["host"] if self.host else []),
                         *(["reference"] if self.reference else []), *(["coupled"] if self.coupled else [])])

    def loss_and_inputs(self):
        from helpers.batches import batch_loss, make_batch
        from helpers.losses import coupled_loss, grpo_loss_f64
        from helpers.padding import padded_group, trl_grpo_loss
        from helpers.tiny_models import make_group

        if self.prompts:
            return batch_loss, make_batch(list(self.prompts), self.P, self.R, vocab=64)
        if self.reference:
            from helpers.losses import kl_to_reference_loss
            from helpers.tiny_models import make_qwen3

            return kl_to_reference_loss(make_qwen3(seed=1).requires_grad_(False)), make_group(self.G, self.P, self.R, pad=True)
        if self.left:  # completions of R, R - 2 and 1 tokens
            return trl_grpo_loss, padded_group(self.G, self.P, self.R, self.left, lengths=[self.R, self.R - 2, 1])
        return coupled_loss if self.coupled else grpo_loss_f64, make_group(self.G, self.P, self.R)


STEP_CASES = {
    # MLA's latent state is sharded by the same gathers as DSA's, whose case runs here (the latent one under -m slow)
    2: [StepCase("dense", "detached"), StepCase("hybrid", "exact", prompts=(2, 3)),
        # TRL's padding, and chunks of 8, 8, 8 and 5: the second round's are of unequal lengths (padded in its gathers)
        StepCase("dense", "exact", P=30, left=11),
        StepCase("sparse", "exact"),
        # the full-depth configuration: layer-wise recomputation and attention outputs on the host, in rounds
        StepCase("hybrid", "exact", layerwise=True, host=True)],
    # four rows over three ranks: two shadows in the second round of branches; each branch's outputs,
    # gathered, in its own row: a tail that tells the rows apart
    3: [StepCase("hybrid", "exact", G=4, coupled=True)],
}
"""The cases CI runs, per world size; `SLOW_STEP_CASES` adds the rest under `-m slow`."""
SLOW_STEP_CASES = {
    2: [StepCase("hybrid", "detached", left=19), StepCase("latent", "detached"), StepCase("sparse", "detached"),
        StepCase("dense", "detached", reference=True), StepCase("hybrid", "detached", P=30),
        StepCase("hybrid", "detached", coupled=True), StepCase("hybrid", "detached"),
        # layer-wise recomputation and attention outputs on the host one at a time, then together on the
        # dense model (CI runs them together on the hybrid); the plain dense and hybrid steps, which CI's
        # cases of each model with one thing more (left padding, two prompts, a reference run) cover
        StepCase("dense", "exact", layerwise=True), StepCase("dense", "exact", host=True),
        StepCase("dense", "exact", layerwise=True, host=True), StepCase("dense", "exact"), StepCase("hybrid", "exact"),
        # sliding windows, a reference policy and LoRA adapters: one-process parity covers each, and
        # CP's sharded attention and gathers are the same code as for the cases CI runs
        StepCase("window", "exact"), StepCase("dense", "exact", reference=True), StepCase("lora", "exact"),
        StepCase("latent", "exact"), StepCase("dense", "exact", coupled=True), StepCase("dense", "exact", left=11),
        StepCase("dense", "exact", P=30)],
    3: [StepCase("sparse", "exact", G=4, coupled=True), StepCase("hybrid", "detached", P=29), StepCase("dense", "detached"), StepCase("dense", "exact", left=11), StepCase("latent", "exact"),
        StepCase("sparse", "exact"), StepCase("dense", "exact"), StepCase("hybrid", "exact", P=29)],
}


def _step_cases(world: int, out: str) -> list[StepCase]:
    """The cases of `world` ranks the test asked for (`cases` in its directory: "ci" or "slow")."""
    with open(os.path.join(out, "cases")) as f:
        which = f.read()
    return (STEP_CASES if which == "ci" else SLOW_STEP_CASES)[world]
STEP_TOL = 1e-10  # against the same step in one process: only the merge's rounding differs


def _model(kind: str) -> torch.nn.Module:
    from helpers.tiny_models import make_deepseek_v3, make_glm5, make_lora_qwen3, make_mistral, make_qwen3, make_qwen3_5

    models = {"dense": make_qwen3, "lora": make_lora_qwen3, "hybrid": make_qwen3_5, "latent": lambda: make_deepseek_v3(experts=True),
              "sparse": make_glm5, "window": lambda: make_mistral(window=6)}
    return models[kind]()


def _backend(case: StepCase, group=None):
    import longstraw

    return longstraw.Backend(prompt_grad=case.mode, prefix_chunk_size=8, recompute_layers=case.layerwise,
                             verify_state=case.layerwise, attention_outputs_on_host=case.host, context_parallel=group)


def _step_worker(rank: int, world: int, port: int, out: str) -> None:
    gloo.init(rank, world, port)
    # uninitialised memory is NaN: a buffer index or a received chunk that was never written cannot hide
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    import longstraw
    from longstraw.runtime import host_offload, prompt_state

    from helpers.harness import compile_loss, compiled_loss_and_grads
    from helpers.losses import grpo_loss_f64
    from helpers.tiny_models import make_group

    lengths: list[set[int]] = []  # per PromptState made: the token lengths of its sequence buffers
    held: list[int] = []  # per PromptState made: bytes of its buffers, then of its d(state)
    init, allocate_grads = prompt_state.PromptState.__init__, prompt_state.PromptState.allocate_grads

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        lengths.append({b.shape[self.slots[i].token_dim] for i, b in self.buffers.items()})
        held.append(sum(b.numel() * b.element_size() for b in self.buffers.values()))

    def recording_grads(self):
        allocate_grads(self)
        held.append(sum(g.numel() * g.element_size() for g in self.grads.values()))

    from longstraw.parallel import sharded_attention

    merges = []  # the sharded attention's merges across the ranks (attention_outputs_on_host skips the reverse pass's)
    merge_partials = sharded_attention.merge_partials
    to_host = host_offload.HostCopier.to_host
    kept = []  # attention_outputs_on_host: the entries this rank copied to its host

    def counting(*args, **kwargs):
        merges.append(1)
        return merge_partials(*args, **kwargs)

    def keeping(self, tensors):
        kept.append(1)
        return to_host(self, tensors)

    from longstraw.runtime import backward as runtime_backward
    from longstraw.runtime import branch_turns
    from longstraw.runtime import runner as runtime

    rounds = []  # per capture and reverse pass: (rounds, chunks every rank ran after them)
    plan_rounds = runtime.GroupRunner._rounds

    def counting_rounds(self, schedule, chunks):
        found, rest = plan_rounds(self, schedule, chunks)
        rounds.append((len(found), len(rest)))
        return found, rest

    runtime.GroupRunner._rounds = counting_rounds
    round_steps = []  # (under autograd, offset) of each step run as this rank's chunk of a round
    step_context = runtime.StepContext

    branch_steps = []  # under autograd or not, of each branch step run as this rank's seat of a round

    def recording_steps(*args, **kwargs):
        ctx = step_context(*args, **kwargs)
        if ctx.prompt_round is not None:
            round_steps.append((ctx.grad_enabled, ctx.offset))
        elif ctx.round is not None:
            branch_steps.append(ctx.grad_enabled)
        return ctx

    # the prompt's steps (forward, backward) and the branches' (`BranchTurn.context`)
    runtime.StepContext = runtime_backward.StepContext = branch_turns.StepContext = recording_steps
    sums = []  # one per `summed_over_ranks` a backward opened (`RankParts`)
    summed_over_ranks = runtime_backward.summed_over_ranks

    def counting_sums(*args, **kwargs):
        sums.append(1)
        return summed_over_ranks(*args, **kwargs)

    runtime_backward.summed_over_ranks = counting_sums
    prompt_state.PromptState.__init__ = recording
    prompt_state.PromptState.allocate_grads = recording_grads
    sharded_attention.merge_partials = counting
    host_offload.HostCopier.to_host = keeping
    res = {}
    cases = _step_cases(world, out)
    for case in cases:
        torch._dynamo.reset()  # each case compiles the loss anew: past Dynamo's recompile limit it would run eagerly
        lengths.clear()
        held.clear()
        merges.clear()
        kept.clear()
        rounds.clear()
        round_steps.clear()
        branch_steps.clear()
        sums.clear()
        model = _model(case.model)
        backend = _backend(case, dist.group.WORLD)
        loss_fn, inputs = case.loss_and_inputs()
        loss, grads = compiled_loss_and_grads(compile_loss(loss_fn, backend), model, *inputs)
        res[case.name] = (loss.detach(), grads, set().union(*lengths))
        res[case.name + " merges"] = len(merges)
        res[case.name + " kept"] = len(kept)
        res[case.name + " rounds"] = set(rounds)
        res[case.name + " round steps"] = tuple({offset for grad, offset in round_steps if grad == reverse}
                                                for reverse in (False, True))
        res[case.name + " branch steps"] = (branch_steps.count(False), branch_steps.count(True))
        res[case.name + " sums"] = len(sums)
        if case in PLANNED:  # what the planner predicts for one rank, against what this rank held
            held_bytes = sum(held)
            plan = longstraw.explain(loss_fn, model, *inputs, options=backend.options).plan(P=case.P)
            res[case.name + " state"] = (plan.ranks, plan.state + plan.state_grad, held_bytes)
    # with the CI cases, two ranks also plan for a budget (the planner simulates one process's steps, no
    # collectives) and run under FSDP2
    extras = world == 2 and PLANNED_CASE in cases
    if extras:
        torch._dynamo.reset()
        case = PLANNED_CASE
        backend = longstraw.Backend(prompt_grad=case.mode, memory_budget_gb=1.0, context_parallel=dist.group.WORLD)
        res["planned"] = compiled_loss_and_grads(compile_loss(grpo_loss_f64, backend), _model(case.model),
                                                 *make_group(case.G, case.P, case.R))
        # budgets that differ between the ranks: alone, rank 0 would take the whole prompt as one chunk and
        # rank 1 chunks of 128 (nothing fits its budget); together both plan for rank 1's
        torch._dynamo.reset()
        backend = longstraw.Backend(memory_budget_gb=[1.0, 1e-9][rank], context_parallel=dist.group.WORLD)
        res["planned apart"] = compiled_loss_and_grads(compile_loss(grpo_loss_f64, backend), _model("dense"),
                                                       *make_group(*APART))
        res["planned apart options"] = (backend.plans[-1].options.prefix_chunk_size, backend.plans[-1].options.recompute_layers)
    if extras:
        res["fsdp2"] = _fsdp2_step(FSDP2_CASE)
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


FSDP2_CASE = PLANNED_CASE = StepCase("dense", "exact")
ROUND_MODELS = {"dense", "lora", "hybrid", "window", "latent", "sparse"}  # every pass: run in rounds
APART = (2, 300, 4)  # G, P, R of the step planned for budgets that differ between the ranks
PLANNED = {StepCase("dense", "exact"), StepCase("dense", "detached")}  # the planner's state against the buffers


def _fsdp2_step(case: StepCase) -> tuple[set[str], torch.Tensor, dict]:
    """FSDP2 over the same ranks, as `tests/parallel/test_data_parallel.py`'s recipe:
    `fully_shard` on the loss module, compiled. Every rank's gradient is
    the whole one, so FSDP2's average over the ranks is that gradient."""
    from torch.distributed.fsdp import fully_shard

    import longstraw

    from helpers.losses import grpo_loss_f64
    from helpers.tiny_models import make_group

    torch._dynamo.reset()
    module = longstraw.LossModule(_model(case.model), grpo_loss_f64)
    fully_shard(module)
    loss = torch.compile(module, backend=_backend(case, dist.group.WORLD))(*make_group(case.G, case.P, case.R))
    loss.backward()
    grads = {name.removeprefix("model."): p.grad.full_tensor() for name, p in module.named_parameters()}
    return {type(p).__name__ for p in module.parameters()}, loss.detach(), grads


@pytest.mark.parametrize("world, which", [
    *((world, "ci") for world in sorted(STEP_CASES)),
    *(pytest.param(world, "slow", marks=pytest.mark.slow) for world in sorted(SLOW_STEP_CASES)),
])
def test_step_matches_one_process(world, which, tmp_path):
    """Loss and every gradient of a GRPO step whose prompt state is sharded
    over `world` gloo processes equal the same step in one process (both
    modes; that step's parity with eager is test_families' and
    test_qwen3_5's), and the dense model's exact ones eager's; every rank
    gets the whole gradient, and holds only its share of the prompt state.
    Also with layer-wise recomputation and `verify_state` (each prompt
    position written once, on its owner), over a trainer's batch of two
    prompts (two groups, each sharded; the first captured again in
    backward), and over TRL's padding (a left-padded prompt whose padding
    ends inside a chunk or a share, completions right-padded, one to a
    single token). With `attention_outputs_on_host` (2 ranks), the reverse
    pass reads the capture's merged outputs: fewer merges across the
    ranks than the same step without, each chunk's entries on its rank's
    host only (with `verify_state` it attends and compares).
    Every rank runs under `torch.use_deterministic_algorithms(True)` with
    uninitialised memory filled with NaN.
    With 2 ranks also under FSDP2 (`fully_shard` on the loss module) over
    the same ranks (its average of the ranks' equal gradients is the
    gradient) and planned for a memory budget, also for budgets that differ
    between the ranks (each alone would choose another chunk size: every
    rank plans for the smallest). The planner's per-rank state and d(state)
    are the bytes the rank with the largest share held."""
    from longstraw.runtime.schedule import ChunkSchedule

    from helpers.compare import assert_grads_close
    from helpers.harness import compile_loss, compiled_loss_and_grads
    from helpers.losses import grpo_loss_f64
    from helpers.reference import eager_loss_and_grads
    from helpers.tiny_models import make_group

    (tmp_path / "cases").write_text(which)
    results = gloo.spawn(_step_worker, world, tmp_path)
    cases = _step_cases(world, str(tmp_path))
    for case in cases:
        torch._dynamo.reset()
        model, (loss_fn, inputs) = _model(case.model), case.loss_and_inputs()
        want_loss, want = compiled_loss_and_grads(compile_loss(loss_fn, _backend(case)), model, *inputs)
        captured = case.P - 1  # the last prompt position's logit is read by the loss: it runs in every branch
        share = ChunkSchedule(captured, 8, world).held
        assert all(share)  # no empty share
        for rank in range(world):
            loss, grads, lengths = results[rank][case.name]
            assert lengths <= {share[rank]}, f"{case.name}, rank {rank}: buffers of {lengths} positions"
            assert_close(loss, want_loss, STEP_TOL, f"{case.name}, rank {rank}: loss")
            assert_grads_close(grads, want, STEP_TOL)
        # capture rounds (each rank computes one chunk of W at once) where every pass runs them, padded or not;
        # the chunks after the last whole round run on every rank
        chunks = ChunkSchedule(captured, 8).count
        whole = (chunks // world, chunks % world)
        expected = whole if case.model in ROUND_MODELS else (0, chunks)
        for rank in range(world):
            assert results[rank][case.name + " rounds"] == {expected}, (case.name, results[rank][case.name + " rounds"])
            # exact mode's reverse pass runs the same rounds: each rank recomputes and differentiates its own chunks
            captured, reversed_ = results[rank][case.name + " round steps"]
            assert len(captured) == expected[0], (case.name, captured)
            assert reversed_ == (captured if case.mode == "exact" else set()), (case.name, rank, captured, reversed_)
            # the branches are dealt in rounds of `world` rows, one per rank (a shadow where a last round is short),
            # in the forward (every stage's) and the replay
            rounds_of_rows = sum(-(-rows // world) for rows in case.prompts or (case.G,))
            stages = 2 if case.reference else 1
            assert results[rank][case.name + " branch steps"] == (stages * rounds_of_rows, rounds_of_rows), case.name
            # each group's divided steps summed once: the branches and the prompt's rounds together, unless
            # chunks every rank replays come between them (exact mode, chunks after the last whole round)
            per_group = 2 if case.mode == "exact" and expected[1] else 1
            assert results[rank][case.name + " sums"] == per_group * len(case.prompts or (case.G,)), case.name
        if case.host and not case.layerwise:  # the reverse pass read the capture's outputs: fewer merges
            without = dataclasses.replace(case, host=False)  # (with verify_state, as layerwise, it attends to compare)
            for rank in range(world):
                assert results[rank][case.name + " merges"] < results[rank][without.name + " merges"]
            # each chunk's entries are kept by its rank only: rank 0 holds 3 of the 5 chunks, rank 1 the other 2
            per_chunk = results[0][case.name + " kept"] / 3
            assert per_chunk >= 1 and results[1][case.name + " kept"] == 2 * per_chunk
        if case == FSDP2_CASE and world == 2:
            for rank in range(world):  # FSDP2 shards the parameters; the gathered gradient is the same
                kinds, loss, grads = results[rank]["fsdp2"]
                assert kinds == {"DTensor"}
                assert_close(loss, want_loss, STEP_TOL, f"fsdp2, rank {rank}: loss")
                assert_grads_close(grads, want, STEP_TOL)
        if case == PLANNED_CASE and world == 2:
            for rank in range(world):
                loss, grads = results[rank]["planned"]
                assert_close(loss, want_loss, STEP_TOL, f"planned, rank {rank}: loss")
                assert_grads_close(grads, want, STEP_TOL)
            apart = [results[rank]["planned apart options"] for rank in range(world)]
            assert apart == [(128, False)] * world, apart
            eager_loss, eager = eager_loss_and_grads(grpo_loss_f64, _model("dense"), *make_group(*APART))
            for rank in range(world):
                loss, grads = results[rank]["planned apart"]
                assert_close(loss, eager_loss, 1e-6, f"planned apart, rank {rank}: loss against eager")
                assert_grads_close(grads, eager, 1e-6)
        if case in PLANNED:  # the planner's per-rank state is what the rank with the largest share held
            predicted = {results[rank][case.name + " state"][:2] for rank in range(world)}
            assert predicted == {(world, max(results[rank][case.name + " state"][2] for rank in range(world)))}
        if case.mode == "exact" and case.model != "hybrid":  # the hybrid's eager GDN rounds through float32 (test_qwen3_5)
            eager_loss, eager = eager_loss_and_grads(loss_fn, model, *inputs)
            assert_close(results[0][case.name][0], eager_loss, 1e-6, f"{case.name}: loss against eager")
            assert_grads_close(results[0][case.name][1], eager, 1e-6)


# (case, over the two ranks or in one process): the carries' rounds in both modes, and one process's chunks
CYCLE_CASES = [(StepCase("hybrid", "exact", layerwise=True, host=True), True), (StepCase("hybrid", "detached", layerwise=True), True),
               (StepCase("hybrid", "exact", layerwise=True), False)]


def _left_in_cycles(run) -> tuple[int, list[str]]:
    """Bytes of the tensors, and the names of longstraw's autograd nodes,
    that `run()` (Python's cyclic collector off) left in reference cycles."""
    from longstraw.planning.simulation import without_cyclic_gc

    gc.collect()  # what earlier tests left in cycles is not this step's
    with without_cyclic_gc():
        run()
        gc.set_debug(gc.DEBUG_SAVEALL)  # before the collector is back on: nothing of the step is freed unseen
        try:
            gc.collect()
            garbage = list(gc.garbage)
        finally:
            gc.garbage.clear()
            gc.set_debug(0)
    tensors = [o for o in garbage if isinstance(o, torch.Tensor) and not isinstance(o, FakeTensor)]
    nodes = sorted({type(o).__name__ for o in garbage
                    if getattr(getattr(type(o), "_forward_cls", None), "__module__", "").startswith("longstraw")})
    return sum(t.untyped_storage().nbytes() for t in tensors), nodes


def _cycle_worker(rank: int, world: int, port: int, out: str) -> None:
    gloo.init(rank, world, port)
    from longstraw.passes import gated_delta

    from helpers.harness import compile_loss, compiled_loss_and_grads

    reference_kernel = gated_delta._step_kernel

    def fresh_state(*args, **kwargs):  # fla's final state is a tensor of its own; the reference's a view
        out, state = reference_kernel(*args, **kwargs)
        return out, state.clone()

    gated_delta._step_kernel = fresh_state
    res = {}
    for case, sharded in CYCLE_CASES:
        if not sharded and rank != 0:  # one process's step: the same on either rank, so rank 0 alone runs it
            continue
        torch._dynamo.reset()
        model, (loss_fn, inputs) = _model(case.model), case.loss_and_inputs()
        compiled = compile_loss(loss_fn, _backend(case, dist.group.WORLD if sharded else None))
        compiled_loss_and_grads(compiled, model, *inputs)  # compiled and planned: the second step is the runtime's alone
        res[case.name, sharded] = _left_in_cycles(lambda: compiled_loss_and_grads(compiled, model, *inputs))
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_a_step_leaves_nothing_in_reference_cycles(tmp_path):
    """A step's autograd graph is freed by reference counting as the
    backward goes, never left to Python's cyclic collector, over two gloo
    ranks (the reverse pass in rounds, both modes) and in one process, with
    layer-wise recomputation, on the hybrid: the collector runs when its counters say so, and until
    then a cycle holding an autograd node holds what the node saved and
    the graph behind it. A round's carry kept on the autograd context was
    the Function's output (fla's final state, a tensor of its own: the
    reference kernel's is made one here), so node, context and carry formed
    a cycle, and under recomputation it kept every recomputed layer's graph
    through the chunk's backward (about 1 GB per four layers of Qwen3.5-27B
    at chunks of 4096)."""
    results = gloo.spawn(_cycle_worker, 2, tmp_path)
    for rank, res in enumerate(results):
        for (name, sharded), (nbytes, nodes) in res.items():
            assert (nbytes, nodes) == (0, []), (rank, name, "two ranks" if sharded else "one process", nbytes, nodes)


def _refusal_worker(rank: int, world: int, port: int, out: str) -> None:
    gloo.init(rank, world, port)
    import longstraw
    from longstraw.errors import InputError, LongStrawError
    from longstraw.parallel.agreement import CALLING, PLANNING, agree
    from longstraw.parallel.collectives import raise_together
    from longstraw.parallel.ranks import Ranks

    from helpers.harness import compile_loss, compiled_loss_and_grads
    from helpers.losses import grpo_loss_f64
    from helpers.tiny_models import make_group, make_model

    def error_of(run) -> str:
        try:
            run()
        except Exception as error:  # noqa: BLE001
            return "\n".join([f"{type(error).__name__}: {error}", *getattr(error, "__notes__", [])])
        return "no error"

    def scaled_loss(model, scale, *group):  # a Python float: Dynamo folds it into the graph
        return grpo_loss_f64(model, *group) * scale

    cp = dict(prefix_chunk_size=8, recompute_layers=False, context_parallel=dist.group.WORLD)
    prompt, responses, advantages, mask = make_group(2, 30, 4)
    # a token whose embedding is NaN at prompt position 26, in rank 0's last chunk [24, 29): only rank 0's
    # share of the state is not finite (rank 1 holds [8, 24))
    poisoned, token = make_model("plain"), next(t for t in range(64) if t not in prompt[:26] and t not in responses)
    with torch.no_grad():
        poisoned.embed.weight[token] = float("nan")
    nan_prompt = torch.cat([prompt[:26], torch.tensor([token]), prompt[27:]])
    res = {
        "other inputs": error_of(lambda: compile_loss(grpo_loss_f64, longstraw.Backend(**cp))(
            make_model("plain"), prompt, responses, advantages + rank, mask)),
        "rows swapped": error_of(lambda: compile_loss(grpo_loss_f64, longstraw.Backend(**cp))(  # same sum and norm
            make_model("plain"), prompt, responses.flip(0) if rank == 1 else responses, advantages, mask)),
        "other scalar": error_of(lambda: compile_loss(scaled_loss, longstraw.Backend(**cp))(
            make_model("plain"), 0.5 + rank, prompt, responses, advantages, mask)),
        "window mask": error_of(lambda: compile_loss(grpo_loss_f64, longstraw.Backend(**cp))(
            make_model("plain_window_mask"), prompt, responses, advantages, mask)),
        "other options": error_of(lambda: compile_loss(grpo_loss_f64, longstraw.Backend(**{**cp, "prefix_chunk_size": 8 + 8 * rank}))(
            make_model("plain"), prompt, responses, advantages, mask)),
        "planning while calling": error_of(lambda: agree(
            PLANNING if rank == 0 else CALLING, 0.0, longstraw.Options(), 0.0, dist.group.WORLD, torch.device("cpu"))),
        "other generators": error_of(lambda: (torch.manual_seed(rank), compile_loss(grpo_loss_f64, longstraw.Backend(**cp))(
            dropout_model(), prompt, responses, advantages, mask))),
        "not a group": error_of(lambda: longstraw.Backend(prefix_chunk_size=8, recompute_layers=False,
                                                          context_parallel="world")),
        "nan in one share": error_of(lambda: compile_loss(grpo_loss_f64, longstraw.Backend(**cp))(
            poisoned, nan_prompt, responses, advantages, mask)),
        "no failure": error_of(lambda: raise_together(None, Ranks(dist.group.WORLD), torch.device("cpu"))),
        "rank 1 fails": error_of(lambda: raise_together(
            InputError("rank 1's check") if rank == 1 else None, Ranks(dist.group.WORLD), torch.device("cpu"))),
        "both fail": error_of(lambda: raise_together(
            LongStrawError(f"rank {rank}'s check"), Ranks(dist.group.WORLD), torch.device("cpu"))),
    }
    res["drift"] = _steps_with_rank_1_rounding_apart(rank, cp, prompt, responses, advantages, mask)
    torch._dynamo.reset()  # an explicit causal mask: each capture round's ranks agree it is causal, and attend
    res["explicit mask"] = compiled_loss_and_grads(compile_loss(grpo_loss_f64, longstraw.Backend(**cp)),
                                                   make_model("plain_explicit_mask"), prompt, responses, advantages, mask)
    torch._dynamo.reset()
    torch.manual_seed(DROPOUT_SEED)  # every rank alike: the same masks
    res["dropout"] = compiled_loss_and_grads(compile_loss(grpo_loss_f64, longstraw.Backend(**cp)), dropout_model(),
                                             prompt, responses, advantages, mask)
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _steps_with_rank_1_rounding_apart(rank: int, cp: dict, *group) -> tuple[str, list[torch.Tensor]]:
    """Two optimizer steps where rank 1's gradient is off in the last bits,
    as a GPU's kernels that accumulate with atomics leave it: (the second
    call's error or "no error", each rank's gradients)."""
    import longstraw
    from longstraw.runtime import runner as runtime

    from helpers.harness import compile_loss
    from helpers.losses import grpo_loss_f64
    from helpers.tiny_models import make_model

    backward_group = runtime.GroupRunner._backward_group

    def rounded_apart(self, call, group_call, inputs, values, leaves, *rest):
        backward_group(self, call, group_call, inputs, values, leaves, *rest)
        if rank == 1:
            for leaf in leaves:
                if leaf.grad is not None:
                    leaf.grad.mul_(1 + 1e-12)

    torch._dynamo.reset()
    runtime.GroupRunner._backward_group = rounded_apart
    model = make_model("plain")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = compile_loss(grpo_loss_f64, longstraw.Backend(**cp))
    grads: list[torch.Tensor] = []
    try:
        for _ in range(2):
            optimizer.zero_grad()
            step(model, *group).backward()
            grads = [p.grad.clone() for p in model.parameters()]
            optimizer.step()
        outcome = "no error"
    except longstraw.LongStrawError as error:
        outcome = str(error)
    finally:
        runtime.GroupRunner._backward_group = backward_group
    return outcome, grads


DROPOUT_SEED = 5


def dropout_model() -> torch.nn.Module:
    from helpers.plain_transformer import make_plain

    return make_plain(dropout=0.3).train()


def test_refusals(tmp_path):
    """Every rank refuses, with the cause: other inputs on another rank
    (also the completions' rows in another order: equal sums and norms), a
    Python value that differs between ranks (folded into their graphs),
    other options (a chunk size: other collectives), a rank planning a step
    while another calls one, random number generators in other states when
    the loss draws random numbers (dropout: seeded alike, the step matches
    one process's), and gradients rounded apart on one rank (as a GPU's
    atomics round) are replaced by the first rank's, so the weights stay
    equal and the next step runs, and an explicit causal mask runs in
    capture rounds (the ranks agree it is causal) as in one process, attention under a mask that is not causal over
    one run of keys (a sliding window mask that no pass proved), a
    context_parallel that is not a process group. A check that fails on one rank's share alone
    (`check_finite`: NaN in rank 0's last chunk only) raises on every rank,
    where raising on rank 0 alone would leave rank 1 waiting in the next
    collective until the group's timeout. `raise_together` itself: no
    error when no rank has one, else the lowest failing rank's on every
    rank, noting which rank found it."""
    import longstraw

    from helpers.compare import assert_grads_close
    from helpers.harness import compile_loss, compiled_loss_and_grads
    from helpers.losses import grpo_loss_f64
    from helpers.tiny_models import make_group, make_model

    results = gloo.spawn(_refusal_worker, 2, tmp_path)
    torch._dynamo.reset()
    torch.manual_seed(DROPOUT_SEED)
    backend = longstraw.Backend(prefix_chunk_size=8, recompute_layers=False)
    want_loss, want = compiled_loss_and_grads(compile_loss(grpo_loss_f64, backend), dropout_model(), *make_group(2, 30, 4))
    assert backend.plans[-1].runner.random
    torch._dynamo.reset()
    explicit = compiled_loss_and_grads(compile_loss(grpo_loss_f64, longstraw.Backend(prefix_chunk_size=8, recompute_layers=False)),
                                       make_model("plain_explicit_mask"), *make_group(2, 30, 4))
    for rank, res in enumerate(results):
        assert res["nan in one share"].startswith("InputError: the captured prompt state"), res["nan in one share"]
        assert "holds NaN or Inf" in res["nan in one share"]
        assert ("raised on rank 0 of the context-parallel group" in res["nan in one share"]) == (rank == 1)
        # `raise_together` itself: nothing when no rank fails, else the lowest failing rank's error everywhere
        assert res["no failure"] == "no error"
        assert res["rank 1 fails"].startswith("InputError: rank 1's check")
        assert ("raised on rank 1" in res["rank 1 fails"]) == (rank == 0)
        assert res["both fail"].startswith("LongStrawError: rank 0's check")
    for res in results:
        assert res["other inputs"].startswith("InputError: context parallelism: input `advantages` differs between rank")
        assert res["rows swapped"].startswith("InputError: context parallelism: input `responses` differs between rank")
        assert res["other scalar"].startswith("InputError: context parallelism: "), res["other scalar"]
        assert "differs between rank" in res["other scalar"] and "Python values" in res["other scalar"]
        assert "context parallelism: the attention over" in res["window mask"] and "a window" in res["window mask"]
        assert "must be a torch.distributed ProcessGroup" in res["not a group"]
        outcome, grads = res["drift"]  # the ranks keep the first rank's gradient, bit for bit, and so equal weights
        assert outcome == "no error", outcome
        assert all(torch.equal(g, h) for g, h in zip(grads, results[0]["drift"][1]))
        assert res["other generators"].startswith(
            "InputError: context parallelism: the random number generators' state differs between rank"), res["other generators"]
        assert "seed the group's ranks alike" in res["other generators"]
        assert_close(res["explicit mask"][0], explicit[0], STEP_TOL, "explicit mask: loss")
        assert_grads_close(res["explicit mask"][1], explicit[1], STEP_TOL)
        loss, grads = res["dropout"]  # seeded alike, the ranks draw the one-process step's masks
        assert_close(loss, want_loss, STEP_TOL, "dropout: loss")
        assert_grads_close(grads, want, STEP_TOL)
        assert res["other options"].startswith(
            "InputError: context parallelism: the option `prefix_chunk_size` differs between rank 0 and rank 1"), res["other options"]
        assert res["planning while calling"].startswith(
            "InputError: context parallelism: rank 0 is planning a step while rank 1 is calling a planned step")


FAILURES = ("token in the row rank 0 replays", "exception in rank 1's capture", "exception in rank 1's backward")


def _failure_worker(rank: int, world: int, port: int, out: str) -> None:
    """Each case fails inside one rank's step while that rank stays alive
    (waiting at the store for the others to report), times how long every
    rank takes to raise, then calls once more: the group is out of step,
    so that call raises the posted error too."""
    import time

    gloo.init(rank, world, port)
    import longstraw
    from longstraw.runtime import runner as runtime

    from helpers.harness import compile_loss
    from helpers.losses import grpo_loss_f64
    from helpers.tiny_models import make_group, make_model

    store = dist.distributed_c10d._get_default_store()
    prompt, responses, advantages, mask = make_group(2, 30, 4)
    case = FAILURES[int(os.environ["LONGSTRAW_FAILURE_CASE"])]
    bad_responses = responses.clone()
    bad_responses[0, 1] = 10_000  # every rank's input alike: only the rank whose branch round runs row 0 reads it
    capture, backward_group = runtime.GroupRunner._capture, runtime.GroupRunner._backward_group

    def failing(original, message):
        def step(self, *args, **kwargs):
            if rank == 1:
                raise RuntimeError(message)
            return original(self, *args, **kwargs)
        return step

    step = compile_loss(grpo_loss_f64, longstraw.Backend(prefix_chunk_size=8, recompute_layers=False,
                                                          context_parallel=dist.group.WORLD))
    model = make_model("plain")
    step(model, prompt, responses, advantages, mask).backward()  # planned and run once, all well
    if case == FAILURES[1]:
        runtime.GroupRunner._capture = failing(capture, "rank 1's capture failed")
    if case == FAILURES[2]:
        runtime.GroupRunner._backward_group = failing(backward_group, "rank 1's backward failed")
    res = {}
    start = time.monotonic()
    try:
        step(model, prompt, bad_responses if case == FAILURES[0] else responses, advantages, mask).backward()
        res["error"] = "no error"
    except Exception as error:  # noqa: BLE001
        res["error"] = f"{type(error).__name__}: {error}"
        res["notes"] = getattr(error, "__notes__", [])
    res["seconds"] = time.monotonic() - start
    store.add("reported", 1)
    while int(store.add("reported", 0)) < world:  # the failing rank stays alive until every rank has raised
        time.sleep(0.01)
    runtime.GroupRunner._capture, runtime.GroupRunner._backward_group = capture, backward_group
    try:
        step(model, prompt, responses, advantages, mask)
        res["again"] = "no error"
    except Exception as error:  # noqa: BLE001
        res["again"] = f"{type(error).__name__}: {error}"
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    store.add("saved", 1)
    while rank == 0 and int(store.add("saved", 0)) < world:  # rank 0 holds the store: it leaves last
        time.sleep(0.01)


@pytest.mark.parametrize("case", [  # CI: the backward's failure, which crosses the most collectives
    *(pytest.param(i, marks=pytest.mark.slow) for i in range(len(FAILURES) - 1)), len(FAILURES) - 1,
], ids=FAILURES)
def test_a_failure_inside_one_ranks_step_raises_on_every_rank(case, tmp_path, monkeypatch):
    """A token id past the vocabulary in row 0 (every rank is given it; the
    branch round gives row 0 to rank 0 alone), an exception in rank 1's
    capture, one in rank 1's backward: every rank raises the failing rank's
    error within seconds (not the group's timeout of 120 s), with a note
    naming the rank where the others' steps stopped, and every later call
    on the group raises it again."""
    monkeypatch.setenv("LONGSTRAW_FAILURE_CASE", str(case))
    results = gloo.spawn(_failure_worker, 2, tmp_path)
    want = ["IndexError: index out of range in self", "RuntimeError: rank 1's capture failed",
            "RuntimeError: rank 1's backward failed"][case]
    source = 0 if case == 0 else 1
    for rank, res in enumerate(results):
        assert res["error"] == want, res
        assert res["seconds"] < 10, res
        posted = [n for n in res["notes"] if "inside its step" in n]
        assert bool(posted) == (rank != source), res["notes"]
        assert all(f"raised on rank {source} of the context-parallel group inside its step" in n for n in posted)
        assert res["again"] == want, res


def test_options_are_compared_by_value():
    """What `agree` compares of the options: every option that decides
    collectives or values, by value (two equal passes are one; a pass with
    other settings differs), not the progress bars or the budget, which may
    differ per rank (the smallest is planned for)."""
    from longstraw import Options
    from longstraw.parallel.agreement import _option_fingerprints
    from longstraw.passes import ArchitecturePass

    class Plain(ArchitecturePass):
        pass

    @dataclass
    class Tuned(ArchitecturePass):
        block: int = 64

    def differing(a: Options, b: Options) -> list[str]:
        return [name for (name, x), (_, y) in zip(_option_fingerprints(a), _option_fingerprints(b)) if x != y]

    assert differing(Options(passes=(Plain(), Tuned())), Options(passes=(Plain(), Tuned()))) == []
    assert differing(Options(passes=(Tuned(),)), Options(passes=(Tuned(block=128),))) == ["passes"]
    assert differing(Options(prefix_chunk_size=8, recompute_layers=True), Options(prefix_chunk_size=16)) == [
        "prefix_chunk_size", "recompute_layers"]
    assert differing(Options(kernels={"attention": "math"}), Options()) == ["kernels"]
    assert differing(Options(progress=True, memory_budget_gb=1.0), Options(progress=False, memory_budget_gb=2.0)) == []


def test_a_step_reading_every_earlier_position_is_refused_on_a_shard():
    """A sequence slot's buffer holds the rank's share only; a pass whose
    step reads the whole state (`StepContext.visible`: a pass of one's own)
    is refused, naming the slot."""
    from torch import fx

    from longstraw.analysis.slots import SlotKind, StateSlot
    from longstraw.errors import LongStrawError
    from longstraw.parallel.ranks import SimulatedRanks
    from longstraw.parallel.shards import PromptShard
    from longstraw.runtime.prompt_state import PromptState, StepContext

    node = fx.Graph().placeholder("keys")
    slot = StateSlot(0, SlotKind.SEQUENCE, node, token_dim=2, batch_dim=0, shape=(1, 2, 8, 4), dtype=torch.float64,
                     reason="my_pass:keys")
    state = PromptState([slot], capacity=10, prefix_len=8, device=torch.device("cpu"),
                        shard=PromptShard(SimulatedRanks(1, 2), (((0, 2), (6, 2)), ((2, 2), (4, 2)))))
    assert state.buffers[0].shape == (1, 2, 4, 4)  # positions [2, 6) only
    with pytest.raises(LongStrawError, match="context parallelism: .*my_pass.*needs every earlier position"):
        StepContext(state, 8, 2, grad_enabled=False).visible(0)


def test_a_share_maps_buffer_indices_to_positions_and_back():
    """A rank's buffer holds its chunks back to back: `held_before`,
    `local_range`, `to_global`, `to_local` and `owner` agree with a table
    built position by position, for shares of separated chunks, a short
    last chunk and a rank with no chunk at all."""
    from longstraw.parallel.ranks import SimulatedRanks
    from longstraw.parallel.shards import PromptShard
    from longstraw.runtime.schedule import ChunkSchedule

    for prompt, world in ((16, 2), (29, 3), (7, 2), (3, 2)):
        held = ChunkSchedule(prompt, 4, world).shares
        for rank in range(world):
            shard = PromptShard(SimulatedRanks(rank, world), held)
            mine = [p for o, n in held[rank] for p in range(o, o + n)]  # buffer index -> position
            assert shard.size == len(mine)
            for position in range(prompt + 1):
                assert shard.held_before(position) == sum(p < position for p in mine)
                if position < prompt:
                    assert (position in mine) == (shard.owner(position) == rank)
            for first in range(prompt + 1):
                for last in range(first, prompt + 1):
                    begin, end = shard.local_range(first, last)
                    assert mine[begin:end] == [p for p in mine if first <= p < last]
            local = torch.arange(len(mine))
            assert shard.to_global(local).tolist() == mine
            index, inside = shard.to_local(torch.arange(prompt + 3))
            assert inside.tolist() == [p in mine for p in range(prompt + 3)]
            assert index[inside].tolist() == list(range(len(mine)))


def _mesh_worker(rank: int, world: int, port: int, out: str) -> None:
    """A 2 x 2 mesh: data parallel over "dp" (FSDP2, each replica its own
    group of completions), context parallel over "cp" within a replica."""
    gloo.init(rank, world, port)
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import longstraw

    from helpers.losses import grpo_loss_f64
    from helpers.tiny_models import make_group

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    replica = mesh.get_local_rank("dp")
    case = StepCase("dense", "exact")
    module = longstraw.LossModule(_model(case.model), grpo_loss_f64)
    fully_shard(module, mesh=mesh["dp"])
    backend = longstraw.Backend(prompt_grad=case.mode, prefix_chunk_size=8, recompute_layers=False,
                                context_parallel=mesh["cp"].get_group())
    loss = torch.compile(module, backend=backend)(*make_group(case.G, case.P, case.R, seed=replica))
    loss.backward()
    grads = {name.removeprefix("model."): p.grad.full_tensor() for name, p in module.named_parameters()}
    torch.save((replica, mesh.get_local_rank("cp"), loss.detach(), grads), os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_a_data_parallel_by_context_parallel_mesh(tmp_path):
    """4 gloo processes as a 2 x 2 DeviceMesh: FSDP2 over "dp" (replica r
    runs the group of seed r), the prompt state sharded over "cp" (its
    group from the mesh, a subgroup of the world). Every rank's loss is its
    replica's one-process loss, and every gradient FSDP2 averaged over the
    replicas equals the mean of the two one-process gradients: nothing is
    reduced over "cp", and "dp" averages as in plain data parallelism."""
    from helpers.compare import assert_grads_close
    from helpers.harness import compile_loss, compiled_loss_and_grads
    from helpers.losses import grpo_loss_f64
    from helpers.tiny_models import make_group

    case = StepCase("dense", "exact")
    results = gloo.spawn(_mesh_worker, 4, tmp_path)
    want = []
    for replica in range(2):
        torch._dynamo.reset()
        want.append(compiled_loss_and_grads(compile_loss(grpo_loss_f64, _backend(case)), _model(case.model),
                                            *make_group(case.G, case.P, case.R, seed=replica)))
    mean = {name: (want[0][1][name] + want[1][1][name]) / 2 for name in want[0][1]}
    assert sorted((replica, shard) for replica, shard, _, _ in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for replica, _, loss, grads in results:
        assert_close(loss, want[replica][0], STEP_TOL, f"replica {replica}: loss")
        assert_grads_close(grads, mean, STEP_TOL)


def test_a_checksum_upcasts_a_block_at_a_time(monkeypatch):
    """`check_replicated`'s checksum of a tensor (sum, norm, sum weighted by
    position) equals float64 arithmetic on the whole tensor, while no
    operator makes more than a block's float64 copy: the whole upcast was
    10 GB at Qwen3.5-27B's embedding, outside the plan."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from longstraw.parallel import agreement

    monkeypatch.setattr(agreement, "CHECKSUM_BLOCK", 1000)
    t = torch.randn(7, 1001, dtype=torch.bfloat16)

    class LargestOutput(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
            for o in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in inputs:  # not a view
                    LargestOutput.largest = max(LargestOutput.largest, o.untyped_storage().nbytes())
            return out

    with LargestOutput():
        got = agreement._checksum(t, ordered=True)
    assert LargestOutput.largest <= 1000 * 8
    whole = t.double().reshape(-1)
    weights = torch.arange(whole.numel(), dtype=torch.float64).mul_(agreement._GOLDEN).frac_().add_(0.5)
    expected = torch.stack([whole.sum(), whole.norm(), whole.dot(weights)])
    assert torch.allclose(got, expected, rtol=1e-12, atol=0)
    assert agreement._checksum(t, ordered=False)[2] == 0
    assert not torch.equal(got, agreement._checksum(t.flip(-1), ordered=True))  # the order is seen
