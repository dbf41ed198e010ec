"""Padding masks: HF's 2-D `attention_mask` (longstraw/analysis/mask_bands.py `key_padding_of`,
the partition's key masks, the runtime's checks).

A TRL-style group: every row the same prompt, left-padded to the batch's
longest (the pad positions zero in the mask), completions right-padded to
the longest of the group. HF builds `causal & attention_mask[batch, key]`
for SDPA (a left-padded query sees no key: SDPA gives it output 0) and, in
Qwen3.5's Gated DeltaNet layers, multiplies the hidden states by the mask.
Float64 parity against eager HF in both modes, chunk boundaries inside the
left padding and chunks of padding only, NaN-filled uninitialised memory;
masks that are not padding masks are refused naming the row, `.grad`
untouched.
"""

from __future__ import annotations

import pytest
import torch
from torch import fx

import longstraw
from longstraw.errors import InputError
from longstraw.models import qwen3_5
from longstraw.nodes import ancestors, tensor_of
from longstraw.runtime.kernels import attention_over_state as attention
from longstraw.runtime import mask_block as masks

from conftest import raises_longstraw
from helpers.compare import assert_close, assert_grads_close, grads_equal
from helpers.families import FAMILIES
from helpers.harness import compile_loss, compiled_loss_and_grads
from helpers.padding import MODELS, check_padding_parity, padded_group, trl_grpo_loss, trl_tail
from helpers.reference import eager_loss_and_grads, grads_of
from helpers.tiny_models import make_qwen3, make_qwen3_5

TOL = 1e-6  # HF norms and RoPE round through float32


def mask_positions_loss(model, prompt_ids, prompt_mask, completion_ids, completion_mask, advantages):
    """Position ids computed from the mask, as HF's `generate` does."""
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    return trl_tail(logits[:, prompt_ids.shape[1] - 1 : -1], completion_ids, completion_mask, advantages)


# (name, G, P, R, left padding, completion lengths, chunk)
GROUPS = {
    "all_ones": (3, 33, 6, 0, None, 8),
    "left": (3, 33, 6, 7, None, 8),
    "right": (3, 33, 6, 0, [6, 2, 4], 8),
    "both": (3, 33, 6, 7, [6, 1, 3], 8),
    # P - 1 = 40 prompt positions in chunks of 8: a boundary at 8 inside the padding
    # (13 positions), the first chunk padding only
    "chunked": (2, 41, 5, 13, [5, 3], 8),
    "long_padding": (2, 64, 4, 40, [4, 2], 16),  # chunks [0, 16), [16, 32) of padding only
}


def _group(name: str) -> tuple:
    G, P, R, left, lengths, _ = GROUPS[name]
    return padded_group(G, P, R, left, lengths, seed=P + left)


SLOW = pytest.mark.slow
# CI: each feature once per model kind (the hybrid only where its Gated DeltaNet masking matters); the rest slow
# (the all-ones mask runs in CI as the first call of `test_masks_are_data_not_plan_keys`)
EXACT = [("qwen3", "both"), ("qwen3_5", "both"),
         *[pytest.param(k, n, marks=SLOW) for k in ("qwen3", "qwen3_5") for n in GROUPS
           if (k, n) not in {("qwen3", "both"), ("qwen3_5", "both")}]]
DETACHED = [("qwen3", "both"), *[pytest.param(k, n, marks=SLOW) for k in ("qwen3", "qwen3_5") for n in GROUPS
                                  if (k, n) != ("qwen3", "both")]]


@pytest.mark.parametrize("kind,name", EXACT)
def test_padding_matches_eager_exact(kind, name):
    check_padding_parity(kind, "exact", _group(name), GROUPS[name][-1])


@pytest.mark.parametrize("kind,name", DETACHED)
def test_padding_matches_detached_reference(kind, name):
    check_padding_parity(kind, "detached", _group(name), GROUPS[name][-1])


