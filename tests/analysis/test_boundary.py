"""What to capture (`analysis/boundary.py`): a tensor's bytes per position
of one sequence, and the choice among a pass's candidates of the one
cheapest per position (ties to the farthest from the claimed input), one
slot per captured tensor however many claims share it, and a carry slot
per fixed-size state a pass carries."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import pytest
import torch
import torch.fx as fx

from longstraw.analysis.boundary import bytes_per_position, choose_state
from longstraw.analysis.dims import DimAnalysis
from longstraw.analysis.slots import SlotKind, StateSlot
from longstraw.errors import UnsupportedGraphError
from longstraw.passes.base import ArchitecturePass, Candidate, SiteState

from helpers.recorded import ValueRecorder

G, P, C = 2, 5, 4


def _analysed(fn: Callable[..., Any]) -> tuple[DimAnalysis, dict[str, fx.Node], int, int]:
    """`fn` of `x` [G, P, C] (float64) traced, with the classes of x's positions and of its groups."""
    gm = fx.symbolic_trace(fn)
    ValueRecorder(gm).run(torch.ones(G, P, C, dtype=torch.float64))
    an = DimAnalysis(gm.graph)
    nodes = {n.name: n for n in gm.graph.nodes}
    group, token, _ = (an.classes(d)[0] for d in an.dims_of(nodes["x"]))
    return an, nodes, token, group


class _Listed(ArchitecturePass):
    """Claims nodes whose one state input (their first argument) may be captured as any tensor
    `chains[node]` lists, from the input up; carries the fixed-size states `carried` lists."""

    name = "listed"

    def __init__(self, chains: dict[fx.Node, list[fx.Node]],
                 carried: Sequence[tuple[tuple[int, ...], torch.dtype]] = ()) -> None:
        self.chains, self.carried = chains, list(carried)

    def state_inputs(self, node: fx.Node) -> list[fx.Node]:
        return [node.args[0]]

    def candidates(self, node: fx.Node, state_input: fx.Node) -> list[Candidate]:
        return [Candidate(n, f"from {n.name}") for n in self.chains[node]]

    def carries(self, node: fx.Node) -> list[tuple[tuple[int, ...], torch.dtype]]:
        return self.carried


def test_bytes_per_position_count_one_position_of_one_sequence():
    an, n, token, group = _analysed(lambda x: (x.view(G * P, C), x[0], x.float().transpose(0, 1), x.mean(1)))
    assert bytes_per_position(n["x"], an, token, group) == C * 8
    assert bytes_per_position(n["view"], an, token, group) == C * 8  # groups and positions in one dimension
    assert bytes_per_position(n["getitem"], an, token, group) == C * 8
    assert bytes_per_position(n["transpose"], an, token, group) == C * 4
    assert bytes_per_position(n["mean"], an, token, group) is None


def _chain(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    narrow = x[..., :2]  # 2 * 8 bytes per position
    wide = x.repeat_interleave(2, dim=2)  # 2 * C * 8
    k = wide.contiguous()
    return narrow.cumsum(1), k.cumsum(1), wide.cumsum(1), x.mean(1)


def test_the_cheapest_candidate_per_position_is_captured_near_or_far():
    an, n, token, group = _analysed(_chain)
    narrow_claim, k_claim = n["cumsum"], n["cumsum_1"]
    pass_ = _Listed({narrow_claim: [n["getitem"], n["x"]],
                     k_claim: [n["contiguous"], n["repeat_interleave"], n["x"]]})
    slots, sites = choose_state({narrow_claim: pass_, k_claim: pass_}, an, token, group)
    assert [s.node for s in slots] == [n["getitem"], n["x"]]
    assert sites == {narrow_claim: [SiteState(n["getitem"], 0, "from getitem")],
                     k_claim: [SiteState(n["x"], 1, "from x")]}


def test_a_tie_goes_to_the_candidate_farthest_from_the_claimed_input():
    an, n, token, group = _analysed(_chain)
    claim = n["cumsum_1"]
    slots, sites = choose_state({claim: _Listed({claim: [n["contiguous"], n["repeat_interleave"]]})}, an, token, group)
    assert sites[claim] == [SiteState(n["repeat_interleave"], 0, "from repeat_interleave")]


def test_a_candidate_without_a_sequence_axis_is_never_captured():
    an, n, token, group = _analysed(_chain)
    claim = n["cumsum_1"]
    slots, sites = choose_state({claim: _Listed({claim: [n["contiguous"], n["mean"]]})}, an, token, group)
    assert [s.node for s in slots] == [n["contiguous"]]


def test_a_state_input_with_no_candidate_holding_positions_is_refused_naming_it():
    an, n, token, group = _analysed(_chain)
    claim = n["cumsum_1"]
    with pytest.raises(UnsupportedGraphError, match=r"reads its state from .*no tensor on the way there holds one "
                                                    r"value per prompt position.*on_unsupported"):
        choose_state({claim: _Listed({claim: [n["mean"]]})}, an, token, group)


def test_a_sequence_slot_has_one_group_and_claims_that_capture_one_tensor_share_it():
    an, n, token, group = _analysed(_chain)
    first, second = n["cumsum_1"], n["cumsum_2"]
    pass_ = _Listed({first: [n["contiguous"], n["repeat_interleave"], n["x"]],
                     second: [n["repeat_interleave"], n["x"]]})
    slots, sites = choose_state({first: pass_, second: pass_}, an, token, group)
    assert slots == [StateSlot(index=0, kind=SlotKind.SEQUENCE, node=n["x"], token_dim=1, batch_dim=0,
                               shape=(1, P, C), dtype=torch.float64, reason=f"listed:{first.name}")]
    assert sites[first] == sites[second] == [SiteState(n["x"], 0, "from x")]


def test_a_carried_state_gets_a_fixed_slot_after_the_sequence_slots():
    an, n, token, group = _analysed(_chain)
    claim = n["cumsum"]
    pass_ = _Listed({claim: [n["getitem"]]}, carried=[((1, 3, 3), torch.float32)])
    slots, sites = choose_state({claim: pass_}, an, token, group)
    assert [s.kind for s in slots] == [SlotKind.SEQUENCE, SlotKind.CARRY]
    assert slots[1] == StateSlot(index=1, kind=SlotKind.CARRY, node=claim, token_dim=None, batch_dim=None,
                                 shape=(1, 3, 3), dtype=torch.float32, reason=f"listed:{claim.name}")
    assert sites[claim] == [SiteState(n["getitem"], 0, "from getitem"), SiteState(claim, 1, None)]
