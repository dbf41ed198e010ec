"""Prompt state bookkeeping (longstraw/state.py): what carries and their
gradients keep alive, which must not grow with the number of chunks beyond
their own size."""

from __future__ import annotations

import torch
from torch import fx

from longstraw.state import PromptState, StateSlot, StepContext

CHANNELS, WIDTH, CHUNK = 6, 3, 16


def _conv_state(prefix_len: int) -> PromptState:
    slot = StateSlot(0, "carry", fx.Graph().placeholder("conv"), None, 0, (1, CHANNELS, WIDTH), torch.float64, "conv tail")
    state = PromptState([slot], capacity=prefix_len + 4, prefix_len=prefix_len, device=torch.device("cpu"))
    state.allocate_grads()
    return state


def _tail_of_chunk() -> torch.Tensor:
    """What a conv step produces for its carry: the last inputs of a chunk-sized tensor."""
    full = torch.randn(1, CHANNELS, WIDTH + CHUNK, dtype=torch.float64)
    return full[..., -WIDTH:]


def test_carries_and_their_gradients_are_copies():
    state = _conv_state(2 * CHUNK)
    first, second = StepContext(state, 0, CHUNK, False), StepContext(state, CHUNK, CHUNK, True)
    first.carry_out(0, _tail_of_chunk())
    grads = [_tail_of_chunk(), _tail_of_chunk()]
    second.accumulate_carry_grad(0, grads[0])
    own = CHANNELS * WIDTH * 8
    assert state.carries[0][CHUNK].untyped_storage().nbytes() == own
    assert state.carry_grads[0][CHUNK].untyped_storage().nbytes() == own
    second.accumulate_carry_grad(0, grads[1])  # another branch's contribution adds up
    torch.testing.assert_close(state.carry_grads[0][CHUNK], grads[0] + grads[1], rtol=0, atol=0)


def test_a_carry_gradient_is_handed_over_once():
    state = _conv_state(2 * CHUNK)
    grad = _tail_of_chunk()
    StepContext(state, CHUNK, CHUNK, True).accumulate_carry_grad(0, grad)
    slot = state.slots[0]
    torch.testing.assert_close(state.seed(slot, 0, CHUNK), grad, rtol=0, atol=0)
    assert state.seed(slot, 0, CHUNK) is None
    assert state.carry_grads[0] == {}
