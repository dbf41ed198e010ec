"""Absorbed latent attention (`longstraw/runtime/kernels/latent_attention.py`) is MLA with its
keys and values decompressed: causal, or over each query's selected positions only (float64
outputs and gradients of the queries, the step's latent and rope key, the weight and d(state)
against autograd through plain MLA), in key blocks or row blocks of one, never reading the
step's own positions from the buffers (NaN there); also on one rank of context parallelism;
`LatentKeys` reads and routes a share's keys, and a state that is not one row of positions is refused."""

from __future__ import annotations

import re

import pytest
import torch
from torch import fx

from longstraw.analysis.slots import SlotKind, StateSlot
from longstraw.parallel.ranks import SimulatedRanks
from longstraw.parallel.shards import PromptShard
from longstraw.runtime.kernels import attention, latent_attention
from longstraw.runtime.kernels.latent_attention import LatentKeys, absorbed_attention, flat_positions
from longstraw.runtime.prompt_state import PromptState, StepContext

from conftest import raises_longstraw

HEADS, NOPE, ROPE, VDIM, RANK = 2, 3, 2, 4, 5
PROMPT, STEP = 5, 3
SCALE = 0.4

# per query of the step (positions 5, 6, 7) its picks, and which are keys: the first query's
# only its own position, the second's only the prompt's, the third's both and one that is not a key
PICKS = torch.tensor([[5, 0, 0], [0, 3, 2], [1, 7, 4]])
VALID = torch.tensor([[True, False, False], [True, True, True], [True, True, False]])


def _state(shard: PromptShard | None = None) -> PromptState:
    """Latent slot [1, PROMPT, RANK] and rope-key slot [1, 1, PROMPT, ROPE], NaN-filled, d(state) allocated."""
    graph = fx.Graph()
    slots = [StateSlot(0, SlotKind.SEQUENCE, graph.placeholder("latent"), 1, 0, (1, PROMPT, RANK), torch.float64,
                       "mla:latent"),
             StateSlot(1, SlotKind.SEQUENCE, graph.placeholder("k_pe"), 2, 0, (1, 1, PROMPT, ROPE), torch.float64,
                       "mla:k_pe")]
    state = PromptState(slots, capacity=PROMPT + STEP, prefix_len=PROMPT, device=torch.device("cpu"), verify=True,
                        shard=shard)
    state.allocate_grads()
    return state


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).requires_grad_()


def _captured(state: PromptState) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt's latent [1, PROMPT, RANK] and rope key [1, 1, PROMPT, ROPE], written into the state."""
    latent, rope = _rand(1, PROMPT, RANK, seed=1), _rand(1, 1, PROMPT, ROPE, seed=2)
    capture = StepContext(state, 0, PROMPT, False)
    capture.write(0, latent.detach())
    capture.write(1, rope.detach())
    return latent, rope


def _step_inputs() -> list[torch.Tensor]:
    """q [1, H, n, NOPE + ROPE], the step's latent [1, n, RANK] and rope key [1, 1, n, ROPE],
    weight [H * (NOPE + VDIM), RANK]."""
    return [_rand(1, HEADS, STEP, NOPE + ROPE, seed=3), _rand(1, STEP, RANK, seed=4), _rand(1, 1, STEP, ROPE, seed=5),
            _rand(HEADS * (NOPE + VDIM), RANK, seed=6)]


def _mla(q, latent, rope, weight, allowed):
    """MLA decompressed: per head keys [W_k c | k_pe] and values W_v c over every position
    (`latent` [T, RANK], `rope` [T, ROPE]), softmax(q k^T * SCALE) where `allowed` [n, T]."""
    w = weight.view(HEADS, NOPE + VDIM, RANK)
    keys = torch.cat([torch.einsum("tr,hdr->htd", latent, w[:, :NOPE]), rope.expand(HEADS, -1, -1)], -1)
    values = torch.einsum("tr,hvr->htv", latent, w[:, NOPE:])
    s = (q[0] @ keys.transpose(-1, -2) * SCALE).masked_fill(~allowed, float("-inf"))
    return (torch.softmax(s, -1) @ values)[None]


def _causal() -> torch.Tensor:
    return torch.arange(PROMPT + STEP)[None, :] <= torch.arange(PROMPT, PROMPT + STEP)[:, None]


def _selected() -> torch.Tensor:
    allowed = torch.zeros(STEP, PROMPT + STEP, dtype=torch.bool)
    for row, (picks, valid) in enumerate(zip(PICKS, VALID)):
        allowed[row, picks[valid]] = True
    return allowed


