"""How much of the memory budget a plan spends, and on what: the chunk size and
layer-wise recomputation the planner chooses for the budget, and the room left
beside the planned peak that the runner may fill with what it keeps for the
backward (earlier groups' states, the forward's autograd graphs)."""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Sequence

import torch

from longstraw.codegen.program import StepProgram
from longstraw.options import Options
from longstraw.parallel.agreement import PLANNING, agree, graph_fingerprint
from longstraw.planning.planner import DEFAULT_CHUNK, MemoryModel, Simulations, context_ranks, default_budget
from longstraw.runtime.device_memory import available_budget

log = logging.getLogger("longstraw.planning.sizing")


@dataclasses.dataclass(frozen=True)
class KeptRoom:
    """What the runner may keep for the backward beside the planned peak
    (`GroupRunner`): bytes of earlier groups' prompt states
    (`keep_group_states`), bytes of the forward's autograd graphs
    (`keep_graphs`), the bytes one prompt chunk's or one branch's graph is
    counted at, what the
    planned step needs beside the weights and gradients (state, d(state),
    activations), which the runner keeps free at every call
    (`device_memory.room_now`), and the room beside the planned peak
    whatever the options keep, where branch steps of several rows run
    (`Options.branch_rows`)."""

    states: int = 0
    graphs: int = 0
    graph_chunk: int = 0
    step: int = 0
    spare: int = 0


def size_plan(program: StepProgram, opts: Options, args: Sequence[Any], activations: Simulations) -> tuple[Options, KeptRoom]:
    """The options with `prefix_chunk_size` and `recompute_layers` decided:
    the user's where given, else the planner's choice (`longstraw.planning.planner`)
    for `memory_budget_gb`, or on CUDA for the device's free memory, else
    8192 without recomputation; and what the runner may keep for the
    backward (`KeptRoom`: where `keep_group_states` or `keep_graphs`
    is None, the budget's room beside the planned peak, a chunk's graph
    counted at the planned activations, an upper bound of what one reverse
    chunk holds). `activations` caches the planner's simulations. Under
    context parallelism every rank plans for the smallest budget of the
    group (`agree`): ranks that chose other chunk sizes would run other
    collectives."""
    group = opts.context_parallel
    planned = opts.prefix_chunk_size is None or opts.recompute_layers is None
    room = KeptRoom(KEEP_EVERY_STATE if opts.keep_group_states else 0, KEEP_EVERY_STATE if opts.keep_graphs else 0)
    if not planned and group is None:
        return opts, room
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    device = tensors[0].device if tensors else torch.device("cpu")
    if not planned:
        budget = None
    elif opts.memory_budget_gb is not None:
        budget = min(int(opts.memory_budget_gb * 1e9), available_budget(device))
    else:
        budget = default_budget(device)
    model, others = None, 0
    if budget is not None:
        model = MemoryModel(program, opts, activations)
        held = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        part = program.partition
        params = [a for p, a in zip(part.placeholders, args) if p in part.params and isinstance(a, torch.Tensor)]
        grads = sum(a.grad.numel() * a.grad.element_size() for a in params if a.grad is not None)
        others = max(held - model.weights - grads, 0)  # what the process holds besides the weights and their grads
    if group is not None:
        own = math.inf if budget is None else float(budget - others)
        smallest = min(agree(PLANNING, graph_fingerprint(program.partition.graph), opts, own, group, device))
        if budget is not None:
            budget = int(smallest) + others
    if not planned:
        return opts, room
    chunk, recompute = opts.prefix_chunk_size, opts.recompute_layers
    if budget is None:
        chunk, recompute = chunk or DEFAULT_CHUNK, bool(recompute)
    else:
        chosen = model.choose(model.prompt_len + 1, model.branch_len, opts.prompt_grad, device, budget - others, chunk, recompute,
                              ranks=context_ranks(opts))
        chunk, recompute = chosen.prefix_chunk_size, chosen.recompute_layers
        spare = max(budget - others - chosen.peak, 0)
        if group is None:
            room = KeptRoom(spare if opts.keep_group_states is None else room.states,
                            spare if opts.keep_graphs is None else room.graphs, chosen.activations,
                            chosen.state + chosen.state_grad + chosen.activations, spare)
        log.info("planned for a budget of %.1f GB (%.1f GB held besides the weights): prefix_chunk_size=%d, "
                 "recompute_layers=%s, predicted peak %.1f GB, %.1f GB of room for earlier groups' states and "
                 "kept graphs", budget / 1e9, others / 1e9, chunk, recompute, (chosen.peak + others) / 1e9, spare / 1e9)
    return dataclasses.replace(opts, prefix_chunk_size=chunk, recompute_layers=recompute), room


KEEP_EVERY_STATE = 1 << 62
"""`keep_group_states=True` or `keep_graphs=True`: room for any number of states or graphs."""
