"""What the ranks of a context-parallel group must agree on before a step: the graph, the options, the inputs
(checksums) and the random generators; a disagreement is raised on every rank, naming it.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from longstraw.errors import InputError
from longstraw.parallel.ranks import Ranks, raised_on_every_rank

if TYPE_CHECKING:
    from longstraw.options import Options



def graph_fingerprint(graph: torch.fx.Graph) -> float:
    """CRC-32 of the graph's text, which holds the Python values Dynamo folded into it (exact in float64)."""
    return float(zlib.crc32(str(graph).encode()))


# what a rank is doing when it calls `agree`: the collectives of the two differ after it
PLANNING, CALLING = 1.0, 2.0


_UNCOMPARED = ("progress", "memory_budget_gb", "context_parallel")  # display; per rank, agreed as a minimum; the group


def _option_fingerprints(options: Options) -> list[tuple[str, float]]:
    """(name, CRC-32 of the value) per option that decides a rank's
    collectives or values."""
    out = []
    for field in dataclasses.fields(options):
        if field.name in _UNCOMPARED:
            continue
        value = getattr(options, field.name)
        if field.name == "passes":  # a pass's own repr (a dataclass's fields), else its class: not its address
            value = [f"{type(p).__module__}.{type(p).__qualname__}" if type(p).__repr__ is object.__repr__ else repr(p)
                     for p in value]
        out.append((field.name, float(zlib.crc32(repr(value).encode()))))
    return out


def agree(
    phase: float, fingerprint: float, options: Options, value: float, group: dist.ProcessGroup | None,
    device: torch.device,
) -> list[float]:
    """Every rank's `value`, after checking that every rank of `group` is at
    the same point (`PLANNING` a step or `CALLING` one), with the same graph
    (`graph_fingerprint`) and the same options: a rank with another chunk
    size or mode would run other collectives than the rest, which hangs
    them or, collectives of equal sizes matched, mixes the wrong tensors.
    One all-gather of a header of the same size at both points, so a rank
    planning while another calls is caught too; every rank gathers the same
    headers and raises the same error."""
    ranks = Ranks(group)
    ranks.raise_posted()
    named = _option_fingerprints(options)
    header = torch.tensor([phase, fingerprint, *(v for _, v in named), value], dtype=torch.float64, device=device)
    gathered = [torch.empty_like(header) for _ in range(ranks.size)]
    ranks.all_gather(gathered, header)
    rows = torch.stack(gathered).cpu()
    for rank in range(1, len(rows)):
        differs = (rows[rank, :-1] != rows[0, :-1]).nonzero()
        if len(differs) == 0:
            continue
        where, fix = int(differs[0, 0]), "every rank must call the compiled loss the same way"
        if where == 0:
            doing = {PLANNING: "planning a step", CALLING: "calling a planned step"}
            what = f"rank 0 is {doing[float(rows[0, 0])]} while rank {rank} is {doing[float(rows[rank, 0])]}"
            fix = "every rank must call the compiled loss with the same inputs, as often (the same plan cache)"
        elif where == 1:
            what = f"the compiled graph differs between rank 0 and rank {rank}"
            fix = "every rank must compile the same loss, with the same Python values"
        else:
            what = f"the option `{named[where - 2][0]}` differs between rank 0 and rank {rank}"
            fix = "give every rank the same options (`memory_budget_gb` may differ: the smallest is planned for)"
        raise raised_on_every_rank(InputError(
            f"context parallelism: {what}: {fix} (each runs every step and keeps its share of the prompt state)"
        ))
    return rows[:, -1].tolist()


