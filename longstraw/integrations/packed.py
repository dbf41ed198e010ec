"""Padding-free (packed) batches scored through LongStraw.

verl (`use_remove_padding=True`, its default) and padding-free trainers hand
the model one row `[1, N]` of concatenated `[prompt; completion]` sequences,
each with position ids restarting at 0 (or the `cu_seqlens` of their
boundaries). LongStraw's graphs take one sequence per row, so a packed
batch is scored by laying its sequences out as the padded batch TRL builds
(prompts left-padded, completions right-padded, each sequence at its own
positions from 0), scoring that with the compiled scorer, and scattering
the per-token results back to the packed positions:

    scorer = torch.compile(completion_logps_and_entropies, backend="longstraw", dynamic=True)
    logps, entropies = packed_logps_and_entropies(scorer, model, input_ids, position_ids, completion_mask)

Sequences with equal prompt parts form a group wherever they sit in the
row; each group's prompt is captured once and its completions replayed.
The packed results are differentiable, so a loss over them backpropagates
through LongStraw's backward. A sequence's prompt part is the tokens before
the first one `completion_mask` marks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from longstraw.errors import InputError


@dataclasses.dataclass(frozen=True)
class PaddedLayout:
    """The packed sequences as a padded batch, one per row in packing order."""

    input_ids: torch.Tensor  # [B, P + R]; prompts left-padded to P, completions right-padded to R
    attention_mask: torch.Tensor  # [B, P + R]; 1 on real tokens
    position_ids: torch.Tensor  # [B, P + R]; each sequence's own positions from 0
    logits_to_keep: int  # R


@dataclasses.dataclass(frozen=True)
class PackedSegments:
    """Where the sequences of a packed row are: the start, length and prompt
    length of each, in packing order."""

    starts: tuple[int, ...]
    lengths: tuple[int, ...]
    prompt_lengths: tuple[int, ...]

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor, completion_mask: torch.Tensor,
                          input_ids: torch.Tensor) -> PackedSegments:
        """Sequences start where the position ids restart at 0 and count up by
        one to their end; each sequence's prompt needs another sequence with
        the same prompt tokens. Refused, naming the sequence, otherwise."""
        positions = _row(position_ids, "position_ids").tolist()
        if not positions or positions[0] != 0:
            raise InputError(f"packed position ids must start at 0 (a sequence starts at position 0); they start at "
                             f"{positions[0] if positions else 'nothing'}")
        starts = [i for i, p in enumerate(positions) if p == 0]
        bounds = list(zip(starts, [*starts[1:], len(positions)]))
        for index, (start, stop) in enumerate(bounds):
            if positions[start:stop] != list(range(stop - start)):
                bad = next(i for i in range(start, stop) if positions[i] != i - start)
                raise InputError(
                    f"packed sequence {index} (tokens {start}..{stop - 1}) is not one sequence: its position ids do "
                    f"not count up by one from 0 (token {bad} has position {positions[bad]}, not {bad - start}). "
                    "Position ids must restart at 0 at each sequence and count every token of it."
                )
        return cls._with_prompts(bounds, completion_mask, input_ids)

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor, completion_mask: torch.Tensor,
                        input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> PackedSegments:
        """Sequences at the cumulative lengths `cu_seqlens` ([S + 1], from 0 to
        N), as flash-attention's varlen arguments give them. With
        `position_ids` too, both must name the same sequences."""
        cuts = _cuts(cu_seqlens, input_ids)
        if position_ids is not None:
            restarts = [i for i, p in enumerate(_row(position_ids, "position_ids").tolist()) if p == 0]
            if restarts != cuts[:-1]:
                raise InputError(f"cu_seqlens {cuts} and the position ids' restarts {restarts} name different "
                                 "sequences")
            cls.from_position_ids(position_ids, completion_mask, input_ids)  # and the position ids are whole
        return cls._with_prompts(list(zip(cuts, cuts[1:])), completion_mask, input_ids)

    @classmethod
    def from_prompt_lengths(cls, cu_seqlens: torch.Tensor, prompt_lengths: list[int],
                            input_ids: torch.Tensor) -> PackedSegments:
        """Sequences at `cu_seqlens` whose prompts are their first
        `prompt_lengths` tokens (verl's batches say how long each row's prompt is)."""
        cuts = _cuts(cu_seqlens, input_ids)
        bounds = list(zip(cuts, cuts[1:]))
        for index, ((start, stop), prompt) in enumerate(zip(bounds, prompt_lengths, strict=True)):
            if not 0 < prompt < stop - start:
                what = "no prompt token" if prompt <= 0 else "no completion token"
                raise InputError(f"packed sequence {index} (tokens {start}..{stop - 1}) has {what} (its prompt is "
                                 f"{prompt} of its {stop - start} tokens); each sequence is a prompt followed by its "
                                 "completion")
        return cls._shared(bounds, list(prompt_lengths), input_ids)

    @classmethod
    def _with_prompts(cls, bounds: list[tuple[int, int]], completion_mask: torch.Tensor,
                      input_ids: torch.Tensor) -> PackedSegments:
        scored = _row(completion_mask, "completion_mask").bool().tolist()
        prompts = []
        for index, (start, stop) in enumerate(bounds):
            first = next((i for i in range(start, stop) if scored[i]), None)
            if first is None or first == start:
                what = "no completion token" if first is None else "no prompt token (its first token is marked)"
                raise InputError(f"packed sequence {index} (tokens {start}..{stop - 1}) has {what} in completion_mask; "
                                 "each sequence is a prompt followed by its completion")
            prompts.append(first - start)
        return cls._shared(bounds, prompts, input_ids)

    @classmethod
    def _shared(cls, bounds: list[tuple[int, int]], prompts: list[int], input_ids: torch.Tensor) -> PackedSegments:
        """The segments, once every sequence's prompt is another's too (refused, naming it, otherwise)."""
        ids = _row(input_ids, "input_ids").tolist()
        shared: dict[tuple[int, ...], list[int]] = {}
        for index, ((start, _), prompt) in enumerate(zip(bounds, prompts)):
            shared.setdefault(tuple(ids[start:start + prompt]), []).append(index)
        for members in shared.values():
            if len(members) == 1:
                index = members[0]
                start, stop = bounds[index]
                raise InputError(
                    f"packed sequence {index} (tokens {start}..{stop - 1}) has a prompt ({prompts[index]} tokens) "
                    "that no other sequence of the batch shares: LongStraw captures each prompt once for the "
                    "completions that share it. Pack every prompt's completions into the same batch (GRPO's "
                    "group), or score this batch without LongStraw."
                )
        return cls(tuple(a for a, _ in bounds), tuple(b - a for a, b in bounds), tuple(prompts))

    @property
    def completion_lengths(self) -> tuple[int, ...]:
        return tuple(n - p for n, p in zip(self.lengths, self.prompt_lengths))

    def padded(self, input_ids: torch.Tensor) -> PaddedLayout:
        """The padded batch of these sequences, TRL's layout, each at its own positions."""
        ids = _row(input_ids, "input_ids")
        P, R = max(self.prompt_lengths), max(self.completion_lengths)
        B = len(self.starts)
        out = ids.new_zeros(B, P + R)
        mask = ids.new_zeros(B, P + R)
        positions = ids.new_zeros(B, P + R)
        for b, (start, prompt, completion) in enumerate(zip(self.starts, self.prompt_lengths, self.completion_lengths)):
            first = P - prompt
            out[b, first:P + completion] = ids[start:start + prompt + completion]
            mask[b, first:P + completion] = 1
            positions[b, first:] = torch.arange(P + R - first, device=ids.device)
        return PaddedLayout(out, mask, positions, R)

    def packed(self, per_token: torch.Tensor, shift: int = 0, fill: float = 0.0) -> torch.Tensor:
        """Completion values `[B, R]` of the padded batch at their packed
        positions `[1, N]`: the value of token t at t + `shift` (verl's
        model output puts the value predicting token t at t - 1), `fill`
        elsewhere. Differentiable."""
        R = per_token.shape[1]
        rows, dest = [], []
        for b, (start, prompt, completion) in enumerate(zip(self.starts, self.prompt_lengths, self.completion_lengths)):
            rows.extend(b * R + j for j in range(completion))
            dest.extend(range(start + prompt + shift, start + prompt + completion + shift))
        device = per_token.device
        values = per_token.reshape(-1)[torch.tensor(rows, device=device)]
        total = self.starts[-1] + self.lengths[-1]
        return per_token.new_full((total,), fill).index_put((torch.tensor(dest, device=device),), values)[None]


