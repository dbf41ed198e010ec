"""The HF causal-LM families LongStraw claims, and the ones it refuses.

One registry drives the differential suite (`tests/models/test_families.py`) and the
table of supported and refused families in docs/models.md and its summary in the README
(`python tests/helpers/families.py` rewrites both; `test_family_tables_are_generated_from_the_registry`
keeps them in step).
A family is either supported, proven by float64 parity against eager in both
modes, or refused with a message the suite matches: nothing in between. A
refused family's `fix` is the message's advice as code, which the suite
follows to show it works; a family without one says `NO_FIX`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers

from longstraw.errors import NO_FIX
from longstraw.models import qwen3_5

# Small enough that a family compiles in about a second on a CPU.
COMMON = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=256, initializer_range=0.2,
)
_NO_HEAD_DIM = {k: v for k, v in COMMON.items() if k != "head_dim"}
_GPT_SHAPES = dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, initializer_range=0.2)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
_MLA = dict(
    _NO_HEAD_DIM, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8,
    v_head_dim=8, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
)
_MAMBA1 = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2, conv_kernel=4,
               time_step_rank=4, initializer_range=0.2)
_DSA = dict(_MLA, q_lora_rank=12, index_head_dim=8, index_n_heads=8, index_topk=8, mlp_layer_types=["dense", "sparse"])

MAMBA_TOL = 5e-5
"""transformers runs Mamba-2's scan in float32 inside a float64 model
(`hidden_states.float()`), chunked differently from LongStraw's, and
`A_log`'s gradient sums a decay over every position: the two agree to
1e-6..1.3e-5 there, where a missing gradient term is of order one."""

# Messages of the refused families (regular expressions).
_EAGER = r"explicit matmul and softmax \(HF's attn_implementation='eager'\)"
EAGER_ATTENTION = _EAGER + r".*load the model with attn_implementation='sdpa'"
EAGER_ONLY = _EAGER + r".*HF does not run `\w+` with SDPA \(`_supports_sdpa = False`.*" + re.escape(NO_FIX)
DATA_DEPENDENT_ROUTING = (r"Dynamo broke the graph at .*Dynamic shape operator.*HF's eager experts loop"
                          r".*set_experts_implementation\('batched_mm'\)")
OWN_EXPERTS_LOOP = (r"Dynamo broke the graph at modeling_\w+\.py:\d+ .*the model's own experts loop.*"
                    r"`set_experts_implementation` does not replace it.*" + re.escape(NO_FIX))
_NO_SDPA = "HF forbids SDPA for it (`_supports_sdpa = False`) and LongStraw claims SDPA attention alone; no fix yet."
_OWN_LOOP = ("Its own experts loop (token-dependent shapes) is a graph break that HF's `set_experts_implementation` "
             "does not replace; no fix yet.")
_ISSUE_MOE = ("HF's eager experts loop is a graph break (token-dependent shapes); HF's default `grouped_mm` "
              "(one per-position operator) and `batched_mm` compile (Qwen3-MoE: `tests/models/test_moe.py`).")


@dataclasses.dataclass(frozen=True)
class Fix:
    """A refusal's advice, done as its message says: `model` changes the
    built model in place, `loss` (None: `grpo_loss_f64`) is the loss to
    compile, `bind` the context to run in instead of the family's."""

    model: Callable[[torch.nn.Module], Any] = lambda model: None
    loss: Callable[..., torch.Tensor] | None = None
    bind: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


