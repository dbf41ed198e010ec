"""Prompt state bookkeeping (longstraw/runtime/prompt_state.py): what carries and their
gradients keep alive, which must not grow with the number of chunks beyond
their own size; what `verify_state` checks on every write."""

from __future__ import annotations

import pytest
import torch
from torch import fx

from longstraw.analysis.slots import SlotKind, StateSlot
from longstraw.runtime.prompt_state import PromptState, StepContext

from conftest import raises_longstraw

CHANNELS, WIDTH, CHUNK = 6, 3, 16


def _conv_state(prefix_len: int) -> PromptState:
    slot = StateSlot(0, SlotKind.CARRY, fx.Graph().placeholder("conv"), None, 0, (1, CHANNELS, WIDTH), torch.float64, "conv tail")
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


# --- verify_state: every prompt position written once, replays write the same --------

PROMPT, HEADS, DIM = 8, 2, 4


def _kv_state() -> PromptState:
    """One K-like sequence slot [1, heads, positions, dim], verified, with room for a 3-position branch."""
    slot = StateSlot(0, SlotKind.SEQUENCE, fx.Graph().placeholder("k"), 2, 0, (1, HEADS, PROMPT, DIM), torch.float64, "attention:k")
    return PromptState([slot], capacity=PROMPT + 3, prefix_len=PROMPT, device=torch.device("cpu"), verify=True)


def _values(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(1, HEADS, length, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def test_verify_starts_unwritten_and_accepts_one_write_per_position():
    state = _kv_state()
    assert state.buffers[0].isnan().all()
    assert state.unwritten() is state.slots[0]
    StepContext(state, 0, 5, False).write(0, _values(5))
    assert state.unwritten() is state.slots[0]  # positions 5..7 still unwritten
    StepContext(state, 5, 3, False).write(0, _values(3, 1))
    assert state.unwritten() is None
    StepContext(state, PROMPT, 3, False).write(0, _values(3, 2))  # a branch: scratch room, never checked
    StepContext(state, PROMPT, 3, False).write(0, _values(3, 3))
    torch.testing.assert_close(state.buffers[0][:, :, :5], _values(5), rtol=0, atol=0)


def test_verify_refuses_a_second_capture_write():
    state = _kv_state()
    StepContext(state, 0, 4, False).write(0, _values(4))
    with raises_longstraw(r"^verify_state: the prompt capture wrote state slot 0 \(attention:k\) of `k`, positions \[3, 6\) twice$"):
        StepContext(state, 3, 3, False).write(0, _values(3, 1))


def test_verify_refuses_a_replay_with_other_values():
    state = _kv_state()
    StepContext(state, 0, 4, False).write(0, _values(4))
    StepContext(state, 0, 4, True).write(0, _values(4))  # the reverse pass recomputes the same values
    changed = _values(4)
    changed[0, 1, 2, 3] += 1e-12
    with raises_longstraw(r"^verify_state: the reverse pass recomputed state slot 0 \(attention:k\) of `k`, positions \[0, 4\) "
                          r"with other values than the capture$"):
        StepContext(state, 0, 4, True).write(0, changed)


# --- which chunk boundaries the capture keeps, and where -------------------------------


def _capture_three_chunks(state: PromptState) -> None:
    for offset in range(0, 3 * CHUNK, CHUNK):
        ctx = StepContext(state, offset, CHUNK, False)
        ctx.carry_out(0, ctx.carry_in(0) + 1)


def test_detached_capture_keeps_only_the_latest_carry():
    slot = StateSlot(0, SlotKind.CARRY, fx.Graph().placeholder("conv"), None, 0, (1, CHANNELS, WIDTH), torch.float64, "conv tail")
    state = PromptState([slot], capacity=3 * CHUNK + 4, prefix_len=3 * CHUNK, device=torch.device("cpu"),
                        boundaries=False)
    _capture_three_chunks(state)
    assert list(state.carries[0]) == [3 * CHUNK]
    torch.testing.assert_close(state.carries[0][3 * CHUNK], torch.full((1, CHANNELS, WIDTH), 3.0, dtype=torch.float64))


def test_exact_capture_keeps_every_boundary_on_the_host_of_a_gpu():
    """Shapes only (fake CUDA tensors): the latest carry stays on the device,
    the earlier boundaries go to the host and come back on the device when
    a reverse-pass chunk starts from them; a recomputing step stores nothing."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    slot = StateSlot(0, SlotKind.CARRY, fx.Graph().placeholder("conv"), None, 0, (1, CHANNELS, WIDTH), torch.float64, "conv tail")
    with FakeTensorMode(allow_non_fake_inputs=True):
        state = PromptState([slot], capacity=3 * CHUNK + 4, prefix_len=3 * CHUNK, device=torch.device("cuda"))
        _capture_three_chunks(state)
        where = {position: c.device.type for position, c in state.carries[0].items()}
        assert where == {0: "cpu", CHUNK: "cpu", 2 * CHUNK: "cpu", 3 * CHUNK: "cuda"}
        reverse = StepContext(state, CHUNK, CHUNK, True)
        assert reverse.carry_in(0).device.type == "cuda"
        reverse.carry_out(0, reverse.carry_in(0))
        assert state.carries[0][2 * CHUNK].device.type == "cpu"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_host_copies_keep_values_and_layout(device):
    """`HostCopier` round trip (on CUDA through pinned slabs and a side
    stream): the values as they were when handed over (a later in-place
    write does not reach them) and the same strides (flash attention's
    output is a transposed layout its backward reads)."""
    from longstraw.runtime.host_offload import HostCopier

    copier = HostCopier(torch.device(device))
    out = torch.randn(1, 6, 4, 8, device=device).transpose(1, 2)  # [1, 4, 6, 8] laid out as [1, 6, 4, 8]
    lse = torch.randn(1, 4, 6, device=device)
    want = (out.clone(), lse.clone())
    landing = copier.to_host((out, lse))
    out.add_(1.0)
    back = copier.to_device(landing).wait()
    assert all(torch.equal(b, w) for b, w in zip(back, want))
    assert back[0].stride() == out.stride() and back[1].stride() == lse.stride()