@pytest.mark.parametrize("kind,mode", [  # CI: the chunked group exact on llama, detached on the hybrid (its exact
    # padding: test_padding_matches_eager_exact[qwen3_5-both]); `-m slow` the other two
    ("llama", "exact"), pytest.param("qwen3_5", "exact", marks=SLOW), ("qwen3_5", "detached"),
    pytest.param("llama", "detached", marks=SLOW),
])
def test_padding_with_nan_filled_memory(kind, mode):
    """The chunked group: a chunk of padding only, a boundary inside the padding."""
    check_padding_parity(kind, mode, _group("chunked"), 8, deterministic=True)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["exact", "detached"])
def test_cuda_matches_eager(mode):
    """Float64 on CUDA, the chunked group: the key masks and the first real
    key are made on the step's device."""
    check_padding_parity("qwen3", mode, _group("chunked"), 8, device="cuda")


@SLOW
@pytest.mark.parametrize("mode", ["exact", "detached"])
@pytest.mark.parametrize("kind", ["qwen3", "llama", "qwen3_5"])
@pytest.mark.parametrize("chunk", [3, 13, 128])
@pytest.mark.parametrize("left", [0, 1, 20, 62])
def test_padding_sweep(kind, mode, chunk, left):
    check_padding_parity(kind, mode, padded_group(4, 64, 7, left, [7, 1, 5, 3], seed=left), chunk, deterministic=True)


@pytest.mark.parametrize("kind", ["qwen3", pytest.param("qwen3_5", marks=SLOW)])
def test_a_batch_of_prompts_padded_to_the_longest(kind):
    """TRL's batch: two prompts left-padded to the longer one (5 and 0 pad
    positions), two completions each, rows interleaved: two groups, each
    captured with its own mask."""
    a = padded_group(2, 30, 6, 5, [6, 2], seed=1)
    b = padded_group(2, 30, 6, 0, [3, 6], seed=2)
    order = torch.tensor([0, 2, 1, 3])
    group = tuple(torch.cat([x, y])[order] for x, y in zip(a, b))
    backend = check_padding_parity(kind, "exact", group, 8)
    assert backend.plans[-1].runner.last_call.group_sizes == (2, 2)


@SLOW
@pytest.mark.parametrize("name", ["mistral", "gemma3", "qwen3_next", "deepseek_v3"])
def test_padding_in_other_families(name):
    """Sliding windows (Mistral, Gemma3's alternating layers) and MLA with a
    padding mask are not proved as such (`band_of` reads positions only):
    they run as full causal attention with the mask's tiles; Qwen3-Next's
    Gated DeltaNet is Qwen3.5's."""
    family = FAMILIES[name]
    model, group = family.build(), padded_group(3, 33, 6, 7, [6, 2, 4], seed=1)
    with family.bind():
        compiled = compile_loss(trl_grpo_loss, longstraw.Backend(prefix_chunk_size=8))
        got_loss, got = compiled_loss_and_grads(compiled, model, *group)
        want_loss, want = eager_loss_and_grads(trl_grpo_loss, model, *group)
    assert_close(got_loss, want_loss, TOL, "loss")
    assert_grads_close(got, want, TOL)


def test_masks_are_data_not_plan_keys():
    """One plan serves every padding of the same shapes: the mask is read at
    every call (never folded), and each call matches eager; new lengths
    (Dynamo's second graph has dynamic sizes) plan again, as without a mask."""
    model = make_qwen3()
    backend = longstraw.Backend(prefix_chunk_size=8)
    compiled = compile_loss(trl_grpo_loss, backend)
    calls = ((33, 0, None), (33, 9, [6, 2, 5]), (33, 3, [1, 1, 6]), (41, 3, [5, 6, 1]), (50, 20, [6, 3, 2]))
    for P, left, lengths in calls:
        group = padded_group(3, P, 6, left, lengths, seed=left)
        got_loss, got = compiled_loss_and_grads(compiled, model, *group)
        want_loss, want = eager_loss_and_grads(trl_grpo_loss, model, *group)
        assert_close(got_loss, want_loss, TOL, "loss")
        assert_grads_close(got, want, TOL)
    assert len(backend.plans) == 3


# --- bad inputs --------------------------------------------------------------


