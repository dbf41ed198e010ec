"""The branch step's LM head runs a chunk of positions at a time
(`longstraw/codegen/head.py`): the same loss and gradients as eager, the
`[R, vocab]` logits never whole, and regions that mix positions after the
head left unchunked."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import longstraw
from longstraw.models import qwen3_5
from longstraw.runtime.runner import GroupRunner

from helpers.compare import assert_close, assert_grads_close
from helpers.harness import compile_loss, compiled_loss_and_grads
from helpers.losses import grpo_loss_f64, logits_of
from helpers.reference import detached_at_attention, eager_loss_and_grads, hybrid_detached_reference
from helpers.tiny_models import make_group, make_model, make_qwen3_5

TOL = 1e-6  # HF's norms compute in float32, and their weights' gradients sum over positions chunk by chunk
CHUNK = 4
MODELS = {"qwen3": lambda: make_model("qwen3"), "qwen3_5": make_qwen3_5}


@pytest.fixture(autouse=True)
def _bound():
    with qwen3_5.bound():
        yield


def skip_loss(model, prompt, responses, advantages, mask, skip: int = 2):
    """Reads the logits from `skip` positions into the response, with the
    targets cut from the concatenated ids: two exits one position apart,
    the first one `skip - 1` positions into the branch step."""
    P = prompt.shape[0]
    ids = torch.cat([prompt.expand(responses.shape[0], -1), responses], dim=1)
    logits = logits_of(model(input_ids=ids))[:, P - 1 + skip : -1]
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, P + skip :].unsqueeze(-1)).squeeze(-1)
    ratio = torch.exp(logp - logp.detach())
    return -((ratio * advantages[:, None]) * mask[:, skip:]).sum() / mask.sum()


def cumsum_loss(model, prompt, responses, advantages, mask):
    """Mixes positions after the head, inside the per-token part."""
    logits = logits_of(model(input_ids=torch.cat([prompt.expand(responses.shape[0], -1), responses], 1)))
    logp = torch.log_softmax(logits[:, prompt.shape[0] - 1 : -1], -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    return -(logp.cumsum(-1) * advantages[:, None] * mask).sum() / mask.sum()


def sequence_mean_loss(model, prompt, responses, advantages, mask):
    """A per-response mean over positions inside the branch step."""
    logits = logits_of(model(input_ids=torch.cat([prompt.expand(responses.shape[0], -1), responses], 1)))
    logp = torch.log_softmax(logits[:, prompt.shape[0] - 1 : -1], -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    per_row = (logp * mask).sum(-1) / mask.sum(-1)
    return -(torch.exp(per_row - per_row.detach()) * advantages).mean()


def run(model, loss_fn, group, mode: str, recompute: bool = False, chunk: int | None = CHUNK):
    torch._dynamo.reset()
    backend = longstraw.Backend(
        prompt_grad=mode, prefix_chunk_size=4, recompute_layers=recompute, head_chunk_size=chunk, verify_state=True
    )
    loss, grads = compiled_loss_and_grads(compile_loss(loss_fn, backend), model, *group)
    return loss, grads, backend.plans[-1].runner


def reference(kind: str, loss_fn, model, group, mode: str):
    if mode == "exact":
        return eager_loss_and_grads(loss_fn, model, *group)
    if kind == "qwen3_5":
        assert loss_fn is grpo_loss_f64
        return hybrid_detached_reference(model, *group)
    return detached_at_attention(loss_fn, model, *group)


# CI: exact on the dense model without recomputation and on the hybrid with it, detached once (dense, without);
# the rest with `-m slow`.
HEAD_IN_CI = {("qwen3", "exact", False), ("qwen3_5", "exact", True), ("qwen3", "detached", False)}


@pytest.mark.parametrize("kind, mode, recompute", [
    pytest.param(kind, mode, recompute, marks=[] if (kind, mode, recompute) in HEAD_IN_CI else [pytest.mark.slow])
    for kind in MODELS for mode in ("exact", "detached") for recompute in (False, True)
])
def test_chunked_head_gives_eager_gradients(kind, mode, recompute):
    """R = 11 is not a multiple of the chunk (4): the last chunk has 3 positions."""
    model = MODELS[kind]()
    group = make_group(3, 13, 11, pad=True)
    loss, grads, runner = run(model, grpo_loss_f64, group, mode, recompute)
    assert runner.branch.head is not None and runner.branch.head.rows == 11
    want_loss, want = reference(kind, grpo_loss_f64, model, group, mode)
    assert_close(loss, want_loss, TOL, "loss")
    assert_grads_close(grads, want, TOL)


EXITS_IN_CI = {("qwen3_5", "exact"), ("qwen3", "detached")}  # CI: the hybrid exact, the dense detached; the rest slow


@pytest.mark.parametrize("kind, mode", [
    pytest.param(kind, mode, marks=[] if (kind, mode) in EXITS_IN_CI else [pytest.mark.slow])
    for kind in MODELS for mode in ("exact", "detached")
])
def test_exits_inside_the_step_and_apart(kind, mode):
    """The logits slice starts one position into the branch step (the prompt
    is P long, the loss skips two response positions) and the targets come
    from a second slice one position later: each chunk maps its read
    positions back through both slices."""
    model = MODELS[kind]()
    group = make_group(2, 9, 11, pad=True)
    loss, grads, runner = run(model, skip_loss, group, mode)
    head = runner.branch.head
    assert head is not None and head.rows == 9 and sorted(head.exit_starts) == [10, 11]
    if mode == "exact":
        want_loss, want = eager_loss_and_grads(skip_loss, model, *group)
    else:  # the unchunked step, itself checked against the detached reference elsewhere
        want_loss, want, _ = run(model, skip_loss, group, mode, chunk=None)
    assert_close(loss, want_loss, TOL, "loss")
    assert_grads_close(grads, want, TOL)


class _WidestLogits(TorchDispatchMode):
    """The most positions of any `[..., vocab]` tensor an operator made
    (the LM head's weight, its gradient and their transposes aside)."""

    def __init__(self, head: torch.Tensor) -> None:
        super().__init__()
        self.vocab = head.shape[0]
        self.weight_numel = head.numel()
        self.positions = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.vocab:
                if t.numel() != self.weight_numel:
                    self.positions = max(self.positions, t.numel() // self.vocab)
        return out


@pytest.mark.parametrize("chunk", [CHUNK, None])
def test_logits_never_exist_whole(chunk, monkeypatch):
    """The branches' forward and replays, and the prompt's capture and
    reverse pass, make no `[*, vocab]` tensor over more than a chunk of one
    response's positions; without chunking they do (R = 11 positions). The
    mode is entered inside the runner: Dynamo does not compile under one."""
    model = make_model("qwen3")
    widest = _WidestLogits(model.lm_head.weight)
    for name in ("run", "backward"):
        original = getattr(GroupRunner, name)

        def recorded(self, *args, _original=original):
            with widest:
                return _original(self, *args)

        monkeypatch.setattr(GroupRunner, name, recorded)
    backend = longstraw.Backend(prefix_chunk_size=4, head_chunk_size=chunk)
    torch._dynamo.reset()
    compiled_loss_and_grads(compile_loss(grpo_loss_f64, backend), model, *make_group(3, 13, 11))
    assert widest.positions == (CHUNK if chunk else 11)


@pytest.mark.parametrize("loss_fn", [cumsum_loss, sequence_mean_loss])
def test_positions_mixed_after_the_head_stay_unchunked(loss_fn):
    model = make_model("qwen3")
    group = make_group(3, 13, 11, pad=True)
    loss, grads, runner = run(model, loss_fn, group, "exact")
    assert runner.branch.head is None
    want_loss, want = eager_loss_and_grads(loss_fn, model, *group)
    assert_close(loss, want_loss, TOL, "loss")
    assert_grads_close(grads, want, TOL)


def test_option_is_validated():
    with pytest.raises(longstraw.LongStrawError, match="head_chunk_size must be a positive int or None"):
        longstraw.Backend(head_chunk_size=0)
