"""Several prompts in one batch (longstraw/runtime/batch_groups.py, `GroupRunner`):
rows are grouped by their prompt part, in any order and with a different
number of completions per prompt, each group captured and replayed in turn,
one group's state live at a time, or every group's kept from the forward
for the backward where memory allows (`keep_group_states`). Parity against
eager in float64."""

from __future__ import annotations

import pytest
import torch

import longstraw

from conftest import raises_longstraw
from helpers.batches import batch_loss, detached_batch_reference, make_batch
from helpers.compare import assert_close, assert_grads_close, grads_equal
from helpers.families import FAMILIES
from helpers.harness import assert_parity, compile_loss, compiled_loss_and_grads, count_live_states
from helpers.losses import pg_tail
from helpers.parity import deterministic_algorithms
from helpers.reference import eager_loss_and_grads, grads_of
from helpers.tiny_models import make_group, make_model

TOL = 1e-6


def check_batch(family: str, mode: str, sizes: list[int], P: int, R: int, chunk: int, keep: bool | None = None) -> None:
    fam = FAMILIES[family]
    model = fam.build()
    batch = make_batch(sizes, P, R, vocab=model.config.vocab_size)
    backend = longstraw.Backend(prompt_grad=mode, prefix_chunk_size=chunk, verify_state=True, keep_group_states=keep)
    with fam.bind(), deterministic_algorithms(True):
        assert_parity(batch_loss, backend, detached_batch_reference, model, *batch, tol=TOL, what=f"{family} loss")


@pytest.mark.parametrize("mode", ["exact", "detached"])
def test_several_prompts_match_eager_dense(mode):
    check_batch("qwen3", mode, sizes=[3, 2, 4], P=11, R=4, chunk=4)


def test_several_prompts_match_eager_hybrid():
    check_batch("qwen3_5", "exact", sizes=[2, 3], P=13, R=3, chunk=5)


@pytest.mark.slow
@pytest.mark.parametrize("sizes", [[2, 2], [5, 2, 3, 2]])
@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_several_prompts_sweep(family, sizes):
    check_batch(family, "exact", sizes=sizes, P=9, R=5, chunk=3)


def test_one_group_state_live_at_a_time(monkeypatch):
    """Three prompts: at most one PromptState holds buffers at any moment,
    and each group but the last is captured twice (forward, then backward)."""
    states = count_live_states(monkeypatch)
    model = FAMILIES["qwen3"].build()
    batch = make_batch([2, 3, 2], P=10, R=3, vocab=model.config.vocab_size)
    compiled_loss_and_grads(torch.compile(batch_loss, backend=longstraw.Backend(prefix_chunk_size=4)), model, *batch)
    assert states.peak == 1 and states.made == 5


@pytest.mark.parametrize("family, mode", [  # CI: the hybrid exact, the dense model detached; `-m slow` the dense exact
    pytest.param("qwen3", "exact", marks=pytest.mark.slow), ("qwen3", "detached"), ("qwen3_5", "exact")])
def test_kept_group_states_match_eager(family, mode):
    """Every group's state from the forward, none captured again: the same
    loss and gradients, uninitialised memory NaN."""
    check_batch(family, mode, sizes=[2, 3, 2], P=11, R=4, chunk=4, keep=True)


def test_kept_group_states_are_not_captured_again(monkeypatch):
    """`keep_group_states=True`: three states made, all live together at the
    backward; `None` without a budget (nothing planned) keeps none."""
    model = FAMILIES["qwen3"].build()
    batch = make_batch([2, 3, 2], P=10, R=3, vocab=model.config.vocab_size)
    states = count_live_states(monkeypatch)
    backend = longstraw.Backend(prefix_chunk_size=4, keep_group_states=True)
    compiled_loss_and_grads(torch.compile(batch_loss, backend=backend), model, *batch)
    assert states.made == 3 and states.peak == 3
    torch._dynamo.reset()
    states = count_live_states(monkeypatch)
    compiled_loss_and_grads(torch.compile(batch_loss, backend=longstraw.Backend(prefix_chunk_size=4)), model, *batch)
    assert states.made == 5 and states.peak == 1


