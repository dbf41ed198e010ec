"""Attention masks computed from positions, tile by tile, at run time.

HF builds an explicit `[..., L, L]` mask whenever it is traced (on CUDA,
always). A step with queries at `[o, o+n)` needs the mask's block over the
visible columns `[0, o+n)`, which at a 1M-token prompt and 8K-token chunks
is 8 GiB. The step graph therefore never builds that block: it computes the
mask's row and column vectors (O(L)) and hands them to `MaskTiles`, a
generated graph that computes any `rows x columns` tile from them. The
attention step asks the resulting `MaskBlock` whether it is plain causal
(then it runs the fused kernels and reads no mask at all) or, for any other
mask, for the columns of one key block at a time.
"""

from __future__ import annotations

import functools

import torch
from torch import fx

from longstraw.runtime.prompt_state import has_values

CHECK_TILE_ROWS = 1024


CHECK_TILE_COLUMNS = 65536


HOST_COPY = "_longstraw_host_copy"
"""The attribute of a key mask (and of its rows, `call_state.rows_of`) that
holds its host copy, made once per call (`attach_host_copy`): a step's
block reads its visible columns from it instead of copying them (a device
sync per block: 16 steps of sorted rows a call made 16)."""


def attach_host_copy(keys: torch.Tensor) -> None:
    """Copy `keys` (a key mask the outer graph computed) to the host once, for every block of the call."""
    setattr(keys, HOST_COPY, _copied_to_host(keys))


def _copied_to_host(keys: torch.Tensor) -> torch.Tensor:
    return keys.detach().cpu()  # a tensor of its own on the CPU too, without the attribute


class MaskTiles(torch.nn.Module):
    """Computes tiles of one mask. `tile` is a generated graph:
    `tile(row_start, rows, column_start, columns, *vectors)` -> the mask's
    `[..., rows, columns]` tile. Also remembers which step blocks were found
    causal: the positions-only part reads no input, so the answer for a
    block `(o, n)` never changes, and later calls skip the check.
    `padding`: the index among the vectors of the key mask read from an
    input (`key_padding_of`), if any; it is data, so a block is causal only
    while every visible key is on, and only such answers are remembered."""

    def __init__(self, tile: fx.GraphModule, padding: int | None = None, rows: tuple[int | None, ...] = ()) -> None:
        super().__init__()
        self.tile = tile
        self.padding = padding
        self.rows = rows  # each vector's group dimension (None: shared by the rows), for `MaskBlock.row`
        self.causal: dict[tuple[int, int], bool] = {}

    def forward(self, offset: int, length: int, *vectors: torch.Tensor) -> MaskBlock:
        return MaskBlock(self, offset, length, vectors)


