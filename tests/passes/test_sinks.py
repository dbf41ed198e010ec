"""Attention with learned sinks: `passes/sinks.py` (`longstraw::sink_attention`
and its causal and sliding-window passes) and `models/sinks.py` (gpt-oss's and
MiMo-V2-Flash's eager attention routed to it).

The operator is HF's eager sink attention; the attention steps take the sink
into each row once all its keys are in (`attention_over_state.with_sinks`), the window
kernel as one more key. Float64 parity against eager HF in both modes, at two
shapes whose chunks do not divide the prompt (smaller and larger than the
window), with NaN-filled uninitialised memory and with padding; the state
the passes keep; controls that drop the sink or its gradient and must fail;
and what is refused.
"""

from __future__ import annotations

import types

import pytest
import torch
import transformers
from transformers.models.gpt_oss import modeling_gpt_oss
from transformers.models.mimo_v2_flash import modeling_mimo_v2_flash

import longstraw
from longstraw.errors import LongStrawError
from longstraw.passes import attention, sinks
from longstraw.runtime.kernels import attention_over_state
from longstraw.runtime.kernels import attention as attention_kernels

from conftest import raises_longstraw
from helpers.compare import assert_close, assert_grads_close, rel_err
from helpers.families import FAMILIES
from helpers.harness import assert_parity
from helpers.losses import coupled_loss, grpo_loss_f64
from helpers.padding import detached_reference as padded_detached_reference
from helpers.padding import padded_group, trl_grpo_loss
from helpers.parity import check_family, deterministic_algorithms
from helpers.published import explain_published
from helpers.reference import detached_at_eager_attention, detached_reference, eager_loss_and_grads
from helpers.tiny_models import make_group

TOL = 1e-6  # HF norms and RoPE round through float32
FAMILY_NAMES = ("gpt_oss", "mimo_v2_flash")
# (G, P, R, prefix_chunk_size, pad): the window is 6; chunks of 5 and 8 leave 3 prompt positions over
SHAPES = [(3, 13, 5, 5, True), (2, 19, 4, 8, False)]


