"""Unsupported inputs fail with a clear LongStrawError and leave .grad alone.

Each test snapshots .grad (a non-zero tensor on some parameters, None on the
others), runs the compiled loss and its backward inside the expected error,
and checks the snapshot bit for bit.
"""

from __future__ import annotations

import inspect
import re

import pytest
import torch

import longstraw

from conftest import raises_longstraw
from helpers import plain_transformer
from helpers.compare import assert_grads_close, grads_equal
from helpers.harness import compile_loss, compiled_loss_and_grads
from helpers.losses import grpo_loss_f64, per_group_prefix_loss, responses_only_loss
from helpers.plain_transformer import make_plain
from helpers.reference import eager_loss_and_grads, grads_of, seed_grads
from helpers.tiny_models import make_group, make_model


def run_and_backward(compiled, model, *args):
    compiled(model, *args).backward()


@pytest.mark.parametrize("kind", ["plain", "qwen3"])
def test_no_shared_prefix_responses_only(kind):
    model = make_model(kind)
    before = seed_grads(model)
    compiled = compile_loss(responses_only_loss, longstraw.Backend(prefix_chunk_size=5))
    with raises_longstraw(r"(?i)prefix|prompt"):
        run_and_backward(compiled, model, *make_group(3, 7, 9))
    assert grads_equal(grads_of(model), before)


def test_no_shared_prefix_per_group_prompts():
    """A [G, P] first part with different rows is per-group data."""
    model = make_model("plain")
    prompt, responses, advantages, mask = make_group(3, 7, 9)
    prompts = torch.stack([prompt, prompt.roll(1), prompt.flip(0)])  # [3, 7], rows differ
    assert not torch.equal(prompts[0], prompts[1])
    before = seed_grads(model)
    compiled = compile_loss(per_group_prefix_loss, longstraw.Backend(prefix_chunk_size=5))
    with raises_longstraw(r"(?i)prefix|prompt"):
        run_and_backward(compiled, model, prompts, responses, advantages, mask)
    assert grads_equal(grads_of(model), before)


def _cumsum_line() -> int:
    lines, start = inspect.getsourcelines(plain_transformer.CumsumMixer.forward)
    (offset,) = [i for i, line in enumerate(lines) if "torch.cumsum(" in line]
    return start + offset


@pytest.mark.parametrize("explicit_option", [False, True])
def test_unsupported_position_mixing_op(explicit_option):
    """`torch.cumsum` over the sequence: the message names the operator, the
    module path (blocks.<i>.mixer in some spelling) and the source file:line."""
    model = make_plain(mixer="cumsum")
    before = seed_grads(model)
    options = {"prefix_chunk_size": 5}
    if explicit_option:
        options["on_unsupported"] = "error"  # the default, spelled out
    compiled = compile_loss(grpo_loss_f64, longstraw.Backend(**options))
    with raises_longstraw(r"cumsum") as info:
        run_and_backward(compiled, model, *make_group(3, 7, 9))
    message = str(info.value)
    assert re.search(r"blocks.{0,3}\d.{0,3}mixer", message), message
    assert re.search(rf"plain_transformer\.py:{_cumsum_line()}\b", message), message
    assert grads_equal(grads_of(model), before)


def test_mismatched_group_sizes():
    """responses G=3, advantages G=2: eager fails too. Dynamo sees the
    broadcast error while tracing, before the backend gets a graph, so any
    exception is accepted; .grad must be untouched."""
    model = make_model("plain")
    prompt, responses, _, mask = make_group(3, 7, 9)
    advantages = torch.randn(2, dtype=torch.float64)
    with pytest.raises(RuntimeError):
        grpo_loss_f64(model, prompt, responses, advantages, mask)
    model.zero_grad(set_to_none=True)
    before = seed_grads(model)
    compiled = compile_loss(grpo_loss_f64, longstraw.Backend(prefix_chunk_size=5))
    with pytest.raises(RuntimeError, match=r"broadcast a dimension of length 2"):
        run_and_backward(compiled, model, prompt, responses, advantages, mask)
    assert grads_equal(grads_of(model), before)


@pytest.mark.parametrize("kind", ["plain", "qwen3"])
def test_empty_responses(kind):
    """R = 0: eager returns 0/0 = NaN without complaint; the backend refuses."""
    model = make_model(kind)
    prompt, _, advantages, _ = make_group(3, 7, 1)
    responses = torch.zeros(3, 0, dtype=torch.long)
    mask = torch.zeros(3, 0, dtype=torch.float64)
    before = seed_grads(model)
    compiled = compile_loss(grpo_loss_f64, longstraw.Backend(prefix_chunk_size=5))
    with raises_longstraw(r"(?i)empty|zero|R ?= ?0|response"):
        run_and_backward(compiled, model, prompt, responses, advantages, mask)
    assert grads_equal(grads_of(model), before)


