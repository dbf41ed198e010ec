"""MLA (DeepSeek-V3): the latent and the rope key are the state, and the
steps attend in latent space (`passes/mla.py`).

Float64 parity against eager HF in both modes: exact against the plain
eager loss; detached against HF's cached path, whose cache holds the same
latent and rope key (so `kv_b_proj` gets a gradient through the prompt in
both). Every run has `verify_state=True`; the deterministic runs fill
uninitialised memory with NaN.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

import longstraw
from longstraw.nodes import is_sdpa
from longstraw.passes import DEFAULT_PASSES, CausalAttentionPass, LatentAttentionPass
from longstraw.passes.mla import latent_attention_step, mla_of
from longstraw.passes.sliding_window import window_of
from longstraw.runtime.kernels import attention as attention_kernels

from helpers.harness import assert_branch_order_does_not_matter, assert_parity, compile_loss
from helpers.losses import grpo_loss_f64
from helpers.parity import deterministic_algorithms
from helpers.published import explain_published
from helpers.reference import detached_reference
from helpers.tiny_models import make_deepseek_v3, make_group

TOL = 1e-6  # as test_families: HF norms and RoPE round through float32


def check_parity(model: nn.Module, mode: str, shape: tuple, deterministic: bool = False, device: str = "cpu",
                 **options) -> None:
    G, P, R, chunk = shape
    group = [t.to(device) for t in make_group(G, P, R, pad=True)]
    backend = longstraw.Backend(prompt_grad=mode, prefix_chunk_size=chunk, verify_state=True, **options)
    with deterministic_algorithms(deterministic):
        assert_parity(grpo_loss_f64, backend, detached_reference, model, *group, tol=TOL)
    kinds = {s.reason.split(":")[0] for s in backend.plans[-1].partition.slots}
    assert kinds == {"latent_attention"}, kinds


# (G, P, R, prefix_chunk_size): chunks that divide the prompt and chunks that
# do not, one chunk, one-position chunks, a two-token prompt, G = 1, a
# one-token prompt (no state: the branch attends over its own positions).
SHAPES = [(3, 13, 5, 5), (2, 9, 4, 3), (4, 17, 3, 32), (1, 6, 7, 1), (3, 2, 4, 4), (2, 1, 4, 1)]


# Detached mode differs from exact only before the loss tail: CI runs one
# detached case per feature; `-m slow` the rest.
SLOW_DETACHED = ["exact", pytest.param("detached", marks=pytest.mark.slow)]
# the dense layers in CI: the hardest shape (G3, padded, chunk 5 of 13) exact, the one-token prompt (no state)
# exact, G2-P9-chunk3 detached; `-m slow` the rest (G = 1, the two-token prompt, the one chunk over the prompt)
DENSE_IN_CI = {("detached", SHAPES[1]), ("exact", SHAPES[0]), ("exact", SHAPES[5])}


@pytest.mark.parametrize("mode,shape", [
    pytest.param(mode, shape, id="{}-G{}-P{}-R{}-chunk{}".format(mode, *shape),
                 marks=[] if (mode, shape) in DENSE_IN_CI else [pytest.mark.slow])
    for mode in ("exact", "detached") for shape in SHAPES
])
def test_dense_layers_match_eager(mode, shape):
    check_parity(make_deepseek_v3(), mode, shape, deterministic=SHAPES.index(shape) % 2 == 1)


@pytest.mark.parametrize("mode,shape", [
    pytest.param("exact", (3, 13, 5, 5), id="exact-G3-P13-R5-chunk5"),
    pytest.param("detached", (2, 9, 4, 3), id="detached-G2-P9-R4-chunk3"),
    pytest.param("exact", (2, 9, 4, 3), id="exact-G2-P9-R4-chunk3", marks=pytest.mark.slow),
    pytest.param("detached", (3, 13, 5, 5), id="detached-G3-P13-R5-chunk5", marks=pytest.mark.slow),
])
def test_moe_layers_match_eager(mode, shape):
    check_parity(make_deepseek_v3(experts=True), mode, shape, deterministic=shape[3] == 3)


def test_without_the_cache():
    """`use_cache=False`: traced without a cache, HF's causal mask goes
    through its packed-sequence check of the position ids, which `band_of`
    proves causal, so the latent stays the state (not decompressed K/V)."""
    model = make_deepseek_v3()
    model.config.use_cache = False
    check_parity(model, "exact", SHAPES[1])


# detached with NaN-filled memory and experts: CI's test_moe_layers_match_eager[detached-G2-P9-R4-chunk3]
@pytest.mark.parametrize("mode", SLOW_DETACHED)
def test_nan_filled_memory(mode):
    check_parity(make_deepseek_v3(experts=True), mode, (3, 11, 4, 4), deterministic=True)


# YaRN: HF's softmax scale includes the mscale (the pass reads the scale HF
# passes to SDPA); a query LoRA; rope not interleaved; value heads narrower
# than the nope part of the keys.
VARIANTS = {
    "yarn": dict(rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                      original_max_position_embeddings=16, mscale=1.0, mscale_all_dim=1.0)),
    "q_lora": dict(q_lora_rank=12),
    "rope_not_interleaved": dict(rope_interleave=False),
    "value_dim_6": dict(v_head_dim=6, qk_nope_head_dim=10, qk_rope_head_dim=6, kv_lora_rank=20),
}


@pytest.mark.parametrize("mode", SLOW_DETACHED)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variants_match_eager(variant, mode):
    check_parity(make_deepseek_v3(**VARIANTS[variant]), mode, (3, 10, 4, 4))


def test_yarn_scale_is_the_one_hf_passes():
    model = make_deepseek_v3(**VARIANTS["yarn"])
    scaling = model.model.layers[0].self_attn.scaling
    assert scaling != pytest.approx(model.config.qk_head_dim ** -0.5)
    backend = longstraw.Backend(prefix_chunk_size=4)
    compile_loss(grpo_loss_f64, backend)(model, *make_group(2, 7, 3))
    scales = {mla_of(n).scale for n in backend.plans[-1].partition.claims}
    assert scales == {scaling}


@pytest.mark.parametrize("mode", SLOW_DETACHED)
def test_key_blocks_of_one_position(monkeypatch, mode):
    """The kernel's blocks split the state and the step's own positions into
    single keys: each block's gradient lands at its positions."""
    monkeypatch.setattr(attention_kernels, "MATH_BLOCK_SCORES", 1)
    check_parity(make_deepseek_v3(), mode, (2, 11, 4, 3), deterministic=True)


