"""Positions-only masks computed tile by tile (longstraw/runtime/mask_block.py).

A step never builds its `n x (o+n)` mask block: the causal check walks it in
tiles and remembers the answer per block, and a mask that is not plain
causal reaches the attention kernel one key block at a time.
"""

from __future__ import annotations

import pytest
import torch
from torch import fx
from torch.utils._python_dispatch import TorchDispatchMode

import longstraw
from longstraw.runtime import mask_block as masks
from longstraw.runtime.kernels import attention as attention_kernels

from helpers.harness import compile_loss, compiled_loss_and_grads
from helpers.losses import grpo_loss_f64
from helpers.tiny_models import make_group, make_model


def _tiles(allowed, dtype=torch.bool, leading=(1, 1)) -> masks.MaskTiles:
    """MaskTiles over a mask given as `allowed(rows, cols) -> bool [n, m]` of positions."""

    def tile(row_start, rows, col_start, cols):
        r = torch.arange(row_start, row_start + rows)[:, None]
        c = torch.arange(col_start, col_start + cols)[None, :]
        ok = allowed(r, c)
        block = ok if dtype == torch.bool else torch.zeros(ok.shape, dtype=dtype).masked_fill(~ok, torch.finfo(dtype).min)
        return block.expand(*leading, rows, cols)

    return masks.MaskTiles(fx.symbolic_trace(tile))


CAUSAL = lambda r, c: c <= r  # noqa: E731
WINDOW = lambda r, c: (c <= r) & (c > r - 4)  # noqa: E731
SHIFTED = lambda r, c: c <= r - 1  # noqa: E731


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
@pytest.mark.parametrize("offset,length", [(0, 5), (7, 5), (13, 1)])
def test_causal_blocks_are_recognised_in_tiles(dtype, offset, length, monkeypatch):
    monkeypatch.setattr(masks, "CHECK_TILE_ROWS", 2)
    monkeypatch.setattr(masks, "CHECK_TILE_COLUMNS", 3)
    assert masks.MaskBlock(_tiles(CAUSAL, dtype), offset, length, ()).is_causal()
    assert masks.MaskBlock(_tiles(CAUSAL, dtype, leading=(3, 2)), offset, length, ()).is_causal()
    assert not masks.MaskBlock(_tiles(SHIFTED, dtype), offset, length, ()).is_causal()
    if offset + length > 4:
        assert not masks.MaskBlock(_tiles(WINDOW, dtype), offset, length, ()).is_causal()


def test_a_biased_float_mask_is_not_causal():
    """Finite nonzero values are a bias the fused causal kernels would drop."""

    def tile(row_start, rows, col_start, cols):
        r = torch.arange(row_start, row_start + rows)[:, None]
        c = torch.arange(col_start, col_start + cols)[None, :]
        return torch.where(c <= r, 0.5, torch.finfo(torch.float32).min)

    assert not masks.MaskBlock(masks.MaskTiles(fx.symbolic_trace(tile)), 3, 4, ()).is_causal()


def test_heads_that_disagree_are_not_causal():
    def tile(row_start, rows, col_start, cols):
        r = torch.arange(row_start, row_start + rows)[:, None]
        c = torch.arange(col_start, col_start + cols)[None, :]
        return torch.stack([c <= r, c <= r - 1])[None]

    assert not masks.MaskBlock(masks.MaskTiles(fx.symbolic_trace(tile)), 3, 4, ()).is_causal()


def test_the_answer_is_remembered_per_block(monkeypatch):
    """The mask reads no input, so a block checked once is never checked again."""
    monkeypatch.setattr(masks, "CHECK_TILE_ROWS", 2)
    tiles = _tiles(CAUSAL)
    calls = []
    tiles.tile.register_forward_hook(lambda module, args, out: calls.append(args[:4]))
    for _ in range(3):
        assert tiles(4, 5).is_causal()
    assert len(calls) == 3  # rows 4-5, 6-7, 8 once
    assert tiles(9, 5).is_causal()
    assert len(calls) == 6


def _padded_tiles(positions=CAUSAL) -> masks.MaskTiles:
    """MaskTiles of `positions` and-ed with a key mask `[rows, 1, 1, L]` read from the data, as HF's padded masks."""

    def tile(row_start, rows, col_start, cols, keys):
        r = torch.arange(row_start, row_start + rows)[:, None]
        c = torch.arange(col_start, col_start + cols)[None, :]
        return positions(r, c) & keys.narrow(-1, col_start, cols)

    return masks.MaskTiles(fx.symbolic_trace(tile), padding=0, rows=(0,))