@dataclasses.dataclass(frozen=True)
class Family:
    """One HF model family at tiny shapes.

    `refused`: the regular expression the LongStrawError must match, None
    for a supported family. `note`: the README's words (for a refused family,
    the cause and what to do). `bind`: a context the model runs in (eager
    reference and compiled alike). `detached`: the detached-mode reference,
    `(loss_fn, model, *group) -> (loss, grads)`; None: the eager loss with
    the prompt's keys and values constants (`reference.detached_at_attention`).
    `train`: build in train mode. `fix`: a refused family's advice as code,
    None where its message says `NO_FIX`. `tol`: the parity tolerance.
    """

    name: str
    config: Callable[[], transformers.PretrainedConfig]
    refused: str | None = None
    note: str = ""
    attn_implementation: str = "sdpa"
    bind: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    detached: Callable[..., Any] | None = None
    experts: str = "eager"  # HF's experts implementation for MoE layers (grouped_mm has no float64 kernel)
    train: bool = False
    fix: Fix | None = None
    tol: float = 1e-6  # relative, loss and every gradient (HF's norms and RoPE round through float32)

    def build(self, seed: int = 0) -> torch.nn.Module:
        config = self.config()
        config._experts_implementation = self.experts
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=self.attn_implementation)
        return model.double().train(self.train)


def _hf(config_cls: type, base: dict = COMMON, **overrides) -> Callable[[], transformers.PretrainedConfig]:
    return lambda: config_cls(**{**base, **overrides})


def _hybrid_detached(loss_fn, model, prompt, responses, advantages, mask):
    from helpers.reference import hybrid_detached_reference

    return hybrid_detached_reference(model, prompt, responses, advantages, mask)


def _selective_scan_detached(loss_fn, model, prompt, responses, advantages, mask):
    """HF's Mamba-1 cache starts a multi-token continuation from a zero state:
    the reference holds the state at the prompt's end constant in the
    mixer's own functions instead."""
    from helpers.reference import detached_at_selective_scan

    return detached_at_selective_scan(loss_fn, model, prompt, responses, advantages, mask)


def _kimi_detached(loss_fn, model, prompt, responses, advantages, mask):
    """HF's cache path (MLA's latent and the rule's state constant), its KDA
    given a copy of the cached state: HF writes the new state into the
    cached tensor in place, which its own autograd graph still reads."""
    from transformers.models.kimi_linear import modeling_kimi_linear as hf

    rule = hf.chunk_kimi_delta_attention

    def on_a_copy(*args, initial_state=None, **kwargs):
        return rule(*args, initial_state=None if initial_state is None else initial_state.clone(), **kwargs)

    hf.chunk_kimi_delta_attention = on_a_copy
    try:
        return _hybrid_detached(loss_fn, model, prompt, responses, advantages, mask)
    finally:
        hf.chunk_kimi_delta_attention = rule


def _latent_detached(loss_fn, model, prompt, responses, advantages, mask):
    """MLA's state is the latent and the rope key (`passes/mla.py`): the
    detached contract holds those constant, which is HF's cache path
    (`kv_b_proj` still sees the prompt through the branches' attention)."""
    from helpers.reference import detached_reference

    return detached_reference(model, prompt, responses, advantages, mask)


def _eager_attention_detached(loss_fn, model, prompt, responses, advantages, mask):
    """The prompt's keys and values constants at HF's eager (sink) attention,
    which calls no SDPA for `detached_at_attention` to cut at."""
    from helpers.reference import detached_at_eager_attention

    return detached_at_eager_attention(loss_fn, model, prompt, responses, advantages, mask)


def _arange_positions_loss(model, prompt, responses, advantages, mask):
    """`grpo_loss_f64` passing `position_ids=torch.arange(L).expand(G, -1)`,
    as the refusal of a model that counts its own positions says."""
    from helpers.losses import grpo_tail, logits_of

    ids = torch.cat([prompt.expand(responses.shape[0], -1), responses], dim=1)
    positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    logits = logits_of(model(input_ids=ids, position_ids=positions))[:, prompt.shape[0] - 1 : -1]
    return grpo_tail(logits, responses, advantages, mask)


def _eval_routers(model: torch.nn.Module) -> None:
    """`.eval()` on every `PhimoeTopKRouter`, as Phi-MoE's refusal in train mode says."""
    for module in model.modules():
        if type(module).__name__ == "PhimoeTopKRouter":
            module.eval()


