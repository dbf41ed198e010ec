"""What a step may still allocate (`runtime/device_memory.py`): no limit and
no measurement off CUDA; on CUDA the room now, less what is allocated, the
step's needs and the gradients not allocated yet, never below zero nor
above what was planned."""

from __future__ import annotations

import pytest
import torch

from longstraw.runtime.device_memory import BUDGET_MARGIN, allocated, available_budget, room_now


def test_off_cuda_the_plan_is_the_room():
    cpu = torch.device("cpu")
    assert available_budget(cpu) == 1 << 62
    assert room_now(cpu, planned=123, step_bytes=10**12, missing_grads=10**12) == 123
    assert allocated(cpu) is None


@pytest.mark.gpu
def test_on_cuda_the_room_shrinks_with_what_is_allocated():
    device = torch.device("cuda")
    free, total = torch.cuda.mem_get_info(device)
    budget = available_budget(device)
    assert budget <= torch.cuda.memory_allocated(device) + free + torch.cuda.memory_reserved(device) - BUDGET_MARGIN * total + 1
    live = budget - torch.cuda.memory_allocated(device)
    assert room_now(device, planned=live // 2, step_bytes=0, missing_grads=0) == live // 2
    assert room_now(device, planned=live, step_bytes=live // 4, missing_grads=live // 4) <= live - live // 2
    assert room_now(device, planned=live, step_bytes=2 * live, missing_grads=0) == 0
    held = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    assert allocated(device) >= 1 << 20
    del held
