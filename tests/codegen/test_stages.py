"""Scoring stages (`codegen/stages.py`): where the state a frozen model captures is cut off into a
stage of its own, handing its per-token values to the live one, and where the cut is refused (hand-built
graphs); and the stages of a planned loss that scores a frozen reference model beside the policy."""

from __future__ import annotations

import operator
import types

import pytest
import torch
import torch.fx as fx

from longstraw.analysis.slots import SlotKind, StateSlot
from longstraw.backend import Backend, PlanningDone
from longstraw.codegen import stages
from longstraw.codegen.stages import frozen_cut, stages_of
from longstraw.errors import module_path
from longstraw.runtime.prompt_state import write_state

from helpers.harness import compile_loss
from helpers.losses import kl_tail, logits_of, sequences
from helpers.plain_transformer import make_plain
from helpers.tiny_models import make_group


def _valued(node: fx.Node, requires_grad: bool) -> fx.Node:
    node.meta["longstraw_value"] = torch.zeros(2, requires_grad=requires_grad)
    return node


def _scoring(frozen_reference: bool = True, frozen_policy: bool = False, policy_key_reads_reference: bool = False,
             **fields) -> tuple[types.SimpleNamespace, dict[str, fx.Node]]:
    """A policy key `kp` (slot 0) and a reference key `kr` (slot 1) over one
    prompt; per branch, attention `ap` over kp and `ar` over kr, the
    reference's per-token value `lr = -ar`, and the loss row `ap - lr`.
    `fields` replace the partition's (sites, positional, branch outputs)."""
    graph = fx.Graph()
    ids, w, w_ref = (_valued(graph.placeholder(name), grad) for name, grad in
                     (("ids", False), ("w", not frozen_policy), ("w_ref", not frozen_reference)))
    kr = _valued(graph.call_function(operator.mul, (ids, w_ref)), not frozen_reference)
    prompt = [kr, _valued(graph.call_function(operator.mul, (ids, w)), not frozen_policy)]
    if policy_key_reads_reference:
        prompt.append(_valued(graph.call_function(operator.add, (prompt[-1], kr)), True))
    kp = prompt[-1]
    ap = _valued(graph.call_function(torch.sin, (kp,)), not frozen_policy)
    ar = _valued(graph.call_function(torch.cos, (kr,)), not frozen_reference)
    lr = _valued(graph.call_function(operator.neg, (ar,)), not frozen_reference)
    row = _valued(graph.call_function(operator.sub, (ap, lr)), True)
    graph.output(row)
    slots = [StateSlot(i, SlotKind.SEQUENCE, node, token_dim=0, batch_dim=None, shape=(2,), dtype=torch.float32,
                       reason=f"test:{node.name}") for i, node in enumerate((kp, kr))]
    part = dict(graph=graph, placeholders=[ids, w, w_ref], slots=slots, sequence=set(prompt), branch={ap, ar, lr, row},
                branch_outputs=[row], positional=set(), roots=[], outer_data=set(),
                sites={ap: [types.SimpleNamespace(slot=0)], ar: [types.SimpleNamespace(slot=1)]})
    part.update(fields)
    return types.SimpleNamespace(**part), dict(kp=kp, kr=kr, ap=ap, ar=ar, lr=lr, row=row)


def test_a_frozen_models_state_is_cut_off_handing_its_per_token_values_on():
    part, nodes = _scoring()
    assert frozen_cut(part) == ([part.slots[1]], [nodes["lr"]])


def test_a_frozen_value_that_is_a_branch_output_is_handed_too():
    part, nodes = _scoring()
    part.branch_outputs = [nodes["row"], nodes["ar"]]
    assert frozen_cut(part) == ([part.slots[1]], [nodes["ar"], nodes["lr"]])


@pytest.mark.parametrize("case", ["nothing frozen", "everything frozen", "a live operator reads frozen state",
                                  "a handed value is built per block", "live state reads frozen state"])
def test_no_clean_cut_keeps_one_stage(case):
    part, nodes = {
        "nothing frozen": lambda: _scoring(frozen_reference=False),
        "everything frozen": lambda: _scoring(frozen_policy=True),
        "live state reads frozen state": lambda: _scoring(policy_key_reads_reference=True),
    }.get(case, _scoring)()
    if case == "a live operator reads frozen state":  # DSA's index keys, captured without grad, read by the attention
        part.sites[nodes["ap"]] = [types.SimpleNamespace(slot=0), types.SimpleNamespace(slot=1)]
    if case == "a handed value is built per block":
        part.positional = {nodes["lr"]}
    assert frozen_cut(part) is None


def _kl_loss(reference: torch.nn.Module, reference_first: bool):
    """GRPO with a KL term to `reference`, scored under no_grad before or after the policy."""

    def loss_fn(model, prompt, responses, advantages, mask):
        ids, p = sequences(prompt, responses), prompt.shape[0]
        scored = lambda m: logits_of(m(input_ids=ids))[:, p - 1:-1]  # noqa: E731
        if not reference_first:
            logits = scored(model)
        with torch.no_grad():
            ref_logits = scored(reference)
        if reference_first:
            logits = scored(model)
        return kl_tail(logits, ref_logits, responses, advantages, mask)

    return loss_fn


def _partition(reference_first: bool):
    backend = Backend(prefix_chunk_size=4, recompute_layers=False)
    backend.stop_after_planning = True
    reference = make_plain(seed=1, num_layers=1).requires_grad_(False)
    with pytest.raises(PlanningDone) as planned:
        compile_loss(_kl_loss(reference, reference_first), backend)(make_plain(num_layers=1), *make_group(2, 5, 2))
    return planned.value.plan.partition


@pytest.fixture(scope="module")
def scored_first():
    return _partition(reference_first=True)


def _written(step) -> set[int]:
    return {n.args[1] for n in step.module.graph.find_nodes(op="call_function", target=write_state)}


def test_a_frozen_reference_is_captured_and_scored_first_and_hands_the_policys_stage_its_values(scored_first):
    frozen, live = stages_of(scored_first)
    reference = {s.index for s in scored_first.slots if module_path(s.node).startswith("reference.")}
    assert frozen.active == reference and live.active == {s.index for s in scored_first.slots} - reference
    assert _written(frozen.prefix) == frozen.active and _written(live.prefix) == live.active
    assert (frozen.outputs, live.outputs) == ((), (0,))  # the loss row reads both models
    assert frozen.hands and frozen.handed == frozenset() and live.handed == frozenset(frozen.hands)
    assert set(frozen.hands) <= set(live.branch.externals)


def test_without_a_cut_one_stage_captures_every_slot_and_computes_every_output(scored_first, monkeypatch):
    monkeypatch.setattr(stages, "frozen_cut", lambda part: None)
    (stage,) = stages_of(scored_first)
    assert stage.slots == tuple(scored_first.slots) and stage.outputs == (0,)
    assert _written(stage.prefix) == stage.active and stage.hands == () and stage.handed == frozenset()


def test_the_cut_does_not_depend_on_whether_the_reference_is_scored_before_the_policy():
    assert len(stages_of(_partition(reference_first=False))) == 2