_SDPA = Fix(model=lambda model: model.set_attn_implementation("sdpa"))
_BATCHED_MM = Fix(model=lambda model: model.set_experts_implementation("batched_mm"))
_BOUND = Fix(bind=qwen3_5.bound)  # outside `qwen3_5.unbound()`, eager calls routed as well (`bind()`)

T = transformers
_GEMMA3N = _hf(T.Gemma3nTextConfig, num_hidden_layers=4, num_kv_shared_layers=2, sliding_window=4,
               layer_types=["sliding_attention", "full_attention"] * 2, laurel_rank=4, altup_num_inputs=2,
               hidden_size_per_layer_input=8, vocab_size_per_layer_input=64, activation_sparsity_pattern=[0.0] * 4)
_PHIMOE = _hf(T.PhimoeConfig, num_local_experts=4, num_experts_per_tok=2)
_GPT_OSS = _hf(T.GptOssConfig, num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
               layer_types=["sliding_attention", "full_attention"])
SUPPORTED = [
    Family("qwen3", _hf(T.Qwen3Config)),
    Family("llama", _hf(T.LlamaConfig)),
    Family("qwen2", _hf(T.Qwen2Config)),
    Family("mistral", _hf(T.MistralConfig, sliding_window=6), note="sliding window 6: the last 5 positions' K/V are the state (fixed bytes)"),
    Family("gemma3", _hf(T.Gemma3TextConfig, sliding_window=6, layer_types=["sliding_attention", "full_attention"]),
           note="sliding layers keep a fixed window, full layers K/V per position"),
    Family("phi3", _hf(T.Phi3Config, pad_token_id=0)),
    Family("gpt_neox", _hf(T.GPTNeoXConfig, rotary_pct=0.5), note="partial rotary"),
    Family("olmo2", _hf(T.Olmo2Config, pad_token_id=0)),
    Family("smollm3", _hf(T.SmolLM3Config, pad_token_id=0, no_rope_layer_interval=2), note="NoPE layers"),
    Family("gpt2", _hf(T.GPT2Config, _GPT_SHAPES, n_positions=256, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0,
                       bos_token_id=0, eos_token_id=0), note="Conv1D (`addmm` over `[B*T, C]`)"),
    Family("deepseek_v3", _hf(T.DeepseekV3Config, _MLA, first_k_dense_replace=2), detached=_latent_detached,
           note="MLA, dense layers; state: the normed KV latent and the rope key (absorbed attention, `tests/passes/test_mla.py`)"),
    Family("qwen3_5", qwen3_5.tiny_config, bind=qwen3_5.bound, detached=_hybrid_detached,
           note="Gated DeltaNet + gated attention; compiles as is, no binding step"),
    Family("starcoder2", _hf(T.Starcoder2Config)),
    Family("granite", _hf(T.GraniteConfig)),
    Family("cohere", _hf(T.CohereConfig)),
    Family("phi", _hf(T.PhiConfig, partial_rotary_factor=0.5)),
    Family("stablelm", _hf(T.StableLmConfig)),
    Family("olmo", _hf(T.OlmoConfig, pad_token_id=0)),
    Family("olmo3", _hf(T.Olmo3Config, pad_token_id=0, sliding_window=6)),
    Family("gemma", _hf(T.GemmaConfig)),
    Family("glm4", _hf(T.Glm4Config, pad_token_id=0)),
    Family("falcon", _hf(T.FalconConfig, _NO_HEAD_DIM, num_kv_heads=2, new_decoder_architecture=True, alibi=False),
           note="fused QKV split with list indices, `x.T`"),
    Family("nemotron", _hf(T.NemotronConfig)),
    Family("helium", _hf(T.HeliumConfig)),
    Family("ernie4_5", _hf(T.Ernie4_5Config)),
    Family("seed_oss", _hf(T.SeedOssConfig)),
    Family("arcee", _hf(T.ArceeConfig)),
    Family("exaone4", _hf(T.Exaone4Config, sliding_window=6)),
    Family("apertus", _hf(T.ApertusConfig), note="xIELU activation"),
    Family("hunyuan_v1_dense", _hf(T.HunYuanDenseV1Config)),
    Family("persimmon", _hf(T.PersimmonConfig)),
    Family("bitnet", _hf(T.BitNetConfig)),
    Family("ministral", _hf(T.MinistralConfig)),
    Family("qwen3_moe", _hf(T.Qwen3MoeConfig, **_MOE), experts="batched_mm",
           note="MoE, softmax top-k router, HF's `batched_mm` experts (`grouped_mm`: `tests/models/test_moe.py`)"),
    Family("mixtral", _hf(T.MixtralConfig, num_local_experts=4, num_experts_per_tok=2), experts="batched_mm",
           note="MoE, HF's `batched_mm` experts"),
    Family("qwen3_next", _hf(T.Qwen3NextConfig, **_MOE, linear_num_key_heads=2, linear_num_value_heads=4,
                             linear_key_head_dim=8, linear_value_head_dim=8,
                             layer_types=["linear_attention", "full_attention"]),
           experts="batched_mm", bind=qwen3_5.bound, detached=_hybrid_detached,
           note="Gated DeltaNet + gated attention + MoE; its linear attention binds as Qwen3.5's (`longstraw.models.qwen3_5`)"),
    Family("qwen3_5_moe", _hf(T.Qwen3_5MoeTextConfig, **_MOE, shared_expert_intermediate_size=16,
                              partial_rotary_factor=0.5, linear_num_key_heads=2, linear_num_value_heads=4,
                              linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                              layer_types=["linear_attention", "full_attention"]),
           experts="batched_mm", bind=qwen3_5.bound, detached=_hybrid_detached,
           note="Qwen3.5 / 3.6 MoE: Gated DeltaNet + gated attention + MoE with a shared expert; binds as Qwen3.5"),
    Family("glm_moe_dsa", _hf(T.GlmMoeDsaConfig, _DSA), experts="batched_mm", detached=_latent_detached,
           note="GLM-5: MLA + DSA indexer (top-k of 8 positions) + MoE; state: latent, rope key, index key "
                "(`passes/sparse_index.py`, `tests/passes/test_sparse_index.py`)"),
    Family("deepseek_v3 (MoE layers)", _hf(T.DeepseekV3Config, _MLA, first_k_dense_replace=1), experts="batched_mm",
           detached=_latent_detached, note="MLA + MoE: group-limited sigmoid router (a `scatter` marks the chosen groups), shared experts"),
    Family("deepseek_v2", _hf(T.DeepseekV2Config, _MLA, first_k_dense_replace=1, n_shared_experts=1),
           experts="batched_mm", detached=_latent_detached,
           note="MLA with complex rotary embeddings (`view_as_complex`), MoE with a shared expert"),
    Family("ministral3", _hf(T.Ministral3Config), note="Llama 4's position-dependent attention scale (`floor`)"),
    Family("llama4_text", _hf(T.Llama4TextConfig, num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=48,
                              interleave_moe_layer_step=1, attention_chunk_size=8),
           note="MoE through a drop-in that keeps the token axis apart from the expert axis (`models/llama4.py`); "
                "chunked attention (a chunk of 8 in a prompt of 21) as a positions-only mask, every prompt position "
                "kept; complex rotary embeddings and the `floor` of the attention scale have rules"),
    Family("mamba2", _hf(T.Mamba2Config, _NO_HEAD_DIM, num_heads=4, head_dim=16, expand=2, state_size=8, n_groups=1,
                         chunk_size=4), attn_implementation="eager", detached=_hybrid_detached, tol=MAMBA_TOL,
           note="No attention: the SSD scan and its convolution are the state (`longstraw.models.mamba2`)"),
    Family("mamba", _hf(T.MambaConfig, _MAMBA1), attn_implementation="eager", detached=_selective_scan_detached,
           tol=MAMBA_TOL,
           note="Mamba-1: the selective scan (as the SSD scan, a head per channel and state) and its convolution "
                "are the state (`longstraw.models.mamba`)"),
    Family("falcon_mamba", _hf(T.FalconMambaConfig, _MAMBA1), attn_implementation="eager",
           detached=_selective_scan_detached, tol=MAMBA_TOL,
           note="Mamba-1 with RMS-normed B, C and dt, as mamba"),
    Family("jamba", _hf(T.JambaConfig, num_experts=4, num_experts_per_tok=2, attn_layer_period=2, attn_layer_offset=1,
                        expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                        mamba_dt_rank=4, use_mamba_kernels=False),
           experts="batched_mm", detached=_selective_scan_detached, tol=MAMBA_TOL,
           note="Mamba-1 + attention layers, MoE every other layer"),
    Family("olmo_hybrid", _hf(T.OlmoHybridConfig, layer_types=["linear_attention", "full_attention"], pad_token_id=0,
                              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                              linear_value_head_dim=8),
           bind=qwen3_5.bound, detached=_hybrid_detached,
           note="OLMo Hybrid: Gated DeltaNet + attention layers; binds as Qwen3.5"),
    Family("gemma3n", _GEMMA3N,
           note="Gemma 3n text: AltUp, LAuReL, per-layer inputs, the last layers reusing earlier layers' K/V; "
                "eval mode (in train mode HF clamps AltUp's coefficients in place)"),
    Family("kimi_linear", _hf(T.KimiLinearConfig, _NO_HEAD_DIM, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None,
                              qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, moe_intermediate_size=16,
                              num_experts=4, num_experts_per_tok=2, linear_head_dim=8, linear_num_heads=4,
                              layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"],
                              pad_token_id=0, bos_token_id=1, eos_token_id=2),
           experts="batched_mm", detached=_kimi_detached, tol=MAMBA_TOL,
           note="Kimi Delta Attention (a decay per key channel: `longstraw::kimi_delta_rule`, "
                "`longstraw.models.kimi_linear`) + MLA layers (the latent and rope key) + MoE"),
    Family("nemotron_h", _hf(T.NemotronHConfig, head_dim=8, layers_block_type=["linear_attention", "full_attention", "mlp"],
                             ssm_state_size=8, mamba_num_heads=4, mamba_head_dim=16, n_groups=2, chunk_size=4,
                             moe_intermediate_size=16, moe_shared_expert_intermediate_size=16, use_mamba_kernels=False),
           detached=_hybrid_detached, tol=MAMBA_TOL, note="Mamba-2 + attention + MLP layers (Nemotron-H)"),
    Family("granitemoehybrid", _hf(T.GraniteMoeHybridConfig, _NO_HEAD_DIM, layer_types=["mamba", "attention"],
                                   num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=16,
                                   mamba_n_heads=4, mamba_n_groups=1, mamba_d_state=8, mamba_d_head=16,
                                   mamba_chunk_size=4), experts="batched_mm", detached=_hybrid_detached,
           tol=MAMBA_TOL, note="Granite 4.0-H: Mamba-2 + attention + MoE with a shared expert"),
    Family("falcon_h1", _hf(T.FalconH1Config, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=1,
                            mamba_d_state=8, mamba_chunk_size=4), detached=_hybrid_detached, tol=MAMBA_TOL,
           note="Mamba-2 and attention side by side in every layer"),
    Family("bamba", _hf(T.BambaConfig, _NO_HEAD_DIM, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16,
                        mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=4), detached=_hybrid_detached,
           tol=MAMBA_TOL, note="Mamba-2 + attention layers"),
    Family("zamba2", _hf(T.Zamba2Config, {k: v for k, v in _NO_HEAD_DIM.items() if k != "num_key_value_heads"},
                         layers_block_type=["mamba", "hybrid"], mamba_d_state=8, mamba_ngroups=1, n_mamba_heads=4,
                         mamba_headdim=16, chunk_size=4, num_key_value_heads=4, attention_head_dim=16,
                         use_mamba_kernels=False), detached=_hybrid_detached, tol=MAMBA_TOL,
           note="Mamba-2 layers and a shared attention block"),
    Family("lfm2", _hf(T.Lfm2Config, layer_types=["conv", "full_attention"]), detached=_hybrid_detached,
           note="Short convolution layers (`longstraw.models.lfm2`) + attention"),
    Family("lfm2_moe", _hf(T.Lfm2MoeConfig, layer_types=["conv", "full_attention"], num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=16, num_dense_layers=1),
           experts="batched_mm", detached=_hybrid_detached, note="LFM2 with MoE layers"),
    Family("gpt_bigcode", _hf(T.GPTBigCodeConfig, _GPT_SHAPES, n_positions=256, resid_pdrop=0, embd_pdrop=0,
                              attn_pdrop=0, bos_token_id=0, eos_token_id=0),
           note="multi-query attention: `c_attn(x).unsqueeze(1)` viewed as `[G, L, heads, d]` puts a size-1 factor "
                "into the positions, which the sequence axis leaves out"),
    Family("phimoe", _PHIMOE, experts="batched_mm", note="MoE, sparsemixer router in eval mode (top-2, deterministic)"),
    Family("gpt_oss", _GPT_OSS, attn_implementation="eager", experts="batched_mm", detached=_eager_attention_detached,
           note="Learned attention sinks over sliding (a 5-position window carried) and full layers (K/V per "
                "position), MoE; HF's eager attention as `longstraw::sink_attention` (`longstraw.models.sinks`)"),
    Family("mimo_v2_flash", _hf(T.MiMoV2FlashConfig, _NO_HEAD_DIM, head_dim=8, v_head_dim=4, sliding_window=6,
                                n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                layer_types=["full_attention", "sliding_attention"],
                                mlp_layer_types=["dense", "sparse"]),
           attn_implementation="eager", experts="batched_mm", detached=_eager_attention_detached,
           note="Sinks on its sliding layers only, twice their K/V heads, MoE; as gpt-oss (`longstraw.models.sinks`)"),
    Family("minimax", _hf(T.MiniMaxConfig, num_local_experts=4, num_experts_per_tok=2,
                          layer_types=["full_attention", "linear_attention"]), experts="batched_mm",
           detached=_hybrid_detached,
           note="Lightning attention (linear attention with a decay per head) as the SSD scan "
                "(`longstraw.models.minimax`), full attention, MoE"),
]