def _bad_masks() -> dict[str, tuple[tuple, str]]:
    """name -> (group, the message's pattern): every mask names its row."""
    out = {}
    prompt_ids, prompt_mask, *rest = padded_group(3, 20, 6, 4, [6, 3, 6])
    differs = prompt_mask.clone()
    differs[2, 3] = 1
    out["rows differ in the prompt"] = ((prompt_ids, differs, *rest), r"row 2 shares no prompt with any other row.* "
                                        r"the padding mask from `prompt_mask` and `completion_mask`")
    hole = prompt_mask.clone()
    hole[:, 9] = 0
    out["a hole inside the prompt"] = ((prompt_ids, hole, *rest), r"row 0 .* hole inside the prompt: position 9 ")
    right = torch.ones_like(prompt_mask)
    right[:, 15:] = 0  # the prompt padded on the right: its completion starts before the prompt ends
    out["a prompt padded on the right"] = ((prompt_ids, right, *rest), r"row 0 .* hole inside the prompt: position 15 ")
    completion_ids, completion_mask, advantages = rest
    gap = completion_mask.clone()
    gap[1, 4] = 1
    out["a one after zeros in a completion"] = ((prompt_ids, prompt_mask, completion_ids, gap, advantages),
                                                r"row 1 .* marks position 24 real after padding at position 23")
    return out


def _assert_refused(compiled, model, group: tuple, match: str) -> None:
    """The compiled loss raises `match`; `.grad` stays as it was."""
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    before = grads_of(model)
    with pytest.raises(InputError, match=match):
        compiled(model, *group).backward()
    assert grads_equal(grads_of(model), before)


def test_masks_that_are_not_padding_masks_are_refused_naming_the_row():
    model = make_qwen3()
    compiled = compile_loss(trl_grpo_loss, longstraw.Backend(prefix_chunk_size=8))
    for group, match in _bad_masks().values():
        _assert_refused(compiled, model, group, match)
    group = padded_group(3, 20, 6, 4, [6, 3, 6])
    assert torch.isfinite(compiled(model, *group))  # the same plan still runs a padding mask


def test_hybrid_prompt_padding_that_differs_between_rows_is_refused():
    """Qwen3.5 also multiplies its Gated DeltaNet inputs by the mask (a root
    the steps slice): a row padded unlike the rest is a prompt of its own."""
    group, match = _bad_masks()["rows differ in the prompt"]
    with qwen3_5.bound():
        compiled = compile_loss(trl_grpo_loss, longstraw.Backend(prefix_chunk_size=8))
        _assert_refused(compiled, make_qwen3_5(), group, match)


def test_positions_from_the_mask_are_refused_with_the_fix():
    model = make_qwen3()
    with raises_longstraw(r"operator `cumsum` .* mixes values across sequence positions.*position ids from the "
                          r"attention mask.*pass them in as a \[G, L\] input"):
        compile_loss(mask_positions_loss, longstraw.Backend(prefix_chunk_size=8))(model, *padded_group(2, 20, 5, 3))


def positions_input_loss(model, prompt_ids, prompt_mask, completion_ids, completion_mask, advantages, position_ids):
    """The fix the refusal names: position ids from the mask, computed outside."""
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    return trl_tail(logits[:, prompt_ids.shape[1] - 1 : -1], completion_ids, completion_mask, advantages)


@pytest.mark.parametrize("kind", ["qwen3", pytest.param("qwen3_5", marks=SLOW)])
def test_positions_from_the_mask_passed_in(kind):
    model = MODELS[kind]()
    group = padded_group(3, 33, 6, 7, [6, 2, 4], seed=1)
    position_ids = (torch.cat([group[1], group[3]], 1).cumsum(-1) - 1).clamp(min=0)
    with qwen3_5.bound():
        compiled = compile_loss(positions_input_loss, longstraw.Backend(prefix_chunk_size=8))
        got_loss, got = compiled_loss_and_grads(compiled, model, *group, position_ids)
        want_loss, want = eager_loss_and_grads(positions_input_loss, model, *group, position_ids)
    assert_close(got_loss, want_loss, TOL, "loss")
    assert_grads_close(got, want, TOL)