def test_a_budget_keeps_the_states_it_has_room_for(monkeypatch):
    """Planned (`keep_group_states=None` with a budget): the room the budget
    leaves beside the planned peak decides. A large budget keeps every
    earlier group's state; room for one state keeps the first group's
    only (the second is captured again in backward); the gradients are the same."""
    from longstraw import pipeline
    from longstraw.planning.sizing import KeptRoom

    model = FAMILIES["qwen3"].build()
    batch = make_batch([2, 3, 2], P=10, R=3, vocab=model.config.vocab_size)
    sized = pipeline.size_plan

    def room_for_one_state(program, *args):
        options, _ = sized(program, *args)
        part = program.partition
        return options, KeptRoom(sum(s.bytes_per_position() * part.end + s.fixed_bytes() for s in part.slots))

    grads = []
    for room, live in ((None, 3), (room_for_one_state, 2)):
        torch._dynamo.reset()
        if room is not None:
            monkeypatch.setattr(pipeline, "size_plan", room)
        states = count_live_states(monkeypatch)
        backend = longstraw.Backend(memory_budget_gb=100.0, prefix_chunk_size=4, branch_rows=1)  # bit for bit
        grads.append(compiled_loss_and_grads(torch.compile(batch_loss, backend=backend), model, *batch))
        assert states.peak == live, room  # (the planner's simulation makes a state of its own, alone)
    assert grads[0][0] == grads[1][0] and all(torch.equal(grads[0][1][n], g) for n, g in grads[1][1].items())


def test_a_prompt_with_one_completion_is_refused():
    model = FAMILIES["qwen3"].build()
    ids, advantages, mask = make_batch([3, 1, 2], P=8, R=3, vocab=model.config.vocab_size)
    single = next(r for r in range(ids.shape[0]) if (ids[:, :7] == ids[r, :7]).all(1).sum() == 1)
    before = grads_of(model)
    with raises_longstraw(rf"row {single} shares no prompt with any other row"):
        batch_loss_compiled = torch.compile(batch_loss, backend=longstraw.Backend(prefix_chunk_size=4))
        batch_loss_compiled(model, ids, advantages, mask).backward()
    assert all(g is None for g in grads_of(model).values()) and all(g is None for g in before.values())


def test_groups_are_reported_per_call():
    model = FAMILIES["qwen3"].build()
    backend = longstraw.Backend(prefix_chunk_size=4)
    compiled_loss_and_grads(torch.compile(batch_loss, backend=backend), model,
                            *make_batch([2, 3], P=9, R=3, vocab=model.config.vocab_size))
    record = backend.plans[-1].runner.last_call
    assert sorted(record.group_sizes) == [2, 3] and record.prefix_len == 8


@pytest.mark.parametrize("value", ["yes", 1])
def test_keep_group_states_is_validated(value):
    with pytest.raises(longstraw.LongStrawError, match="keep_group_states must be a bool or None"):
        longstraw.Backend(keep_group_states=value)


def offset_loss(model, prompt, responses, advantages, mask, offset):
    """A per-row offset [G, 1, H] added to every position's input embedding
    (a per-response steering vector), so it feeds the prompt's computation."""
    ids = torch.cat([prompt.expand(responses.shape[0], -1), responses], dim=1)
    embeds = model.get_input_embeddings()(ids) + offset
    logits = model(inputs_embeds=embeds).logits[:, prompt.shape[0] - 1 : -1]
    return pg_tail(logits, responses, advantages, mask)


def test_exact_mode_refuses_per_row_prompt_inputs_that_require_grad():
    """Exact mode runs the prompt once, so it cannot give each row of a
    per-row input its own gradient: refused when the plan is made
    (`BatchGroups.check_prompt_gradients`). Without
    requires_grad the input is checked at run time: rows that differ would
    give the rows different prompts (refused), equal rows are exact."""
    model = make_model("qwen3")
    prompt, responses, advantages, mask = make_group(3, 13, 5)
    hidden = model.config.hidden_size
    gen = torch.Generator().manual_seed(1)
    offset = (0.1 * torch.randn(1, 1, hidden, dtype=torch.float64, generator=gen)).expand(3, 1, hidden).clone()
    step = compile_loss(offset_loss, longstraw.Backend(prefix_chunk_size=4))
    before = grads_of(model)
    with raises_longstraw(
        r"^`offset` requires grad and gives each row of the group its own copy of the prompt \(through `\w+`\): "
        r"exact mode computes the prompt once.*prompt_grad='detached'"
    ):
        step(model, prompt, responses, advantages, mask, offset.clone().requires_grad_(True)).backward()
    differing = offset + 0.1 * torch.randn(3, 1, hidden, dtype=torch.float64, generator=gen)
    with raises_longstraw(r"^`offset` differs between the rows of the group but feeds the prompt's computation"):
        step(model, prompt, responses, advantages, mask, differing).backward()
    assert grads_equal(grads_of(model), before)
    args = (prompt, responses, advantages, mask, offset)
    got = compiled_loss_and_grads(step, model, *args)
    want = eager_loss_and_grads(offset_loss, model, *args)
    assert_close(got[0], want[0], 1e-6, "loss")
    assert_grads_close(got[1], want[1], 1e-6)