class MaskBlock:
    """The mask's rows `[offset, offset+length)` over the visible columns
    `[0, offset+length)`, computed only where asked for."""

    def __init__(self, tiles: MaskTiles, offset: int, length: int, vectors: tuple[torch.Tensor, ...],
                 host_padding: torch.Tensor | None = None) -> None:
        self.tiles, self.offset, self.length, self.vectors = tiles, offset, length, vectors
        self._rows: dict[int, MaskBlock] = {}
        if host_padding is not None:
            self._host_padding = host_padding  # a row's block: its part of the block's host copy

    def row(self, j: int) -> MaskBlock:
        """The block of the step's branch row `j` (`StepContext.rows`): its
        vectors cut to that row (kept, since every layer asks)."""
        if j not in self._rows:
            cut = lambda v, d: v if d is None or v.shape[d] == 1 else v.narrow(d, j, 1)  # noqa: E731
            vectors = tuple(cut(v, d) for v, d in zip(self.vectors, self.tiles.rows, strict=True))
            host = self._host_padding
            host = None if host is None else cut(host, self.tiles.rows[self.tiles.padding])
            self._rows[j] = MaskBlock(self.tiles, self.offset, self.length, vectors, host)
        return self._rows[j]

    def columns(self, start: int, count: int, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The block's `[..., n, count]` tile of columns `[start, start+count)`
        (`rows`: a local `(first, count)` range of the block's rows instead of all)."""
        first, n = rows if rows is not None else (0, self.length)
        with torch.no_grad():
            return self.tiles.tile(self.offset + first, n, start, count, *self.vectors)

    def is_causal(self) -> bool:
        """Whether the block is plain lower-right causal, so a fused causal
        kernel computes the same attention without reading it. A float mask
        counts when it is 0 where causal allows and at most half the dtype's
        minimum elsewhere; leading dimensions (batch, heads) must agree.
        Checked once per block in tiles of CHECK_TILE_ROWS x
        CHECK_TILE_COLUMNS. Meta and fake tensors (`longstraw.explain`) have
        no values: their mask is taken to be causal, as HF's is. Remembered
        per block: every attention layer of a step asks."""
        return self._causal

    @functools.cached_property
    def _causal(self) -> bool:
        keys = self._host_keys
        if keys is not None and not bool(keys.all()):
            return False
        return self._positions_causal()

    def first_key(self) -> int | None:
        """`a` when the block is causal attention over the keys `[a, o+n)`
        alone: its key mask off before `a` and on from there (left
        padding), every query at or after `a`, the positions-only part
        causal. Then a fused causal kernel over those keys computes it.
        None otherwise (no key mask, or another pattern)."""
        keys = self.key_interval()
        if keys is None or not 0 < keys[0] <= self.offset or keys[1] != self.offset + self.length:
            return None
        return keys[0]

    def padding_end(self) -> int | None:
        """`a` when the left padding ends inside the block's rows: the key
        mask off before `a` and on from there to the block's end, with
        `o < a <= o+n`, the positions-only part causal. Then the rows before
        `a` see no key (their output is zero, as SDPA's) and the rest are
        causal attention over the keys `[a, o+n)`, which a fused causal
        kernel computes. None otherwise."""
        keys = self.key_interval()
        end = self.offset + self.length
        if keys is None or not self.offset < keys[0] <= end or keys[1] != end:
            return None
        return keys[0]

    def key_span(self) -> tuple[int, int] | None:
        """`(a, b)` when the key mask is on exactly over `[a, b)` with
        `a <= o < b < o+n` (left padding before the block's rows, right
        padding inside them: a padded completion) and the positions-only part
        is causal. Then the rows before `b` are causal attention over the
        keys `[a, row]` and the rows from `b` on see all of `[a, b)`. None
        otherwise."""
        keys = self.key_interval()
        if keys is None or not keys[0] <= self.offset < keys[1] < self.offset + self.length:
            return None
        return keys

    def key_interval(self) -> tuple[int, int] | None:
        """`(a, b)` when the key mask is on exactly over `[a, b)` of the
        visible columns, the same for every row, and the positions-only
        part is causal: causal attention over the keys `[a, b)` alone (a
        query before `a` sees nothing, one at or after `b` sees all of
        them). `first_key` and `key_span` are its cases the one-process
        steps run with fused kernels; context parallelism runs all of it.
        None without a key mask, or for another pattern. Read off the
        block's host copy of its key mask (`_host_keys`), remembered: every
        attention layer of a step asks of the same block."""
        return self._interval

    @functools.cached_property
    def _interval(self) -> tuple[int, int] | None:
        keys = self._host_keys
        if keys is None or keys.shape[0] != 1 and not bool((keys == keys[:1]).all()):
            return None
        line = keys[0]
        first = int(line.logical_not().cumprod(0).sum())
        last = first + int(line[first:].cumprod(0).sum())
        if bool(line[last:].any()):
            return None
        return (first, last) if self._positions_causal() else None

    @property
    def _host_keys(self) -> torch.Tensor | None:
        """The key mask over the visible columns, `[rows, o+n]`, on the host."""
        host = self._host_padding
        return None if host is None else host.reshape(-1, host.shape[-1])

    @functools.cached_property
    def _host_padding(self) -> torch.Tensor | None:
        """The key mask vector over the visible columns, on the host, when
        there is one with values: one copy (and one device sync) per block,
        its rows' blocks sharing it (`row`), where reading the device's copy
        cost a sync per question and layer."""
        if self.tiles.padding is None:
            return None
        keys = self.vectors[self.tiles.padding]
        if not has_values(keys):
            return None
        host = getattr(keys, HOST_COPY, None)
        if host is None or host.shape != keys.shape:
            return _copied_to_host(keys.narrow(-1, 0, self.offset + self.length))
        return host.narrow(-1, 0, self.offset + self.length)

    def _positions_causal(self) -> bool:
        """`is_causal` of the block with every key on: it reads no input, so it is remembered."""
        key = (self.offset, self.length)
        if key not in self.tiles.causal:
            vectors = list(self.vectors)
            if self.tiles.padding is not None:
                vectors[self.tiles.padding] = torch.ones_like(vectors[self.tiles.padding])
            answer = MaskBlock(self.tiles, self.offset, self.length, tuple(vectors))._check()
            if answer is None:
                return True
            self.tiles.causal[key] = answer
        return self.tiles.causal[key]

    def _check(self) -> bool | None:
        visible = self.offset + self.length
        for first in range(0, self.length, CHECK_TILE_ROWS):
            n = min(CHECK_TILE_ROWS, self.length - first)
            row0 = self.offset + first
            for start in range(0, visible, CHECK_TILE_COLUMNS):
                count = min(CHECK_TILE_COLUMNS, visible - start)
                tile = self.columns(start, count, rows=(first, n))
                if not has_values(tile):
                    return None
                if not _is_causal_tile(tile, row0, start):
                    return False
        return True


def _is_causal_tile(tile: torch.Tensor, row0: int, col0: int) -> bool:
    """Whether `tile` (rows from position `row0`, columns from `col0`) allows
    exactly the columns at or before each row."""
    if tile.dim() > 2 and any(s != 1 for s in tile.shape[:-2]):
        flat = tile.flatten(0, -3)
        if not bool((flat == flat[:1]).all()):
            return False
    tile = tile.reshape(-1, *tile.shape[-2:])[0]
    n, m = tile.shape
    allowed = tile if tile.dtype == torch.bool else tile == 0
    if tile.dtype != torch.bool and not bool(((tile == 0) | (tile <= torch.finfo(tile.dtype).min / 2)).all()):
        return False
    if col0 + m - 1 <= row0:  # every column is at or before every row
        return bool(allowed.all())
    causal = torch.ones(n, m, dtype=torch.bool, device=tile.device).tril(row0 - col0)
    return torch.equal(allowed, causal)
