"""Mixture-of-experts layers (HF Qwen3-MoE) against eager in float64.

HF's `batched_mm` experts are per position: the router's softmax and topk
run over each position's expert axis, every token's row is repeated once
per chosen expert, multiplied by that expert's weights and summed back.
The dimension rules prove it (`topk`, `repeat_interleave` with an integer
count), so it matches eager in both modes with a chunked prefix, under
NaN-filled memory. HF's `grouped_mm` (the default) sorts all token rows by
expert; LongStraw traces it as one per-position operator,
`longstraw::moe_experts`, which runs HF's function inside, and matches eager
the same way. The eager loop, modules the operator does not cover and
routers that depend on other positions are refused with the cause and the fix.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

import longstraw

from conftest import raises_longstraw
from helpers.compare import assert_close, assert_grads_close
from helpers.harness import compiled_loss_and_grads
from helpers.losses import grpo_loss_f64
from helpers.parity import deterministic_algorithms
from helpers.reference import detached_at_attention, eager_loss_and_grads
from helpers.tiny_models import make_group

TOL = 1e-6  # HF norms and RoPE round through float32
VOCAB = 128


def make_moe(experts: str) -> torch.nn.Module:
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=1, max_position_embeddings=512, initializer_range=0.2,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").double().eval()
    model.set_experts_implementation(experts)
    return model


@pytest.fixture
def grouped_mm_fallback(monkeypatch):
    """torch's CPU grouped_mm kernel has no float64: HF's own fallback (a
    loop of `mm` per expert, what HF runs where the kernel is missing) in
    eager and inside `longstraw::moe_experts` alike."""
    monkeypatch.setattr(transformers.integrations.moe, "_can_use_grouped_mm", lambda *args: False)


@pytest.mark.parametrize("mode,experts", [  # in CI each mode and each implementation once; `-m slow` the rest
    ("exact", "batched_mm"), ("detached", "grouped_mm"),
    pytest.param("exact", "grouped_mm", marks=pytest.mark.slow),
    pytest.param("detached", "batched_mm", marks=pytest.mark.slow),
])
def test_experts_match_eager(experts, mode, grouped_mm_fallback):
    model = make_moe(experts)
    group = make_group(3, 11, 5, vocab=VOCAB, pad=True)
    backend = longstraw.Backend(prompt_grad=mode, prefix_chunk_size=4, verify_state=True)
    with deterministic_algorithms(True):
        if mode == "exact":
            want_loss, want = eager_loss_and_grads(grpo_loss_f64, model, *group)
        else:
            want_loss, want = detached_at_attention(grpo_loss_f64, model, *group)
        got_loss, got = compiled_loss_and_grads(torch.compile(grpo_loss_f64, backend=backend), model, *group)
    assert_close(got_loss, want_loss, 1e-9, "loss")
    assert_grads_close(got, want, TOL)
    assert any("experts" in name for name in got)
    assert backend.plans[-1].prefix_len == 10
    ops = [n.target for n in backend.plans[-1].partition.graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.longstraw.moe_experts.default) == (2 if experts == "grouped_mm" else 0)


def test_grouped_mm_kernel_runs_inside_the_operator():
    """float32 on torch's own grouped_mm kernel (no fallback): each step runs
    it on its own rows, so only the summation order differs from eager."""
    model = make_moe("grouped_mm").float()
    group = make_group(3, 11, 5, vocab=VOCAB, pad=True)
    want_loss, want = eager_loss_and_grads(grpo_loss_f64, model, *group)
    compiled = torch.compile(grpo_loss_f64, backend=longstraw.Backend(prefix_chunk_size=4, verify_state=True))
    got_loss, got = compiled_loss_and_grads(compiled, model, *group)
    assert_close(got_loss, want_loss, 1e-5, "loss")
    assert_grads_close(got, want, 1e-4)


def test_expert_parallel_grouped_mm_is_refused_with_the_fix():
    """`longstraw::moe_experts` does not cover expert parallelism: HF's grouped_mm
    is traced as it is, and its `sort` of all token rows by expert mixes positions."""
    model = make_moe("grouped_mm")
    model.model.layers[0].mlp.experts._is_expert_parallel = True
    compiled = torch.compile(grpo_loss_f64, backend=longstraw.Backend(prefix_chunk_size=4))
    with raises_longstraw(r"operator `sort` .* `model\.model\.layers\.0\.mlp\.experts` at .*moe\.py:\d+ .*mixes values "
                          r"across sequence positions.*expert-parallel.*set_experts_implementation\('batched_mm'\)"):
        compiled(model, *make_group(2, 7, 3, vocab=VOCAB))


def test_eager_experts_loop_is_refused_with_the_fix():
    compiled = torch.compile(grpo_loss_f64, backend=longstraw.Backend(prefix_chunk_size=4))
    with raises_longstraw(r"Dynamo broke the graph at modeling_qwen3_moe\.py:\d+.*HF's eager experts loop"
                          r".*set_experts_implementation\('batched_mm'\)"):
        compiled(make_moe("eager"), *make_group(2, 7, 3, vocab=VOCAB))


class CapacityRouter(transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter):
    """Drops a token's expert once `capacity` earlier tokens chose it: whether
    a position keeps its expert depends on the positions before it."""

    capacity = 3

    def forward(self, hidden_states):
        router_logits, scores, indices = super().forward(hidden_states)
        chosen = F.one_hot(indices, self.num_experts).sum(1)  # [T, E]
        kept = torch.cumsum(chosen, dim=0).gather(1, indices) <= self.capacity  # [T, k]
        return router_logits, scores * kept, indices


def test_capacity_dropping_router_is_refused_at_its_cumsum():
    model = make_moe("batched_mm")
    model.model.layers[1].mlp.gate.__class__ = CapacityRouter
    compiled = torch.compile(grpo_loss_f64, backend=longstraw.Backend(prefix_chunk_size=4))
    with raises_longstraw(r"operator `cumsum` .* `model\.model\.layers\.1\.mlp\.gate` at .*test_moe\.py:\d+ "
                          r"\(forward\) mixes values across sequence positions"):
        compiled(model, *make_group(2, 7, 3, vocab=VOCAB))


def test_router_logits_output_is_refused_with_the_fix():
    """`output_router_logits=True` (the load-balancing loss) breaks the graph in HF's output hooks."""
    model = make_moe("batched_mm")

    def with_aux_loss(model, prompt, responses, advantages, mask):
        ids = torch.cat([prompt.expand(responses.shape[0], -1), responses], dim=1)
        out = model(input_ids=ids, output_router_logits=True)
        logp = torch.log_softmax(out.logits[:, prompt.shape[0] - 1 : -1], -1)
        return -(logp.gather(-1, responses.unsqueeze(-1)).squeeze(-1) * mask).sum() + 0.01 * out.aux_loss

    compiled = torch.compile(with_aux_loss, backend=longstraw.Backend(prefix_chunk_size=4))
    with raises_longstraw(r"output_capturing\.py.*`output_router_logits`.*load-balancing loss averages routing"):
        compiled(model, *make_group(2, 7, 3, vocab=VOCAB))