REFUSED = [
    Family("llama (eager attention)", _hf(T.LlamaConfig), refused=EAGER_ATTENTION, attn_implementation="eager",
           fix=_SDPA, note="Loaded with attn_implementation='eager': load it with 'sdpa' (`set_attn_implementation`)."),
    Family("gemma2", _hf(T.Gemma2Config, sliding_window=6), refused=EAGER_ONLY, attn_implementation="eager",
           note=f"Logit soft-capping: {_NO_SDPA}"),
    Family("gemma2 (flex attention)", _hf(T.Gemma2Config, sliding_window=6), attn_implementation="flex_attention",
           refused=r"^Dynamo broke the graph at flex_attention\.py:\d+ .*inside flex attention, which LongStraw does not "
                   r"claim: HF does not run `Gemma2PreTrainedModel` with SDPA.*" + re.escape(NO_FIX),
           note=f"Flex attention, which no pass claims: {_NO_SDPA}"),
    Family("gpt_oss (flex attention)", _GPT_OSS, attn_implementation="flex_attention", experts="batched_mm",
           refused=r"^Dynamo broke the graph at flex_attention\.py:\d+ .*inside flex attention, which LongStraw does not "
                   r"claim: load the model with attn_implementation='eager'",
           fix=Fix(model=lambda model: model.set_attn_implementation("eager")),
           note="Flex attention, which no pass claims: load it with 'eager', HF's default for gpt-oss, whose sink "
                "attention LongStraw runs."),
    Family("bloom", _hf(T.BloomConfig, _NO_HEAD_DIM, n_layer=2, n_head=4), refused=EAGER_ONLY,
           attn_implementation="eager", note=f"ALiBi attention: {_NO_SDPA}"),
    Family("gptj", _hf(T.GPTJConfig, _GPT_SHAPES, rotary_dim=4), refused=EAGER_ONLY,
           attn_implementation="eager", note=_NO_SDPA),
    Family("codegen", _hf(T.CodeGenConfig, _GPT_SHAPES, rotary_dim=4), refused=EAGER_ONLY,
           attn_implementation="eager", note=_NO_SDPA),
    Family("vaultgemma", _hf(T.VaultGemmaConfig, sliding_window=6, layer_types=["sliding_attention", "full_attention"]),
           refused=EAGER_ONLY, attn_implementation="eager", note=f"Logit soft-capping: {_NO_SDPA}"),
    Family("granite_swa", _hf(T.GraniteSWAConfig, sliding_window=6, layer_types=["full_attention", "sliding_attention"],
                              layer_rope_theta=[1e4, 1e4], bos_token_id=0, eos_token_id=0),
           refused=EAGER_ONLY, attn_implementation="eager", note=_NO_SDPA),
    Family("opt", _hf(T.OPTConfig, ffn_dim=48, word_embed_proj_dim=32, pad_token_id=1, dropout=0.0),
           refused=r"operator `cumsum` .* mixes values across sequence positions\. The model numbers positions itself"
                   r".*pass the position ids to the model, `position_ids=torch\.arange\(L\)\.expand\(G, -1\)`",
           fix=Fix(loss=_arange_positions_loss),
           note="Without position ids it numbers positions with a `cumsum` over the sequence, which no pass claims: "
                "pass `position_ids`."),
    Family("gemma3n (train mode)", _GEMMA3N, train=True,
           refused=r"clamp_.*writes in place into `model.model.layers.0.altup.prediction_coefs.weight`.*eval mode",
           fix=Fix(model=lambda model: model.eval()),
           note="In train mode HF clamps AltUp's coefficients in place (`prediction_coefs.weight.data.clamp_`): "
                "compile the loss with the model in eval mode."),
    Family("qwen3_moe (eager experts)", _hf(T.Qwen3MoeConfig, **_MOE), refused=DATA_DEPENDENT_ROUTING, fix=_BATCHED_MM,
           note=_ISSUE_MOE),
    Family("mixtral (eager experts)", _hf(T.MixtralConfig, num_local_experts=4, num_experts_per_tok=2),
           refused=DATA_DEPENDENT_ROUTING, fix=_BATCHED_MM, note=_ISSUE_MOE),
    Family("deepseek_v3 (MoE layers, eager experts)", _hf(T.DeepseekV3Config, _MLA, first_k_dense_replace=1),
           refused=DATA_DEPENDENT_ROUTING, fix=_BATCHED_MM, note=_ISSUE_MOE),
    Family("dbrx", _hf(T.DbrxConfig, dict(d_model=32, n_heads=4, n_layers=2, max_seq_len=256, vocab_size=64,
                                          initializer_range=0.2),
                       attn_config=dict(kv_n_heads=2, rope_theta=1e4, clip_qkv=8.0),
                       ffn_config=dict(ffn_hidden_size=48, moe_num_experts=4, moe_top_k=2)),
           refused=OWN_EXPERTS_LOOP, note=_OWN_LOOP),
    Family("jetmoe", _hf(T.JetMoeConfig, _NO_HEAD_DIM, kv_channels=8, num_local_experts=4, num_experts_per_tok=2),
           refused=OWN_EXPERTS_LOOP, note=_OWN_LOOP),
    Family("longcat_flash", _hf(T.LongcatFlashConfig, _MLA, q_lora_rank=12, head_dim=4, num_layers=2,
                                ffn_hidden_size=48, expert_ffn_hidden_size=16, moe_topk=2, zero_expert_num=2,
                                qk_head_dim=12),
           refused=OWN_EXPERTS_LOOP, note=_OWN_LOOP),
    Family("phimoe (train mode)", _PHIMOE, experts="batched_mm", train=True,
           refused=r"operator `exponential_` \(in place, node `\w+`\) in module `model\.model\.layers\.0\.mlp\."
                   r"router`.*draws random numbers.*call `\.eval\(\)` on every `PhimoeTopKRouter`",
           fix=Fix(model=_eval_routers),
           note="Its router samples experts in train mode (Gumbel noise; `router_jitter_noise` only sets a threshold): "
                "`.eval()` on the routers makes routing top-k."),
    Family("qwen3_next (unbound)", _hf(T.Qwen3NextConfig, **_MOE, linear_num_key_heads=2, linear_num_value_heads=4,
                                       linear_key_head_dim=8, linear_value_head_dim=8,
                                       layer_types=["linear_attention", "full_attention"]),
           experts="batched_mm", bind=qwen3_5.unbound, fix=_BOUND,
           refused=r"`Qwen3NextGatedDeltaNet` reaches LongStraw.s operators through `longstraw.models.qwen3_5`.*unbound\(\)",
           note="As Qwen3.5 unbound."),
    Family("qwen3_5 (unbound)", qwen3_5.tiny_config, bind=qwen3_5.unbound, fix=_BOUND,
           refused=r"`Qwen3_5GatedDeltaNet` reaches LongStraw.s operators through `longstraw.models.qwen3_5`.*unbound\(\)",
           note="HF's pure-PyTorch Gated DeltaNet loops over chunks; outside `qwen3_5.unbound()` LongStraw's operators "
                "stand in for it in every trace."),
]

