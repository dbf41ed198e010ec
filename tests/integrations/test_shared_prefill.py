"""HF `generate` with each distinct prompt prefilled once
(`integrations/shared_prefill.py`): the same scores and tokens as HF's own
`generate` over the repeated, left-padded batch (float64), one prefill per
distinct prompt, and HF's own path wherever the cache cannot be laid out."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import GenerationConfig

from longstraw.integrations.shared_prefill import generate_with_shared_prefill, shared_prefill

from helpers.families import FAMILIES, SUPPORTED
from helpers.tiny_models import VOCAB, make_lora_qwen3, make_mistral, make_qwen3, make_qwen3_5

PAD = 0
LOGGER = "longstraw.integrations.shared_prefill"


def repeated_prompts(G: int = 3, pad: int = 3, vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts, the second left-padded by `pad`, each repeated G times, the rows interleaved as a shuffle could leave them."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (2, 9), generator=gen)  # [2, P]
    mask = torch.ones_like(ids)
    ids[1, :pad], mask[1, :pad] = PAD, 0
    order = torch.tensor([0, 1] * G)
    return ids[order], mask[order]


def config(sample: bool) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=6, do_sample=sample, pad_token_id=PAD, eos_token_id=None,
                            output_scores=True, return_dict_in_generate=True)


def prefills(model: torch.nn.Module) -> list[int]:
    """The input lengths of every forward `generate` is not running (hooked on the decoder)."""
    seen: list[int] = []
    decoder = model.get_base_model().model if hasattr(model, "get_base_model") else model.model
    decoder.register_forward_pre_hook(lambda _, args, kwargs: seen.append(kwargs["input_ids"].shape), with_kwargs=True)
    return seen


# Qwen3.5's HF layers run the gated delta rule in float32 over 64-position chunks, whose boundaries fall
# elsewhere in an unpadded prompt: rounding of 1e-6; a state 10% off moves the scores by 5e-2
@pytest.mark.parametrize("make, tol", [(make_qwen3, 1e-9), (make_lora_qwen3, 1e-9), (make_qwen3_5, 1e-5)],
                         ids=["qwen3", "lora", "qwen3_5"])
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_shared_prefill_generates_what_generate_does(sample, make, tol):
    model = make().eval()
    ids, mask = repeated_prompts()
    torch.manual_seed(5)
    want = model.generate(input_ids=ids, attention_mask=mask, generation_config=config(sample))
    shapes = prefills(model)
    torch.manual_seed(5)
    got = generate_with_shared_prefill(model, model.generate, ids, mask, generation_config=config(sample))
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.scores, want.scores):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    # one prefill per distinct prompt, without its padding and its last token, then generate's steps of one token
    assert sorted(s for s in shapes if s[0] == 1) == [torch.Size([1, 5]), torch.Size([1, 8])]
    assert [tuple(s) for s in shapes if s[0] != 1] == [(6, 1)] * 6


def test_a_hybrid_prompt_shorter_than_the_convolution_window():
    """3 real tokens: the prefill of 2 is padded to Qwen3.5's kernel of 4 as
    the padded batch's zeroed padding is."""
    model = make_qwen3_5().eval()
    ids, mask = repeated_prompts(G=2, pad=6)
    want = model.generate(input_ids=ids, attention_mask=mask, generation_config=config(False))
    got = generate_with_shared_prefill(model, model.generate, ids, mask, generation_config=config(False))
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.scores, want.scores):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_batch_without_repeats_runs_generate_unchanged(caplog):
    model = make_qwen3().eval()
    ids, mask = repeated_prompts(G=1)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        got = generate_with_shared_prefill(model, model.generate, ids, mask, generation_config=config(False))
    assert "no prompt repeats" in caplog.text
    want = model.generate(input_ids=ids, attention_mask=mask, generation_config=config(False))
    assert torch.equal(got.sequences, want.sequences)


def test_a_cache_it_cannot_lay_out_runs_generate_unchanged(caplog):
    model = make_mistral(window=4).eval()
    ids, mask = repeated_prompts()
    shapes = prefills(model)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        got = generate_with_shared_prefill(model, model.generate, ids, mask, generation_config=config(False))
    assert "DynamicSlidingWindowLayer" in caplog.text
    assert tuple(shapes[0]) == tuple(ids.shape)  # HF's prefill of every row
    want = model.generate(input_ids=ids, attention_mask=mask, generation_config=config(False))
    assert torch.equal(got.sequences, want.sequences)


def test_right_padded_prompts_run_generate_unchanged(caplog):
    model = make_qwen3().eval()
    ids, mask = repeated_prompts()
    ids, mask = ids.flip(1), mask.flip(1)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        generate_with_shared_prefill(model, model.generate, ids, mask, generation_config=config(False))
    assert "not left-padded" in caplog.text


def test_shared_prefill_patches_generate_only_within():
    model = make_qwen3().eval()
    ids, mask = repeated_prompts()
    want = model.generate(input_ids=ids, attention_mask=mask, generation_config=config(False))
    shapes = prefills(model)
    with shared_prefill(model):
        got = model.generate(input_ids=ids, attention_mask=mask, generation_config=config(False))
    assert "generate" not in vars(model)
    assert torch.equal(got.sequences, want.sequences)
    assert sum(s[0] == 1 for s in shapes) == 2


def test_a_model_that_generates_without_a_cache_runs_generate_unchanged(caplog):
    model = make_qwen3().eval()
    model.generation_config.use_cache = False
    ids, mask = repeated_prompts()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        generate_with_shared_prefill(model, model.generate, ids, mask, generation_config=config(False))
    assert "use_cache=False" in caplog.text


@pytest.mark.parametrize("name, reason", [
    ("minimax", "MiniMaxForCausalLM keeps a cache of its own class, not a DynamicCache"),
    ("mamba2", "Mamba2ForCausalLM.forward takes no past_key_values"),  # its cache is `cache_params`
])
def test_a_model_with_a_cache_of_its_own_runs_generate_unchanged(name, reason, caplog):
    """Handing these models a `DynamicCache` raises (MiniMax) or is refused
    by `generate` (Mamba's unused `past_key_values`): they run HF's own path."""
    model = FAMILIES[name].build().eval()
    ids, mask = repeated_prompts(G=2, pad=2, vocab=min(model.config.vocab_size, VOCAB))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        got = generate_with_shared_prefill(model, model.generate, ids, mask, generation_config=config(False))
    assert reason in caplog.text
    want = model.generate(input_ids=ids, attention_mask=mask, generation_config=config(False))
    assert torch.equal(got.sequences, want.sequences)


@pytest.mark.slow
@pytest.mark.parametrize("name", [f.name for f in SUPPORTED])
def test_every_supported_family_generates_what_generate_does(name):
    """Shared or not (the fallbacks above), the tokens are HF's, greedy, float64."""
    family = FAMILIES[name]
    with family.bind():
        model = family.build().eval()
        ids, mask = repeated_prompts(G=2, pad=2, vocab=min(model.config.vocab_size, VOCAB))
        want = model.generate(input_ids=ids, attention_mask=mask, generation_config=config(False))
        got = generate_with_shared_prefill(model, model.generate, ids, mask, generation_config=config(False))
    assert torch.equal(got.sequences, want.sequences)