@pytest.mark.parametrize("option", ["recompute_layers", "attention_outputs_on_host"])
def test_options_match_eager(option):
    """Layer recomputation; the general pass's kept attention outputs (MLA keeps none)."""
    check_parity(make_deepseek_v3(), "exact", (3, 13, 5, 4), **{option: True})


@pytest.mark.parametrize("mode", SLOW_DETACHED)
def test_branch_order_does_not_matter(mode):
    """Permuting the responses permutes nothing in the gradients."""
    assert_branch_order_does_not_matter(make_deepseek_v3(experts=True), mode, make_group(4, 15, 5, pad=True), 4)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["exact", "detached"])
def test_cuda_matches_eager(mode):
    """Float64 on CUDA: the step's tensors are made on the step's device."""
    check_parity(make_deepseek_v3(experts=True).cuda(), mode, (3, 13, 5, 5), device="cuda")


# --- what is captured --------------------------------------------------------------------------


class DecompressedAttention(CausalAttentionPass):
    """The general attention pass without the MLA exclusion: decompressed K/V per head."""

    def claims(self, node):
        return is_sdpa(node) and window_of(node) is None


def _state_per_position(model, passes=None) -> dict[str, int]:
    report = longstraw.explain(grpo_loss_f64, model, *make_group(2, 7, 3), options={"prefix_chunk_size": 4},
                               passes=passes)
    out: dict[str, int] = {}
    for row in report.state:
        out[row.layer] = out.get(row.layer, 0) + row.bytes_per_position
    return out


def test_state_is_latent_and_rope_key():
    """Per layer and position: kv_lora_rank + qk_rope_head_dim values, against
    heads x (nope + rope + value) for the decompressed K/V."""
    model = make_deepseek_v3()
    cfg = model.config
    latent = _state_per_position(model)
    decompressed = _state_per_position(model, passes=(DecompressedAttention(),))
    layers = [f"model.model.layers.{i}.self_attn" for i in range(cfg.num_hidden_layers)]
    assert latent == {layer: (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 8 for layer in layers}
    heads = cfg.num_attention_heads
    assert decompressed == {layer: heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) * 8
                            for layer in layers}


DEEPSEEK_V3 = dict(  # attention shapes of DeepSeek-V3 (GLM-5's MLA has the same latent); a narrow residual stream
    vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=128,
    num_key_value_heads=128, q_lora_rank=64, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
    v_head_dim=128, first_k_dense_replace=1,
)