def _check(state: PromptState, selected: tuple[torch.Tensor, torch.Tensor] | None, allowed: torch.Tensor) -> None:
    """A branch step after the captured prompt: its output and the gradients of its inputs and of
    the prompt's latent and rope key (d(state)) are `_mla`'s over the positions `allowed`."""
    prompt_latent, prompt_rope = _captured(state)
    inputs = _step_inputs()
    out = absorbed_attention(StepContext(state, PROMPT, STEP, True), *inputs, 0, 1, NOPE, SCALE, selected)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    got = [*torch.autograd.grad(out, inputs, grad_out), state.grads[0], state.grads[1]]
    latent = torch.cat([prompt_latent[0], inputs[1][0]])
    rope = torch.cat([prompt_rope[0, 0], inputs[2][0, 0]])
    want_out = _mla(inputs[0], latent, rope, inputs[3], allowed)
    want = torch.autograd.grad(want_out, [*inputs, prompt_latent, prompt_rope], grad_out)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    for name, a, b in zip(["q", "latent", "rope key", "weight", "(state latent)", "(state rope key)"], got, want):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12, msg=f"d{name}")


@pytest.mark.parametrize("block_scores", [1, 1 << 24], ids=["one-key-blocks", "one-block"])
def test_causal_absorbed_attention_is_mla(block_scores, monkeypatch):
    monkeypatch.setattr(attention, "MATH_BLOCK_SCORES", block_scores)
    _check(_state(), None, _causal())


@pytest.mark.parametrize("block_elements", [1, 1 << 27], ids=["one-row-blocks", "one-block"])
def test_attention_over_selected_positions_is_mla_over_those_only(block_elements, monkeypatch):
    """DSA's picks (`PICKS`), the ones not keys ignored."""
    monkeypatch.setattr(latent_attention, "SELECTED_BLOCK_ELEMENTS", block_elements)
    _check(_state(), (PICKS, VALID), _selected())


@pytest.mark.parametrize("selected", [None, (PICKS, VALID)], ids=["causal", "selected"])
def test_one_rank_of_context_parallelism_is_the_same_attention(selected):
    """The sharded forms with one rank holding the whole prompt (collectives over one rank
    are the identity), a query whose picks are all its own seeing nothing in the share."""
    shard = PromptShard(SimulatedRanks(0, 1), (((0, PROMPT),),))
    _check(_state(shard=shard), selected, _causal() if selected is None else _selected())


def test_latent_keys_read_a_share_and_route_its_gradients():
    """Keys [latent | rope key] with the latent as values; d(latent) is dK's latent part plus dV."""
    state = _state()
    prompt_latent, prompt_rope = _captured(state)
    keys, values = LatentKeys(0, 1, RANK).read(StepContext(state, PROMPT, STEP, True), 1, 4)
    want = torch.cat([prompt_latent[0, 1:4], prompt_rope[0, 0, 1:4]], -1)
    assert torch.equal(keys, want[None, None]) and torch.equal(values, want[None, None, :, :RANK])
    grad_k, grad_v = _rand(1, 1, 2, RANK + ROPE, seed=7).detach(), _rand(1, 1, 2, RANK, seed=8).detach()
    LatentKeys(0, 1, RANK).accumulate(StepContext(state, PROMPT, STEP, True), grad_k, grad_v, 2)
    LatentKeys(0, 1, RANK).accumulate(StepContext(state, PROMPT, STEP, True), grad_k, None, 3)
    want_latent = torch.zeros(PROMPT, RANK, dtype=torch.float64)
    want_latent[2:4] += grad_k[0, 0, :, :RANK] + grad_v[0, 0]
    want_latent[3:5] += grad_k[0, 0, :, :RANK]
    want_rope = torch.zeros(PROMPT, ROPE, dtype=torch.float64)
    want_rope[2:4] += grad_k[0, 0, :, RANK:]
    want_rope[3:5] += grad_k[0, 0, :, RANK:]
    assert torch.equal(state.grads[0][0], want_latent) and torch.equal(state.grads[1][0, 0], want_rope)


@pytest.mark.parametrize("shape, token_dim", [((1, 2, PROMPT, RANK), 2), ((1, RANK, PROMPT), 2)],
                         ids=["a-head-dim", "positions-last"])
def test_a_state_that_is_not_one_row_of_positions_is_refused(shape, token_dim):
    graph = fx.Graph()
    slot = StateSlot(0, SlotKind.SEQUENCE, graph.placeholder("latent"), token_dim, 0, shape, torch.float64,
                     "mla:latent")
    state = PromptState([slot], capacity=PROMPT, prefix_len=PROMPT, device=torch.device("cpu"))
    step = StepContext(state, PROMPT, 0, True)
    with raises_longstraw(rf"^latent attention: state {re.escape(str(shape))} is not one row of positions x features$"):
        flat_positions(step, 0, state.buffers[0])


@pytest.mark.parametrize("dtype, tf32", [(torch.bfloat16, True), (torch.float16, True), (torch.float32, False)])
def test_16_bit_models_multiply_on_tf32_units_inside_the_block_only(dtype, tf32):
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_tf32
    with latent_attention._products_exact_for(dtype):
        assert matmul.allow_tf32 is (tf32 or before)
    assert matmul.allow_tf32 is before