@pytest.mark.parametrize(
    "options",
    [
        {"prompt_grad": "bogus"},
        {"prefix_chunk_size": 0},
        {"prefix_chunk_size": -3},
        {"prefix_chunk_size": True},  # a bool is an int to Python, not a size
        {"plan_cache_size": True},
        {"on_unsupported": "maybe"},
    ],
)
def test_invalid_options(options):
    """Options are validated once, up front, with our error type."""
    with raises_longstraw(next(iter(options))):
        longstraw.Backend(**options)


def test_invalid_options_by_name():
    """By name the options reach the backend only when Dynamo calls it, so
    the error may come at torch.compile() or at the first call."""
    model = make_model("plain")
    with raises_longstraw("prompt_grad"):
        compiled = torch.compile(grpo_loss_f64, backend="longstraw", options={"prompt_grad": "bogus"})
        compiled(model, *make_group(2, 7, 9))


def test_longstraw_error_is_runtime_error():
    assert issubclass(longstraw.LongStrawError, RuntimeError)


def test_raises_longstraw_helper_checks_the_chain():
    """The helper itself: finds our error under a wrapper, rejects others."""
    with raises_longstraw("inner"):
        try:
            raise longstraw.LongStrawError("inner problem")
        except longstraw.LongStrawError as e:
            raise RuntimeError("wrapper") from e
    with pytest.raises(AssertionError):
        with raises_longstraw("x"):
            raise ValueError("x")
    with pytest.raises(AssertionError):
        with raises_longstraw("nomatch"):
            raise longstraw.LongStrawError("something else")
    with pytest.raises(pytest.fail.Exception):
        with raises_longstraw("x"):
            pass


class PrefixLM(torch.nn.Module):
    """One attention layer whose mask lets every position see the whole prompt."""

    def __init__(self, prefix: int) -> None:
        super().__init__()
        self.prefix = prefix
        self.embed = torch.nn.Embedding(64, 16)
        self.qkv = torch.nn.Linear(16, 48)
        self.head = torch.nn.Linear(16, 64)

    def forward(self, input_ids):
        q, k, v = self.qkv(self.embed(input_ids)).unsqueeze(1).chunk(3, dim=-1)  # [B, 1, L, 16] each
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        mask = (pos[None, :] <= pos[:, None]) | (pos[None, :] < self.prefix)  # [L, L]
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.head(out.squeeze(1))


def test_mask_that_sees_later_positions():
    """A prefix-LM mask: prompt positions attend to later prompt positions,
    so the prompt cannot be captured chunk by chunk."""
    torch.manual_seed(0)
    model = PrefixLM(prefix=6).double()
    args = make_group(2, 6, 4)
    before = seed_grads(model)
    compiled = compile_loss(grpo_loss_f64, longstraw.Backend(prefix_chunk_size=5))
    with raises_longstraw(r"attend to later positions"):
        run_and_backward(compiled, model, *args)
    assert grads_equal(grads_of(model), before)


def test_mixed_device_inputs():
    """Inputs on two devices fail while Dynamo traces the loss, before the
    backend: the message names both devices, the operator and the user's
    line, and no .grad changes."""
    model = make_model("plain")
    before = seed_grads(model)
    prompt, responses, advantages, mask = make_group(2, 20, 4)
    compiled = compile_loss(grpo_loss_f64, longstraw.Backend(prefix_chunk_size=8))
    with pytest.raises(Exception, match=r"(?s)same device.*cpu and meta.*losses\.py"):
        run_and_backward(compiled, model, prompt, responses.to("meta"), advantages, mask)
    assert grads_equal(grads_of(model), before)


def test_sequences_longer_than_the_position_table():
    """A learned position table with fewer rows than the group's positions:
    a plan-time error naming the embedding, nothing run, nothing changed;
    within the table the model is exact."""
    model = make_plain(learned_positions=24)
    step = compile_loss(grpo_loss_f64, longstraw.Backend(prefix_chunk_size=8))
    args = make_group(2, 16, 8)  # runs positions 0..22 (the last token is only a label)
    got = compiled_loss_and_grads(step, model, *args)
    want = eager_loss_and_grads(grpo_loss_f64, model, *args)
    assert_grads_close(got[1], want[1], 1e-9)
    before = seed_grads(model)
    with raises_longstraw(r"embedding.*position table of 24 rows.*25 positions"):
        run_and_backward(step, model, *make_group(2, 18, 8))  # runs positions 0..24
    assert grads_equal(grads_of(model), before)
