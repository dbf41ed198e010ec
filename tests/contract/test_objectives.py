"""The objectives of `examples/objectives.py` (GRPO, DAPO, Dr. GRPO, GSPO,
the k3 KL penalty) compile unchanged and match eager in float64: exact
mode against eager, detached mode against eager with the prompt's keys and
values constant, with a chunked prefix, `verify_state` and NaN-filled
memory."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import longstraw

from helpers.compare import assert_close, assert_grads_close
from helpers.harness import compiled_loss_and_grads
from helpers.parity import deterministic_algorithms
from helpers.paths import REPO
from helpers.reference import eager_loss_and_grads, prompt_state_detached
from helpers.tiny_models import make_group, make_model

TOL = 1e-6  # HF norms and RoPE round through float32

_spec = importlib.util.spec_from_file_location("objectives", REPO / "examples" / "objectives.py")
objectives = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(objectives)


def _inputs(model, prompt, responses):
    """Sampling-policy and reference log-probs near the policy's, as a trainer has them."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        logp = objectives.response_logprobs(model, prompt, responses)
    old = logp + 0.05 * torch.randn(logp.shape, generator=gen, dtype=logp.dtype)
    return old, old + 0.1 * torch.randn(logp.shape, generator=gen, dtype=logp.dtype)


# Detached mode differs from exact only before the tail: one objective in CI, all with `-m slow`.
@pytest.mark.parametrize("name, mode", [
    *[(name, "exact") for name in objectives.OBJECTIVES],
    *[pytest.param(name, "detached", marks=[] if name == "grpo" else [pytest.mark.slow]) for name in objectives.OBJECTIVES],
])
def test_objective_matches_eager(name, mode):
    objective = objectives.OBJECTIVES[name]
    model = make_model("qwen3")
    prompt, responses, advantages, mask = make_group(3, 13, 5, pad=True)
    old_logp, ref_logp = _inputs(model, prompt, responses)
    args = (prompt, responses, advantages, mask, old_logp, *((ref_logp,) if objective is objectives.kl_penalty else ()))
    backend = longstraw.Backend(prompt_grad=mode, prefix_chunk_size=5, verify_state=True)
    with deterministic_algorithms(True):
        if mode == "exact":
            want_loss, want = eager_loss_and_grads(objective, model, *args)
        else:
            with prompt_state_detached(prompt.shape[0]):
                want_loss, want = eager_loss_and_grads(objective, model, *args)
        got_loss, got = compiled_loss_and_grads(torch.compile(objective, backend=backend), model, *args)
    assert_close(got_loss, want_loss, TOL, f"{name} loss")
    assert_grads_close(got, want, TOL)
    assert any(g.abs().max() > 0 for g in got.values())