def test_a_block_reads_its_key_mask_to_the_host_once(monkeypatch):
    """Every layer of a step asks the same block (and its rows' blocks) which
    form its mask has; the answers come from one host copy of the key mask
    per block, not a device sync per question, and they are the mask's."""
    copies = []
    original = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: copies.append(self.shape) or original(self, *a, **k))
    keys = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    block = _padded_tiles()(4, 4, keys[:, None, None, :])
    for _layer in range(4):
        assert not block.is_causal() and block.key_interval() is None  # the rows differ
        assert [block.row(j).key_interval() for j in range(3)] == [(2, 8), (2, 6), (2, 8)]
        assert block.row(0).first_key() == 2 and block.row(0).key_span() is None
        assert block.row(1).key_span() == (2, 6) and block.row(1).first_key() is None
        assert not block.row(0).is_causal()
    assert copies == [torch.Size([3, 1, 1, 8])]

    on = torch.ones(2, 1, 1, 8, dtype=torch.bool)
    assert _padded_tiles()(4, 4, on).is_causal() and _padded_tiles()(4, 4, on).row(1).is_causal()
    assert not _padded_tiles(WINDOW)(4, 4, on).is_causal()  # every key on, the positions part a window


def test_a_call_copies_its_key_mask_to_the_host_once(monkeypatch):
    """TRL's layout with prompt chunks of 2 and sorted branch steps of 2
    rows: every step's block (23 of them, forward and backward) reads its
    key mask from the one host copy the call made, cut to its rows and
    columns (a device sync a block before), with eager's loss and gradients."""
    from helpers.harness import assert_parity
    from helpers.padding import MODELS, padded_group, scored_grpo_loss

    copies = []
    original = masks._copied_to_host
    monkeypatch.setattr(masks, "_copied_to_host", lambda keys: copies.append(tuple(keys.shape)) or original(keys))
    groups = [padded_group(3, 6, 5, 1, [5, 2, 3], seed=1), padded_group(3, 6, 5, 0, [1, 4, 2], seed=2)]
    batch = tuple(torch.cat(parts) for parts in zip(*groups))
    backend = longstraw.Backend(prompt_grad="exact", verify_state=True, branch_rows=2, prefix_chunk_size=2)
    assert_parity(scored_grpo_loss, backend, None, MODELS["qwen3"](seed=0), *batch, 0.7, tol=2e-5)
    assert copies == [(6, 1, 1, 11)]


class _LargestBool(TorchDispatchMode):
    """The most elements of any boolean tensor an operator returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.bool:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("kind", ["plain_explicit_mask", "plain_window_mask"])
@pytest.mark.parametrize("mode", ["exact", "detached"])
def test_steps_never_build_their_mask_block(kind, mode, monkeypatch):
    """A causal mask is only ever computed a check tile at a time, a window
    mask (which the explicit softmax reads) a key block at a time: no boolean
    tensor exceeds one key block of scores (heads x 16 rows x 8 keys), where
    a 16-position chunk's mask block at P=64 is 16 x 64 before its heads.
    The backend's callable is run directly: under a dispatch mode Dynamo
    would run the model eagerly instead."""

    from longstraw.backend import CompiledGroupLoss

    monkeypatch.setattr(masks, "CHECK_TILE_ROWS", 4)
    monkeypatch.setattr(masks, "CHECK_TILE_COLUMNS", 8)
    monkeypatch.setattr(attention_kernels, "MATH_BLOCK_SCORES", 4 * 16 * 8)
    calls = []
    original = CompiledGroupLoss.__call__
    monkeypatch.setattr(CompiledGroupLoss, "__call__", lambda self, *a: calls.append((self, a)) or original(self, *a))
    model = make_model(kind)
    args = make_group(2, 64, 5)
    backend = longstraw.Backend(prompt_grad=mode, prefix_chunk_size=16, check_finite=False)  # a bool per state entry
    compiled_loss_and_grads(compile_loss(grpo_loss_f64, backend), model, *args)
    monkeypatch.setattr(masks.MaskTiles, "forward", lambda self, o, n, *v: masks.MaskBlock(masks.MaskTiles(self.tile), o, n, v))
    self, inputs = calls[-1]
    with _LargestBool() as seen:  # a fresh MaskTiles per step: every block is checked again
        (loss,) = original(self, *inputs)
        loss.backward()
    assert 0 < seen.largest <= attention_kernels.MATH_BLOCK_SCORES
