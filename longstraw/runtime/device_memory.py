"""What a step may still allocate on its device: the planner's budget cap
and the runtime's check, at each call, of the room it plans to fill."""

from __future__ import annotations

import torch

BUDGET_MARGIN = 0.05
"""Kept free of the device's memory when capping a budget (allocator fragmentation)."""


def available_budget(device: torch.device) -> int:
    """The most a step may hold: on CUDA what is allocated now plus free, less a margin; elsewhere no limit."""
    if device.type != "cuda":
        return 1 << 62
    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(torch.cuda.memory_allocated(device) + free + cached - BUDGET_MARGIN * total)


def room_now(device: torch.device, planned: int, step_bytes: int, missing_grads: int) -> int:
    """`planned` room, less what the device lost since planning: on CUDA the
    most that can be allocated now beside what is allocated, the step's own
    needs (`step_bytes`: state, d(state), activations) and the gradients not
    allocated yet. A trainer's optimizer allocates its states after the
    first step, inside the room planned at the first call."""
    if device.type != "cuda":
        return planned
    live = available_budget(device) - torch.cuda.memory_allocated(device) - step_bytes - missing_grads
    return max(0, min(planned, live))


def allocated(device: torch.device) -> int | None:
    """Bytes allocated on `device` now, where the runtime can tell (CUDA); None elsewhere."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None