Scorer = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def packed_logps_and_entropies(
    scorer: Scorer, model: torch.nn.Module, input_ids: torch.Tensor, completion_mask: torch.Tensor,
    position_ids: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None, temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs and entropies `[1, N]` of a packed row's
    completion tokens (0 on prompt tokens), through `scorer`
    (`completion_logps_and_entropies`, compiled with `backend="longstraw"`)
    on the padded layout. The sequences come from `position_ids`, or
    `cu_seqlens` (checked against `position_ids` where both are given)."""
    if cu_seqlens is not None:
        segments = PackedSegments.from_cu_seqlens(cu_seqlens, completion_mask, input_ids, position_ids)
    elif position_ids is not None:
        segments = PackedSegments.from_position_ids(position_ids, completion_mask, input_ids)
    else:
        raise InputError("a packed row needs position_ids or cu_seqlens to tell its sequences apart")
    layout = segments.padded(input_ids)
    logps, entropies = scorer(model, layout.input_ids, layout.attention_mask, layout.logits_to_keep, temperature,
                              layout.position_ids)
    return segments.packed(logps), segments.packed(entropies)


def _cuts(cu_seqlens: torch.Tensor, input_ids: torch.Tensor) -> list[int]:
    """`cu_seqlens` as a list, checked to rise strictly from 0 to the packed length."""
    cuts = [int(c) for c in cu_seqlens.flatten().tolist()]
    total = _row(input_ids, "input_ids").numel()
    if not cuts or cuts[0] != 0 or cuts[-1] != total or any(b <= a for a, b in zip(cuts, cuts[1:])):
        raise InputError(f"cu_seqlens must rise strictly from 0 to the packed length {total}; got {cuts}")
    return cuts


def _row(value: Any, name: str) -> torch.Tensor:
    """A packed row `[1, N]` (or `[N]`) as `[N]`."""
    if not isinstance(value, torch.Tensor) or value.dim() not in (1, 2) or (value.dim() == 2 and value.shape[0] != 1):
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise InputError(f"{name} of a packed batch must be one row [1, N]; got {shape}")
    return value.reshape(-1)