def test_a_mask_reading_inputs_otherwise_is_refused():
    """A key mask per query (not broadcast over queries) is not a padding mask."""

    def loss(model, prompt_ids, prompt_mask, completion_ids, completion_mask, advantages):
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1).bool()
        L = input_ids.shape[1]
        causal = torch.ones(L, L, dtype=torch.bool).tril()
        both = causal & attention_mask[:, None, :, None] & attention_mask[:, None, None, :]
        logits = model(input_ids=input_ids, attention_mask=both).logits[:, prompt_ids.shape[1] - 1 : -1]
        return trl_tail(logits, completion_ids, completion_mask, advantages)

    with raises_longstraw(r"attn_mask depends on inputs \(`prompt_mask`, `completion_mask`\) other than through a "
                          r"key padding mask"):
        compile_loss(loss, longstraw.Backend(prefix_chunk_size=8))(make_qwen3(), *padded_group(2, 20, 5, 3))


def test_packed_rows_are_refused_naming_the_position_ids():
    """Two sequences packed in one row, position ids restarting at the
    second (verl's remove_padding, HF's padding-free layout): HF masks each
    sequence from the other with a mask built from the position ids. The
    refusal names that input and says to pass one padded sequence per row."""
    model = make_qwen3()
    model.config.use_cache = False  # with a cache HF skips the packed-sequence mask (eager then mixes the two)
    prompt = torch.randint(0, 64, (6,))
    ids = torch.cat([prompt, torch.randint(0, 64, (3,)), prompt, torch.randint(0, 64, (4,))])[None]
    position_ids = torch.cat([torch.arange(9), torch.arange(10)])[None]
    scored = torch.zeros_like(ids, dtype=torch.bool)
    scored[0, 6:9] = scored[0, 15:] = True

    def loss(model, ids, position_ids, scored):
        logits = model(input_ids=ids, position_ids=position_ids).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        weight = scored[:, 1:].float()
        return -(logp * weight).sum() / weight.sum()

    with raises_longstraw(r"depends on inputs \(`position_ids`\).*packed, padding-free sequences.*"
                          r"pass one sequence per row"):
        compile_loss(loss, longstraw.Backend(prefix_chunk_size=8))(model, ids, position_ids, scored)
    assert all(p.grad is None for p in model.parameters())


# --- the key mask in the step's mask block -----------------------------------


def test_a_padded_block_is_never_remembered_as_causal():
    """The positions part's answer is remembered per block; the key mask is
    data, so a block with a key off is not causal and that is not kept."""

    def tile(row_start, rows, col_start, cols, keys):
        r = torch.arange(row_start, row_start + rows)[:, None]
        c = torch.arange(col_start, col_start + cols)[None, :]
        return (c <= r) & keys.narrow(-1, col_start, cols)

    tiles = masks.MaskTiles(fx.symbolic_trace(tile), padding=0)
    on = torch.ones(1, 12, dtype=torch.bool)
    off = on.clone()
    off[0, :3] = False
    assert not tiles(4, 5, off).is_causal()
    assert tiles.causal == {}
    assert tiles(4, 5, on).is_causal()
    assert tiles.causal == {(4, 5): True}
    assert not tiles(4, 5, off).is_causal()
    assert tiles(9, 3, off).is_causal() is False
    off_later = on.clone()
    off_later[0, 11] = False  # a key after the block's visible columns [0, 9)
    assert tiles(4, 5, off_later).is_causal()