FAMILIES = {f.name: f for f in SUPPORTED + REFUSED}

ROOT = Path(__file__).resolve().parents[2]
README, MODELS_DOC = ROOT / "README.md", ROOT / "docs" / "models.md"
_START, _END = "<!-- families:start -->", "<!-- families:end -->"


def family_table() -> str:
    """docs/models.md's table, from the registry: every family with its status and notes."""
    rows = ["| family | status | notes |", "|---|---|---|"]
    for f in SUPPORTED:
        rows.append(f"| {f.name} | supported | {f.note} |")
    for f in REFUSED:
        rows.append(f"| {f.name} | refused | {f.note} |")
    return "\n".join(rows)


def family_summary() -> str:
    """The README's short form of the table: the names, by status."""
    supported = ", ".join(f"`{f.name}`" for f in SUPPORTED)
    refused = ", ".join(f"`{f.name}`" for f in REFUSED)
    return (f"Supported ({len(SUPPORTED)}): {supported}.\n\n"
            f"Refused with a tested message ({len(REFUSED)}): {refused}.")


GENERATED = {README: family_summary, MODELS_DOC: family_table}


def generated_section(text: str) -> str:
    """What stands between a document's family markers."""
    _, start, rest = text.partition(_START)
    body, end, _ = rest.partition(_END)
    if not start or not end:
        raise ValueError(f"no {_START} ... {_END} section")
    return body.strip("\n")


if __name__ == "__main__":
    for path, render in GENERATED.items():
        text = path.read_text()
        head, _, rest = text.partition(_START)
        _, _, tail = rest.partition(_END)
        path.write_text(f"{head}{_START}\n{render()}\n{_END}{tail}")
        print(f"rewrote the families section of {path}", file=sys.stderr)