def test_state_at_deepseek_v3_shapes(capsys):
    """576 values per layer and position (bf16: 1,152 bytes) against
    128 x (192 + 128) decompressed (81,920 bytes). A narrow residual stream
    keeps it seconds on a CPU; every layer and expert of DeepSeek-V3 on the
    meta device: tests/planning/test_report.py (`-m slow`)."""
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**DEEPSEEK_V3)).to(torch.bfloat16)
    group = make_group(2, 7, 3)
    sizes = {}
    for name, passes in (("latent", DEFAULT_PASSES), ("decompressed", (DecompressedAttention(),))):
        report = longstraw.explain(grpo_loss_f64, model, *group, options={"prefix_chunk_size": 4}, passes=passes)
        sizes[name] = report.state_bytes_per_position
    with capsys.disabled():
        print(f"\nDeepSeek-V3 attention state per layer and position (bf16): latent + rope key {sizes['latent']:,} B, "
              f"decompressed K/V {sizes['decompressed']:,} B")
    assert sizes == {"latent": (512 + 64) * 2, "decompressed": 128 * (192 + 128) * 2}


def test_steps_never_decompress():
    """No step applies kv_b_proj as a linear: K and V are never built, the
    weight is read only by the absorbed attention."""
    backend = longstraw.Backend(prefix_chunk_size=4)
    compile_loss(grpo_loss_f64, backend)(make_deepseek_v3(), *make_group(2, 7, 3))
    runner = backend.plans[-1].runner
    for step in (runner.prefix, runner.branch):
        weights = [n for n in step.module.graph.nodes if n.op == "placeholder" and "kv_b_proj" in n.name]
        assert weights and all(u.target is latent_attention_step for w in weights for u in w.users)


# --- what is not claimed -----------------------------------------------------------------------


def test_kv_b_proj_with_bias_is_left_to_the_general_pass():
    """A bias on kv_b_proj is not the proved pattern: the general pass
    captures decompressed K/V, and the result is still exact."""
    model = make_deepseek_v3()
    torch.manual_seed(1)
    for layer in model.model.layers:
        old = layer.self_attn.kv_b_proj
        new = nn.Linear(old.in_features, old.out_features, bias=True, dtype=torch.float64)
        new.weight.data.copy_(old.weight.data)
        layer.self_attn.kv_b_proj = new
    group = make_group(2, 9, 4, pad=True)
    backend = longstraw.Backend(prefix_chunk_size=4, verify_state=True)
    assert_parity(grpo_loss_f64, backend, detached_reference, model, *group, tol=TOL)
    assert {s.reason.split(":")[0] for s in backend.plans[-1].partition.slots} == {"causal_attention"}


def test_group_as_long_as_the_sequence_is_left_to_the_general_pass():
    """With G == P + R the latent's batch and position axes have one size:
    the shape check cannot tell their order, so the pass does not claim."""
    model = make_deepseek_v3()
    cfg = model.config
    report = longstraw.explain(grpo_loss_f64, model, *make_group(8, 5, 3), options={"prefix_chunk_size": 4})
    per_head = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim
    assert report.state_bytes_per_position == 2 * cfg.num_attention_heads * per_head * 8


def test_latent_pass_is_a_default_pass():
    assert any(isinstance(p, LatentAttentionPass) for p in DEFAULT_PASSES)


@pytest.fixture
def explicit_causal_mask():
    """HF's SDPA calls with an explicit `arange` causal mask instead of `is_causal`."""
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def masked(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if is_causal and attn_mask is None:
            position = torch.arange(q.shape[-2], device=q.device)
            attn_mask, is_causal = position[:, None] >= position[None, :], False
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)

    torch.nn.functional.scaled_dot_product_attention = masked
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa


@pytest.mark.parametrize("mode", SLOW_DETACHED)
def test_mask_proved_causal_is_claimed(explicit_causal_mask, mode):
    check_parity(make_deepseek_v3(), mode, (3, 10, 4, 3))


DEEPSEEK_V2_LITE = dict(
    vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
    num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64,
    qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
    first_k_dense_replace=1, n_group=1, topk_group=1, max_position_embeddings=163840,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "mscale": 0.707, "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096},
)
"""deepseek-ai/DeepSeek-V2-Lite's published config.json, as `DeepseekV2Config` arguments."""


@pytest.mark.slow
def test_state_at_deepseek_v2_lite():
    """DeepSeek-V2-Lite (16B-A2.4B; shapes from deepseek-ai/DeepSeek-V2-Lite's
    config.json) on the meta device, bf16, HF's `batched_mm` experts: each
    of the 27 MLA layers keeps the latent (512) and the rope key (64) per
    position, 1,152 B, not the decompressed 16 x (192 + 128) K/V; nothing
    fixed."""
    config = transformers.DeepseekV2Config(**DEEPSEEK_V2_LITE)
    report = explain_published(transformers.DeepseekV2ForCausalLM, config, experts="batched_mm")
    layers, latent, rope = 27, 512, 64
    assert report.state_bytes_per_position == layers * (latent + rope) * 2 == 31_104
    assert report.state_fixed_bytes == 0