@pytest.mark.parametrize("mode", ["exact", pytest.param("detached", marks=SLOW)])
def test_left_padding_runs_causal_over_the_keys_after_it(monkeypatch, mode):
    """Left padding never costs the explicit mask: a block whose queries all
    follow it is causal attention over the keys from its end (prompt chunks
    after the padding, full-length branches); the chunk that ends it runs
    its padding rows as zeros and the rest causal over the keys from its
    end; a chunk of padding only is zeros. So on a GPU every prompt chunk
    runs the fused kernels. Gradients are eager's, with NaN-filled memory."""
    found, ends, kernels = [], [], []
    first_key, padding_end, kernel_for = masks.MaskBlock.first_key, masks.MaskBlock.padding_end, attention.kernel_for

    def recording(block: masks.MaskBlock) -> int | None:
        found.append((block.offset, first_key(block)))
        return found[-1][1]

    def recording_end(block: masks.MaskBlock) -> int | None:
        ends.append((block.offset, padding_end(block)))
        return ends[-1][1]

    def recording_kernel(q, mask):
        kernels.append(mask is None)
        return kernel_for(q, mask)

    monkeypatch.setattr(masks.MaskBlock, "first_key", recording)
    monkeypatch.setattr(masks.MaskBlock, "padding_end", recording_end)
    monkeypatch.setattr(attention, "kernel_for", recording_kernel)
    check_padding_parity("qwen3", mode, padded_group(2, 41, 5, 13, [5, 3]), 8)
    assert {f for _, f in found} == {None, 13}
    # the prompt chunks after the padding
    assert all(first == 13 for offset, first in found if 16 <= offset < 40)
    # [0, 8) is padding only, [8, 16) ends it at 13
    assert {(offset, end) for offset, end in ends if offset < 13} == {(0, 8), (8, 13)}
    assert kernels and all(kernels)


# CI: exact (the spans and kernels are the forward's, the same in both modes; detached right padding's parity:
# test_padding_matches_detached_reference[qwen3-both]); `-m slow` detached
@pytest.mark.parametrize("mode", ["exact", pytest.param("detached", marks=SLOW)])
def test_right_padded_completions_run_without_the_mask(monkeypatch, mode):
    """A completion right-padded from `last` on: its real rows are causal
    over the keys after the left padding, its padded rows see all of
    `[first, last)`; both run the kernels without a mask (here the explicit
    softmax, on the CPU, with `mask=None`), and the gradients are eager's."""
    spans, kernels = [], []
    key_span, kernel_for = masks.MaskBlock.key_span, attention.kernel_for

    def recording_span(block: masks.MaskBlock) -> tuple[int, int] | None:
        spans.append((block.offset, block.length, key_span(block)))
        return spans[-1][2]

    def recording_kernel(q, mask):
        kernels.append((q.shape[-2], mask is None))
        return kernel_for(q, mask)

    monkeypatch.setattr(masks.MaskBlock, "key_span", recording_span)
    monkeypatch.setattr(attention, "kernel_for", recording_kernel)
    check_padding_parity("qwen3", mode, padded_group(3, 41, 6, 13, [6, 3, 1]), 8)
    # the branches run [40, 47) (the prompt's last position, then the completion): completions of
    # 3 and 1 tokens are right-padded from 44 and 42; the full one is causal over [13, 47)
    assert {span for offset, _, span in spans if offset == 40} == {(13, 44), (13, 42)}
    branch_calls = [(n, unmasked) for n, unmasked in kernels if n < 8]  # prompt chunks have 8 rows
    assert all(unmasked for _, unmasked in branch_calls)
    assert {n for n, _ in branch_calls} == {7, 4, 3, 2, 5}  # the full branch; real and padded parts


def test_the_key_mask_is_found_in_hf_mask():
    """HF's sdpa mask from a 2-D attention_mask splits into the causal part
    and `attention_mask[batch, key]`, broadcast over queries, one for every
    layer, read from the two mask inputs and imported by the steps."""
    from longstraw.codegen.graphs import step_imports
    from longstraw.errors import argument_name

    backend = longstraw.Backend(prefix_chunk_size=8)
    compiled_loss_and_grads(compile_loss(trl_grpo_loss, backend), make_qwen3(), *padded_group(2, 10, 4, 2))
    part = backend.plans[-1].partition
    (padding,) = part.key_padding
    assert tuple(tensor_of(padding).shape) == (2, 1, 1, 14) and tensor_of(padding).dtype == torch.bool
    inputs = {argument_name(n) for n in ancestors([padding]) if n.op == "placeholder"}
    assert inputs == {"prompt_mask", "completion_mask"}
    assert padding in step_imports(part) and padding not in part.sequence | part.positional
