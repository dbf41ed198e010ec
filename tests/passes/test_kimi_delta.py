"""Kimi Delta Attention (`passes/kimi_delta.py`, the kernel
`longstraw/runtime/kernels/kimi_delta.py`, the binding
`longstraw.models.kimi_linear`): the chunked rule is transformers' rule, in
values and gradients, any split of the positions hands over the same state,
the families suite's detached reference tells the modes apart, and the
state at the published shape. Float64 parity of `kimi_linear` against eager
in both modes is `tests/models/test_families.py`'s."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.kimi_linear import modeling_kimi_linear as hf

from longstraw.passes.kimi_delta import kimi_delta_rule
from longstraw.runtime.kernels.kimi_delta import kimi_delta_rule_reference

from helpers.compare import assert_close, rel_err
from helpers.families import FAMILIES
from helpers.losses import grpo_loss_f64
from helpers.published import explain_published
from helpers.reference import eager_loss_and_grads
from helpers.tiny_models import make_group

HF_FLOAT32 = 2e-6  # transformers computes the rule in float32 whatever the inputs


def _inputs(length: int = 150, batch: int = 2, heads: int = 3, dim_k: int = 8, dim_v: int = 6) -> list[torch.Tensor]:
    """q, k, v, g, beta in float64; longer than two 64-position chunks."""
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(batch, length, heads, dim_k, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(batch, length, heads, dim_v, generator=gen, dtype=torch.float64)
    g = -2 * torch.rand(batch, length, heads, dim_k, generator=gen, dtype=torch.float64)
    beta = torch.rand(batch, length, heads, generator=gen, dtype=torch.float64)
    return [q, k, v, g, beta]


def test_the_rule_is_transformers_rule():
    """Against HF's chunked and recurrent forms: outputs and final state."""
    q, k, v, g, beta = _inputs()
    out, state = kimi_delta_rule_reference(q, k, v, g, beta, None, True)
    chunked, chunked_state = hf.chunk_kimi_delta_attention(q, k, v, g, beta, output_final_state=True,
                                                          use_qk_l2norm_in_kernel=True)
    recurrent, _ = hf.recurrent_kimi_delta_attention(q, k, v, g, beta, None, True, use_qk_l2norm_in_kernel=True)
    assert_close(out, chunked, HF_FLOAT32, "output against the chunked form")
    assert_close(out, recurrent, HF_FLOAT32, "output against the recurrent form")
    assert_close(state.float(), chunked_state, HF_FLOAT32, "final state")


@pytest.mark.parametrize("cut", [1, 64, 70, 149])
def test_any_split_hands_over_the_same_state(cut):
    q, k, v, g, beta = _inputs()
    whole, state = kimi_delta_rule_reference(q, k, v, g, beta, None, True)
    first, handed = kimi_delta_rule_reference(*(x[:, :cut] for x in (q, k, v, g, beta)), None, True)
    rest, final = kimi_delta_rule_reference(*(x[:, cut:] for x in (q, k, v, g, beta)), handed, True)
    assert_close(torch.cat([first, rest], 1), whole, 1e-13, "output")
    assert_close(final, state, 1e-13, "state")


def test_the_operators_gradients_are_transformers():
    """The operator's backward (autograd through the chunked rule) against
    autograd through HF's recurrent form, from an initial state."""
    inputs = [x.requires_grad_(True) for x in _inputs(length=40)]
    initial = torch.randn(2, 3, 8, 6, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(2, 40, 3, 6, dtype=torch.float64)
    out, state = kimi_delta_rule(*inputs, initial, True)
    got = torch.autograd.grad((out * weights).sum() + state.sum(), [*inputs, initial])
    want_out, want_state = hf.recurrent_kimi_delta_attention(*inputs, initial, True, use_qk_l2norm_in_kernel=True)
    want = torch.autograd.grad((want_out * weights).sum() + want_state.sum(), [*inputs, initial])
    for name, a, b in zip(["q", "k", "v", "g", "beta", "initial state"], got, want):
        assert_close(a, b, 1e-5, f"d{name}")


def test_the_operator_registration_is_consistent():
    """`torch.library.opcheck`: the fake (shared with Gated DeltaNet's
    operator) gives the kernel's shapes and dtypes, the autograd
    registration runs, and the operator traces, with and without an
    initial state."""
    inputs = [x[:, :20].requires_grad_(True) for x in _inputs()]
    for initial in (None, torch.randn(2, 3, 8, 6, dtype=torch.float64, requires_grad=True)):
        torch.library.opcheck(kimi_delta_rule, (*inputs, initial, True))


def test_the_detached_reference_differs_from_exact():
    family = FAMILIES["kimi_linear"]
    model, group = family.build(), make_group(3, 13, 5, pad=True)
    _, detached = family.detached(grpo_loss_f64, model, *group)
    _, exact = eager_loss_and_grads(grpo_loss_f64, model, *group)
    assert max(rel_err(detached[n], exact[n]) for n in exact if exact[n] is not None) > 1e-2


@pytest.mark.slow
def test_state_at_kimi_linear_published_shape():
    """`KimiLinearConfig`'s defaults (the full-size shapes HF documents with
    moonshotai/Kimi-Linear-48B-A3B-Instruct), bf16: 6
    MLA layers keep the latent (512) and rope key (64) per position, 6,912 B;
    21 KDA layers carry 32 heads of a 128 x 128 float32 state and the
    convolution's last 3 inputs of q, k and v (3 x 4,096, bf16), 2,170,880 B each."""
    config = transformers.KimiLinearConfig()
    report = explain_published(transformers.KimiLinearForCausalLM, config, experts="batched_mm")
    full, linear = config.layer_types.count("full_attention"), config.layer_types.count("linear_attention")
    heads, d, k = config.linear_num_heads, config.linear_head_dim, config.linear_conv_kernel_dim
    assert (full, linear) == (6, 21)
    assert report.state_bytes_per_position == full * (config.kv_lora_rank + config.qk_rope_head_dim) * 2 == 6_912
    assert report.state_fixed_bytes == linear * (heads * d * d * 4 + (k - 1) * 3 * heads * d * 2) == 45_588_480