def check_replicated(
    values: Sequence[object], names: Sequence[str], data: Sequence[bool], fingerprint: float, options: Options,
    group: dist.ProcessGroup | None, generators: Sequence[torch.Tensor] = (),
) -> None:
    """Every rank of `group` must call with the same inputs, the same graph
    and the same options: each runs the whole step, and a rank with another
    prompt, other weights or another Python value folded into its graph (a
    scalar argument) would mix them into the others' attention. After
    `agree`, compared by a checksum per tensor (`_checksum`; `data`: which
    inputs are data, whose order is checked too) and the value of each
    number, in one all-gather per call. `generators`: the random number
    generators' states, when the loss draws random numbers (dropout): ranks
    that draw other masks compute other values where they must compute the
    same."""
    tensors = [(name, v, ordered) for name, v, ordered in zip(names, values, data) if isinstance(v, torch.Tensor)]
    checked = [(f"input `{name}`", _checksum(v.detach(), ordered)) for name, v, ordered in tensors]
    checked += [(f"input `{name}`", torch.tensor([float(v), 0.0, 0.0], dtype=torch.float64)) for name, v in zip(names, values)
                if isinstance(v, (int, float, torch.SymInt, torch.SymFloat))]
    checked += [(_GENERATOR, _checksum(g, ordered=True)) for g in generators]
    device = next((v.device for v in values if isinstance(v, torch.Tensor)), torch.device("cpu"))
    if len(set(agree(CALLING, fingerprint, options, float(len(checked)), group, device))) > 1:
        raise raised_on_every_rank(
            InputError("context parallelism: the ranks pass different numbers of inputs to the compiled loss")
        )
    sums = torch.stack([c.to(device) for _, c in checked])
    gathered = [torch.empty_like(sums) for _ in range(dist.get_world_size(group))]
    Ranks(group).all_gather(gathered, sums)
    for rank, other in enumerate(gathered):
        differs = ~((other == sums) | (other.isnan() & sums.isnan())).all(-1)
        if bool(differs.any()):
            what = checked[int(differs.nonzero()[0, 0])][0]
            fix = ("every rank must call the compiled loss with the same inputs, weights and Python values" if what != _GENERATOR
                   else "the loss draws random numbers (dropout), and every rank must draw the same: seed the group's "
                   "ranks alike, e.g. `torch.manual_seed(seed + data_parallel_rank)`, and draw nothing on one rank alone")
            raise raised_on_every_rank(InputError(
                f"context parallelism: {what} differs between rank {dist.get_rank(group)} and rank {rank} of the "
                f"group: {fix} (each runs the whole step and keeps its share of the prompt state)"
            ))


_GENERATOR = "the random number generators' state"


def _checksum(t: torch.Tensor, ordered: bool) -> torch.Tensor:
    """[sum, norm, weighted sum] of `t`, accumulated in float64. Sum and
    norm do not see order: rows of the completions shuffled on one rank,
    or a prompt's tokens, keep both. So data (`ordered`: small beside the
    weights) is also summed with a weight per element, the fractional
    parts of multiples of the golden ratio, which no reordering of unequal
    elements keeps but by coincidence; weights are loaded, not shuffled.
    `CHECKSUM_BLOCK` elements are upcast at a time: a reduction asked for
    float64 copies its whole input to float64 first, 10 GB for
    Qwen3.5-27B's embedding, which the planner does not count."""
    flat = t.reshape(-1)
    total, squares, weighted = (torch.zeros((), dtype=torch.float64, device=t.device) for _ in range(3))
    for start in range(0, flat.numel(), CHECKSUM_BLOCK):
        block = flat[start:start + CHECKSUM_BLOCK].double()
        total += block.sum()
        squares += torch.dot(block, block)
        if ordered:
            weights = torch.arange(start, start + block.numel(), dtype=torch.float64, device=t.device)
            weighted += torch.dot(block, weights.mul_(_GOLDEN).frac_().add_(0.5))
    return torch.stack([total, squares.sqrt(), weighted])


CHECKSUM_BLOCK = 1 << 24
"""Elements `_checksum` upcasts to float64 at once (128 MB)."""


_GOLDEN = (5**0.5 - 1) / 2