def _hf_eager(q, k, v, mask, sink):
    """HF's eager attention with sinks (gpt-oss's), or without (MiMo-V2-Flash's full layers): [B, H, L, Dv]."""
    module = types.SimpleNamespace(sinks=sink, num_key_value_groups=q.shape[1] // k.shape[1], training=False)
    eager = modeling_gpt_oss if sink is not None else modeling_mimo_v2_flash
    out, _ = eager.eager_attention_forward(module, q, k, v, mask, q.shape[-1] ** -0.5)
    return out.transpose(1, 2)


def _masks(L: int, kind: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(the boolean mask, HF's eager mask of it) [2, 1, L, L]: causal, a window of 3, or causal with
    row 1 left-padded by 2 (its first two queries see no key)."""
    pos = torch.arange(L)
    allowed = (pos[:, None] >= pos[None, :]).expand(2, 1, L, L).clone()
    if kind == "window":
        allowed &= pos[:, None] - pos[None, :] < 3
    if kind == "padded":
        allowed[1, ..., :2] = False
    return allowed, torch.where(allowed, torch.zeros((), dtype=dtype), torch.finfo(dtype).min)


@pytest.mark.parametrize("kind", ["causal", "window", "padded"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("with_sinks", [True, False])
@pytest.mark.parametrize("boolean", [True, False])
def test_the_operator_is_hf_eager_sink_attention(kind, heads, kv_heads, with_sinks, boolean):
    """`longstraw::sink_attention` (the sink as one more key) against HF's
    eager softmax with the sink column, value and every gradient, sinks'
    included, for HF's float mask and the boolean one it is built from."""
    gen = torch.Generator().manual_seed(0)
    L, d, dv = 7, 8, 5
    q = torch.randn(2, heads, L, d, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, kv_heads, L, d, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, kv_heads, L, dv, generator=gen, dtype=torch.float64, requires_grad=True)
    sink = torch.randn(heads, generator=gen, dtype=torch.float64, requires_grad=True) if with_sinks else None
    grad_out = torch.randn(2, heads, L, dv, generator=gen, dtype=torch.float64)
    allowed, eager_mask = _masks(L, kind, torch.float64)
    inputs = [t for t in (q, k, v, sink) if t is not None]
    want = _hf_eager(q, k, v, eager_mask, sink)
    want_grads = torch.autograd.grad(want, inputs, grad_out)
    got = sinks.sink_attention(q, k, v, allowed if boolean else eager_mask, sink, 0.0, d ** -0.5, heads != kv_heads)
    if kind == "padded" and boolean and not with_sinks:
        # rows that see no key: HF's float mask averages every value, SDPA's boolean mask gives 0; with a
        # sink both give 0 (all the weight on the sink)
        torch.testing.assert_close(got[1, :, 2:], want[1, :, 2:], rtol=1e-12, atol=1e-12)
        return
    got_grads = torch.autograd.grad(got, inputs, grad_out)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_other_backends_trace_the_operator():
    """The substitution holds for every trace in the process: under
    AOTAutograd (`aot_eager`) the graph holds the operator, and its fake
    and autograd registrations give eager's loss and gradients."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from helpers.harness import compiled_loss_and_grads

    model = FAMILIES["gpt_oss"].build()
    group = make_group(2, 9, 4)
    targets = []

    def backend(gm, example_inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes)
        return aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g))(gm, example_inputs)

    got_loss, got = compiled_loss_and_grads(torch.compile(grpo_loss_f64, backend=backend), model, *group)
    want_loss, want = eager_loss_and_grads(grpo_loss_f64, model, *group)
    assert targets.count("longstraw.sink_attention.default") == 2
    assert_close(got_loss, want_loss, 1e-12, "loss")
    assert_grads_close(got, want, 1e-10)


def _blocked_sink_attention(q, keys, values, grad_out, sink, kernel):
    """Output and dQ, dK, dV, d(sinks) as `AttentionOverState` assembles them
    with sinks: the kernel's forward over all keys, the sink taken in once
    per row, the backward over key blocks with the row's output and log-sum-exp."""
    o = keys.shape[-2] - q.shape[-2]
    out, lse = attention_over_state.with_sinks(*kernel.forward(q, keys, values, None, None, o), sink)
    grad_q = torch.zeros(q.shape, dtype=attention_kernels.compute_dtype(q), device=q.device)
    grad_k, grad_v = torch.zeros_like(keys), torch.zeros_like(values)
    for start, length in kernel.blocks(q, o):
        kb, vb = keys.narrow(-2, start, length), values.narrow(-2, start, length)
        gq, gk, gv = kernel.backward(grad_out, q, kb, vb, out, lse, None, None, o, start)
        grad_q += gq
        grad_k.narrow(-2, start, length).add_(gk)
        grad_v.narrow(-2, start, length).add_(gv)
    return out, grad_q.to(q.dtype), grad_k, grad_v, attention_over_state.sink_grad(grad_out, out, lse, sink, True)


def _exact_sink_attention(q, keys, values, grad_out, sink):
    """Float64 autograd of HF's eager sink attention over the same inputs (queries the last keys, causal)."""
    exact = [t.double().requires_grad_() for t in (q, keys, values, sink)]
    n, total = q.shape[-2], keys.shape[-2]
    causal = torch.ones(n, total, dtype=torch.bool, device=q.device).tril(total - n)
    mask = torch.zeros(n, total, dtype=torch.float64, device=q.device).masked_fill(~causal, torch.finfo(torch.float64).min)
    want = _hf_eager(*exact[:3], mask, exact[3])
    return want, torch.autograd.grad(want, exact, grad_out.double())


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("earlier", [0, 7])
@pytest.mark.parametrize("block_scores", [1, 1 << 24])
def test_math_kernel_blocks_with_sinks_match_autograd(heads, kv_heads, earlier, block_scores, monkeypatch):
    """The step's sink arithmetic (`with_sinks`, `sink_grad`) over the math
    kernel's key blocks (one key a block, or all at once) is the eager sink
    softmax's value and gradients, the sinks' included."""
    monkeypatch.setattr(attention_kernels, "MATH_BLOCK_SCORES", block_scores)
    gen = torch.Generator().manual_seed(0)
    n, d = 5, 8
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    q, grad_out = rand(1, heads, n, d), rand(1, heads, n, d + 2)
    keys, values, sink = rand(1, kv_heads, earlier + n, d), rand(1, kv_heads, earlier + n, d + 2), rand(heads)
    want, want_grads = _exact_sink_attention(q, keys, values, grad_out, sink)
    out, *grads = _blocked_sink_attention(q, keys, values, grad_out, sink, attention_kernels.MATH)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["flash", "cudnn"])
@pytest.mark.parametrize("earlier", [0, 384])
def test_fused_kernel_blocks_with_sinks_match_float64(name, earlier, monkeypatch):
    """Flash's and cuDNN's log-sum-exp and block backward with the sinks, at
    gpt-oss's head shapes (64 query heads over 8 key heads of 64), against
    float64 autograd on the same bf16 inputs: within four times the error
    of the bf16 forward, the sinks' gradient too."""
    monkeypatch.setattr(attention_kernels, "FLASH_KEY_BLOCK", 128)
    kernel = attention_kernels.KERNELS[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    n, d = 256, 64
    rand = lambda *shape: torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q, grad_out = rand(1, 64, n, d), rand(1, 64, n, d)
    keys, values, sink = rand(1, 8, earlier + n, d), rand(1, 8, earlier + n, d), rand(64)
    want, want_grads = _exact_sink_attention(q, keys, values, grad_out, sink)
    with torch.no_grad():
        out, *grads = _blocked_sink_attention(q, keys, values, grad_out, sink, kernel)
    forward_error = (out.double() - want).abs().max() / want.abs().max()
    assert forward_error < 1e-2
    for got, expected in zip(grads, want_grads):
        error = (got.double() - expected).abs().max() / expected.abs().max()
        assert error < 4 * max(forward_error, 4e-3), (name, error, forward_error)


def _cuda_run(model, mode: str, group: tuple):
    """(loss, grads) of the compiled GRPO loss, or of its eager reference in `mode` when `model` is float64."""
    backend = longstraw.Backend(prompt_grad=mode, prefix_chunk_size=8, verify_state=True)
    if next(model.parameters()).dtype != torch.float64:
        from helpers.harness import compile_loss, compiled_loss_and_grads

        return compiled_loss_and_grads(compile_loss(grpo_loss_f64, backend), model, *group)
    if mode == "exact":
        return eager_loss_and_grads(grpo_loss_f64, model, *group)
    return detached_at_eager_attention(grpo_loss_f64, model, *group)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", ["exact", "detached"])
def test_cuda_matches_float64_eager(mode, dtype, caplog):
    """gpt-oss with heads of 64 on CUDA: in bf16 the full layers run the
    fused kernel SDPA's order picks (flash, or cuDNN where PyTorch puts it
    first) with the sink taken into its log-sum-exp, in float32 the
    math kernel. Every gradient is as close to float64 eager's as eager's
    own in that dtype (within four times its error, or 2e-2 in bf16)."""
    config = transformers.GptOssConfig(
        vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, sliding_window=6, layer_types=["sliding_attention", "full_attention"],
        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256, initializer_range=0.2)
    config._experts_implementation = "batched_mm"
    torch.manual_seed(0)
    exact = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").double().cuda().eval()
    low = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").to(dtype).cuda().eval()
    low.load_state_dict({k: v.to(dtype) for k, v in exact.state_dict().items()})
    group = tuple(t.cuda() for t in make_group(3, 40, 8))
    group = (*group[:2], *(t.to(dtype) for t in group[2:]))
    _, want = _cuda_run(exact, mode, tuple(t.double() if t.is_floating_point() else t for t in group))
    eager = eager_loss_and_grads if mode == "exact" else detached_at_eager_attention
    _, own = eager(grpo_loss_f64, low, *group)
    with caplog.at_level("DEBUG", logger="longstraw.attention"):
        _, got = _cuda_run(low, mode, group)
    fused = type(attention_kernels.choose(torch.empty(1, 4, 8, 64, device="cuda", dtype=torch.bfloat16), None)).__name__
    kernel = f"{fused} causal" if dtype == torch.bfloat16 else "MathKernel causal"  # SDPA's order: flash or cuDNN
    assert kernel in caplog.text
    floor = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for name in want:
        eager_error, error = rel_err(own[name], want[name]), rel_err(got[name], want[name])
        assert error <= 4 * max(eager_error, floor), (name, error, eager_error)


# CI: gpt-oss exact at the padded G3 shape (chunk 5 < window) and MiMo detached at chunk 8 > window; the other
# modes run in CI in test_step_options and test_padded_groups_match_eager (gpt-oss detached, MiMo exact; MiMo at
# G3-P13 in both modes in tests/models/test_families.py); `-m slow` the rest
FAMILIES_IN_CI = {("gpt_oss", "exact", SHAPES[0]), ("mimo_v2_flash", "detached", SHAPES[1])}


@pytest.mark.parametrize("name,mode,shape", [
    pytest.param(name, mode, shape, id="{}-{}-G{}-P{}-R{}-chunk{}".format(name, mode, *shape[:4]),
                 marks=[] if (name, mode, shape) in FAMILIES_IN_CI else [pytest.mark.slow])
    for name in FAMILY_NAMES for mode in ("exact", "detached") for shape in SHAPES
])
def test_families_match_eager_with_nan_filled_memory(name, mode, shape):
    check_family(name, mode, shape, deterministic=True)


# CI: each option once, the modes alternating (the sink's arithmetic in each mode is the family tests'); `-m slow`
# the other mode of each
STEP_OPTIONS_IN_CI = {("exact", "keep_graphs"), ("detached", "recompute_layers"),
                      ("exact", "attention_outputs_on_host")}


@pytest.mark.parametrize("mode,options", [
    pytest.param(mode, {option: True}, id=f"{mode}-{option}",
                 marks=[] if (mode, option) in STEP_OPTIONS_IN_CI else [pytest.mark.slow])
    for mode in ("exact", "detached") for option in ("keep_graphs", "recompute_layers", "attention_outputs_on_host")
])
def test_step_options(mode, options):
    """The sink's arithmetic through the steps' other paths: branch graphs
    kept for the backward, layer-wise recomputation, the capture's attention
    outputs kept on the host for the reverse pass."""
    model = FAMILIES["gpt_oss"].build()
    backend = longstraw.Backend(prompt_grad=mode, prefix_chunk_size=5, verify_state=True, **options)
    with deterministic_algorithms(True):
        assert_parity(grpo_loss_f64, backend, lambda *a: detached_at_eager_attention(grpo_loss_f64, *a), model,
                      *make_group(3, 17, 5, pad=True), tol=TOL)


def test_a_loss_whose_value_reads_the_model():
    """GRPO's loss is 1 in value whatever the logits; a coupled loss's is not."""
    model = FAMILIES["gpt_oss"].build()
    backend = longstraw.Backend(prefix_chunk_size=5, verify_state=True)
    assert_parity(coupled_loss, backend, None, model, *make_group(3, 17, 5, pad=True), tol=TOL)


# CI: each family once, each mode once (the same pass claims both families' layers here); `-m slow` the rest
@pytest.mark.parametrize("name,mode", [
    pytest.param("gpt_oss", "exact", marks=pytest.mark.slow), ("gpt_oss", "detached"),
    ("mimo_v2_flash", "exact"), pytest.param("mimo_v2_flash", "detached", marks=pytest.mark.slow),
])
def test_padded_groups_match_eager(name, mode):
    """TRL's left-padded prompt and right-padded completions: HF's eager mask
    then reads the padding mask, so no window is proved and every layer runs
    as causal attention with the mask's tiles (K/V per position)."""
    family = FAMILIES[name]
    model = family.build()
    backend = longstraw.Backend(prompt_grad=mode, prefix_chunk_size=8, verify_state=True)
    with deterministic_algorithms(True):
        assert_parity(trl_grpo_loss, backend, padded_detached_reference, model,
                      *padded_group(3, 33, 6, 7, [6, 1, 3], seed=1), tol=TOL)
    claims = backend.plans[-1].partition.claims.values()
    assert {type(p) for p in claims} == {sinks.SinkAttentionPass}


def _state(name: str):
    family = FAMILIES[name]
    model = family.build()
    return longstraw.explain(grpo_loss_f64, model, *make_group(2, 13, 4), options={"prefix_chunk_size": 5})


def test_layers_claimed_and_their_state():
    """gpt-oss (a window of 6, then full attention, 2 K/V heads of 8) and
    MiMo-V2-Flash (full attention without sinks, values of 4; then a
    window with sinks over twice the K/V heads): a window's layer carries
    its last 5 positions' keys, values and validity flags, a full layer
    keeps K and V per position; float64."""
    gpt = _state("gpt_oss")
    assert [type(p).__name__ for p in gpt.group_plan.partition.claims.values()] == [
        "SlidingSinkAttentionPass", "SinkAttentionPass"]
    assert gpt.state_fixed_bytes == 2 * 5 * (8 + 8 + 1) * 8
    assert gpt.state_bytes_per_position == 2 * 2 * 8 * 8
    mimo = _state("mimo_v2_flash")
    assert [type(p).__name__ for p in mimo.group_plan.partition.claims.values()] == [
        "SinkAttentionPass", "SlidingSinkAttentionPass"]
    assert mimo.state_fixed_bytes == 4 * 5 * (8 + 4 + 1) * 8
    assert mimo.state_bytes_per_position == 2 * (8 + 4) * 8


GPT_OSS_20B = dict(
    num_hidden_layers=24, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
    layer_types=["sliding_attention", "full_attention"] * 12,
    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "original_max_position_embeddings": 4096, "truncate": False},
)
"""gpt-oss-20b's published config where it differs from `GptOssConfig`'s defaults (gpt-oss-120b's shapes)."""


@pytest.mark.slow
def test_state_at_gpt_oss_20b():
    """gpt-oss-20b on the meta device, bf16: 12 full layers keep K and V
    (8 heads of 64) per position, 1,024 B each; 12 sliding layers carry
    their last 127 positions' keys, values and flags, 262,128 B each."""
    config = transformers.GptOssConfig(**GPT_OSS_20B)
    report = explain_published(transformers.GptOssForCausalLM, config, 512, 200, experts="batched_mm")
    full, sliding = config.layer_types.count("full_attention"), config.layer_types.count("sliding_attention")
    assert (full, sliding) == (12, 12)
    kv, d, w = config.num_key_value_heads, config.head_dim, config.sliding_window
    assert report.state_bytes_per_position == full * 2 * kv * d * 2 == 24_576
    assert report.state_fixed_bytes == sliding * kv * (w - 1) * (2 * d + 1) * 2 == 3_145_536



@pytest.mark.slow
def test_state_at_mimo_v2_flash():
    """`MiMoV2FlashConfig`'s defaults (the full-size shapes HF documents with
    XiaomiMiMo/MiMo-V2-Flash: 48 layers, 9 of full attention, 256 experts),
    on the meta device, bf16: 9 full layers keep keys of 192 and values of
    128 (4 heads) per position, 2,560 B each; 39 sliding layers (twice the
    K/V heads, sinks) carry their last 128 positions' keys, values and
    flags, 657,408 B each."""
    config = transformers.MiMoV2FlashConfig()
    report = explain_published(transformers.MiMoV2FlashForCausalLM, config, 512, 200, experts="batched_mm")
    full, sliding = config.layer_types.count("full_attention"), config.layer_types.count("sliding_attention")
    kv, d_k, d_v, w = config.num_key_value_heads, config.head_dim, config.v_head_dim, config.sliding_window
    assert (full, sliding, kv, d_k, d_v, w) == (9, 39, 4, 192, 128, 129)
    assert report.state_bytes_per_position == full * kv * (d_k + d_v) * 2 == 23_040
    assert report.state_fixed_bytes == sliding * 2 * kv * (w - 1) * (d_k + d_v + 1) * 2 == 25_638_912

def test_the_detached_reference_is_hf_cache_path():
    """The detached contract cut at HF's eager attention (the families'
    reference) is HF's cached prompt under no_grad, and differs from the
    exact gradients: the two modes are told apart."""
    model = FAMILIES["gpt_oss"].build()
    group = make_group(3, 13, 5)
    loss, grads = detached_at_eager_attention(grpo_loss_f64, model, *group)
    cached_loss, cached = detached_reference(model, *group)
    assert_close(loss, cached_loss, 1e-9, "loss")
    assert_grads_close(grads, cached, 1e-9)
    _, exact = eager_loss_and_grads(grpo_loss_f64, model, *group)
    assert max(rel_err(grads[n], exact[n]) for n in exact if exact[n] is not None) > 1e-2


def _drop_sink_in_windows(monkeypatch):
    attend = sinks.attend_with_sinks
    monkeypatch.setattr(sinks, "attend_with_sinks", lambda q, k, v, mask, sink, *rest: attend(q, k, v, mask, None, *rest))


def _count_sink_twice(monkeypatch):
    once = attention_over_state.with_sinks
    monkeypatch.setattr(attention_over_state, "with_sinks", lambda out, lse, sink: once(*once(out, lse, sink), sink))


CONTROLS = {  # (the change, the failure: GRPO's loss value is 1 whatever the model, its gradients tell)
    "sink counted twice in full layers": (_count_sink_twice,
                                          r"(?s)gradients differ.*layers\.1\.self_attn\.sinks: relative error"),
    "sink dropped in full layers": (lambda mp: mp.setattr(attention_over_state, "with_sinks", lambda out, lse, sink: (out, lse)),
                                    r"(?s)gradients differ.*layers\.1\.self_attn\.sinks: relative error"),
    "sink dropped in windows": (_drop_sink_in_windows,
                                r"(?s)gradients differ.*layers\.0\.self_attn\.sinks: got None, want a grad"),
    "no sinks gradient": (lambda mp: mp.setattr(attention_over_state, "sink_grad", lambda out, *a: torch.zeros(4, dtype=out.dtype)),
                          r"(?s)gradients differ \(tol [^)]*\):\n  model\.layers\.1\.self_attn\.sinks: relative error [^\n]*$"),
}


# CI: each control in one mode, two in each (the reference differs by mode, not the sink's arithmetic); `-m slow`
# the other mode of each
CONTROLS_IN_CI = {("sink counted twice in full layers", "exact"), ("sink dropped in full layers", "detached"),
                  ("sink dropped in windows", "exact"), ("no sinks gradient", "detached")}


@pytest.mark.parametrize("control,mode", [
    pytest.param(control, mode, id=f"{control}-{mode}",
                 marks=[] if (control, mode) in CONTROLS_IN_CI else [pytest.mark.slow])
    for control in CONTROLS for mode in ("exact", "detached")
])
def test_controls_that_lose_the_sink_fail(control, mode, monkeypatch):
    """The parity check has the power to see the sink: counted twice or
    not at all in the full layers' steps, left out of the windows' kernel,
    or without its gradient, gpt-oss no longer matches eager."""
    change, failure = CONTROLS[control]
    change(monkeypatch)
    with pytest.raises(AssertionError, match=failure):
        check_family("gpt_oss", mode, SHAPES[0], deterministic=False)


def test_attention_dropout_is_refused():
    """In train mode HF drops attention probabilities at random; the steps would draw other ones."""
    family = FAMILIES["gpt_oss"]
    model = family.build()
    model.config.attention_dropout = 0.1
    model.train()
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.1
    compiled = torch.compile(grpo_loss_f64, backend=longstraw.Backend(prefix_chunk_size=4))
    with raises_longstraw(r"attention dropout \(dropout_p=0\.1\) is not replayed; put the model in eval mode"):
        compiled(model, *make_group(2, 7, 3))


class SinkLayer(torch.nn.Module):
    """An embedding, one `longstraw::sink_attention` and a head; `mask`: the
    mask built from positions (`causal` boolean, `window` of 3, `eager`:
    HF's float form of causal, `alibi`: a float bias, `none`)."""

    def __init__(self, mask: str, with_sinks: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mask = mask
        self.embed = torch.nn.Embedding(64, 16)
        self.q, self.k, self.v = torch.nn.Linear(16, 16), torch.nn.Linear(16, 8), torch.nn.Linear(16, 8)
        self.sinks = torch.nn.Parameter(torch.randn(4)) if with_sinks else None
        self.head = torch.nn.Linear(16, 64)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        b, n, _ = x.shape
        q = self.q(x).view(b, n, 4, 4).transpose(1, 2)
        k, v = (p(x).view(b, n, 2, 4).transpose(1, 2) for p in (self.k, self.v))
        pos = torch.arange(n, device=x.device)
        rows, columns = pos[None, None, :, None], pos[None, None, None, :]
        causal = rows >= columns
        masks = {
            "causal": causal,
            "window": causal & (rows - columns < 3),
            "eager": torch.where(causal, torch.zeros((), dtype=x.dtype), torch.finfo(x.dtype).min),
            "alibi": torch.where(causal, (columns - rows).to(x.dtype), torch.finfo(x.dtype).min),
            "none": None,
        }
        out = sinks.sink_attention(q, k, v, masks[self.mask], self.sinks, 0.0, 0.5, True)
        return self.head(x + out.transpose(1, 2).reshape(b, n, 16))


@pytest.mark.parametrize("mode", ["exact", "detached"])
@pytest.mark.parametrize("mask,with_sinks,claimed", [
    ("causal", True, sinks.SinkAttentionPass),
    ("eager", True, sinks.SinkAttentionPass),
    ("window", True, sinks.SlidingSinkAttentionPass),
    ("window", False, sinks.SlidingSinkAttentionPass),
])
def test_the_operator_outside_hf(mask, with_sinks, claimed, mode):
    """The operator called directly: a boolean mask, HF's float form of it,
    a window with and without sinks, each claimed by its pass and matching
    eager (the operator's own autograd) in both modes."""
    model = SinkLayer(mask, with_sinks).double()
    group = make_group(3, 11, 4)
    backend = longstraw.Backend(prompt_grad=mode, prefix_chunk_size=4, verify_state=True)

    def detached(model, prompt, responses, advantages, mask):
        """The operator's keys and values at prompt positions 0..P-2 constants."""
        cut = prompt.shape[0] - 1
        original = sinks.attend_with_sinks

        def constant_prefix(q, k, v, *rest):
            keep = lambda x: torch.cat([x[..., :cut, :].detach(), x[..., cut:, :]], -2)  # noqa: E731
            return original(q, keep(k), keep(v), *rest)

        sinks.attend_with_sinks = constant_prefix
        try:
            return eager_loss_and_grads(grpo_loss_f64, model, prompt, responses, advantages, mask)
        finally:
            sinks.attend_with_sinks = original

    with deterministic_algorithms(True):
        assert_parity(grpo_loss_f64, backend, detached, model, *group, tol=1e-10)
    assert [type(p) for p in backend.plans[-1].partition.claims.values()] == [claimed]


@pytest.mark.parametrize("mask,message", [
    ("alibi", r"neither boolean nor HF's eager mask `where\(mask, 0, finfo\.min\)`"),
    ("none", "attention without a mask lets earlier positions see later ones"),
])
def test_masks_that_are_not_proved_are_refused(mask, message):
    compiled = torch.compile(grpo_loss_f64, backend=longstraw.Backend(prefix_chunk_size=4))
    with raises_longstraw(message):
        compiled(SinkLayer(mask).double(), *make_group(2, 7, 3))


def test_context_parallelism_with_sinks_is_refused():
    """Context parallelism merges the ranks' partial attention by their
    log-sum-exp, without the sink: the step refuses, naming the layer."""
    from torch import fx

    from longstraw.analysis.slots import SlotKind, StateSlot
    from longstraw.parallel.ranks import SimulatedRanks
    from longstraw.parallel.shards import PromptShard
    from longstraw.runtime.prompt_state import PromptState, StepContext

    node = fx.Graph().placeholder("keys")
    slot = StateSlot(0, SlotKind.SEQUENCE, node, token_dim=2, batch_dim=0, shape=(1, 2, 8, 4), dtype=torch.float64,
                     reason="sink_attention:keys")
    state = PromptState([slot], capacity=10, prefix_len=8, device=torch.device("cpu"),
                        shard=PromptShard(SimulatedRanks(1, 2), (((0, 2), (6, 2)), ((2, 2), (4, 2)))))
    q, kv = torch.zeros(1, 2, 2, 4, dtype=torch.float64), torch.zeros(1, 2, 2, 4, dtype=torch.float64)
    with pytest.raises(LongStrawError, match="context parallelism: the attention over .*sink_attention.* has learned sinks"):
        attention.attention_step(StepContext(state, 8, 2, grad_enabled=False), q, kv, kv, mask=None, k_slot=0,
                                 v_slot=0, scale=None, enable_gqa=False, sinks=torch.zeros(2, dtype=torch.float64))
