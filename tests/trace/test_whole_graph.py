"""Losses the backend cannot split fail with the real cause, not with what
the analysis of a piece of them tripped over (longstraw/trace/whole_graph.py and
the messages of partition.py and specialize.py): graph breaks name Dynamo's
reason, the file:line and the loss; models whose attention LongStraw does
not claim say which implementation to load; two sequences name both
attention nodes. `on_unsupported="eager"` runs such graphs as eager does."""

from __future__ import annotations

import inspect
import re

import pytest
import torch
import transformers
from torch import nn
from torch.nn.attention.flex_attention import flex_attention

import longstraw

from conftest import raises_longstraw
from helpers.compare import assert_close, assert_grads_close, grads_equal
from helpers.harness import compile_loss, compiled_loss_and_grads
from helpers.losses import grpo_loss_f64, logits_of, pg_tail
from helpers.reference import eager_loss_and_grads, grads_of, seed_grads
from helpers.tiny_models import _HF_SHAPES, VOCAB, make_group, make_model


def line_of(fn, text: str) -> int:
    """The line of `fn`'s source that contains `text` (exactly one)."""
    lines, start = inspect.getsourcelines(fn)
    (offset,) = [i for i, line in enumerate(lines) if text in line]
    return start + offset


def run_and_backward(compiled, model, *args):
    compiled(model, *args).backward()


# --- graph breaks -------------------------------------------------------------------


def item_before_model_loss(model, prompt, responses, advantages, mask):
    """Skip groups without signal, decided in Python on a computed value."""
    if advantages.abs().sum().item() == 0.0:
        return torch.zeros((), dtype=torch.float64)
    return grpo_loss_f64(model, prompt, responses, advantages, mask)


def item_after_model_loss(model, prompt, responses, advantages, mask):
    """Rescale the logits when they are large, decided in Python."""
    ids = torch.cat([prompt.expand(responses.shape[0], -1), responses], dim=1)
    logits = logits_of(model(input_ids=ids))[:, prompt.shape[0] - 1 : -1]
    if logits.abs().max().item() > 1e6:
        logits = logits / 1e6
    return pg_tail(logits, responses, advantages, mask)


def print_loss(model, prompt, responses, advantages, mask):
    ids = torch.cat([prompt.expand(responses.shape[0], -1), responses], dim=1)
    print("running a group of", ids.shape)
    logits = logits_of(model(input_ids=ids))[:, prompt.shape[0] - 1 : -1]
    return pg_tail(logits, responses, advantages, mask)


@torch.compiler.disable
def log_stats(ids):
    return ids.shape


def disabled_call_loss(model, prompt, responses, advantages, mask):
    ids = torch.cat([prompt.expand(responses.shape[0], -1), responses], dim=1)
    log_stats(ids)
    logits = logits_of(model(input_ids=ids))[:, prompt.shape[0] - 1 : -1]
    return pg_tail(logits, responses, advantages, mask)


BREAKS = {
    # loss -> (the line that breaks, Dynamo's reason)
    item_before_model_loss: (".item() == 0.0", r"Unsupported Tensor\.item\(\) call"),
    item_after_model_loss: (".item() > 1e6", r"Unsupported Tensor\.item\(\) call"),
    print_loss: ("print(", r"Failed to trace builtin operator.*`print`"),
    disabled_call_loss: ("log_stats(ids)", r"Skip calling `torch\.compiler\.disable\(\)`d function"),
}


@pytest.mark.parametrize("loss_fn", list(BREAKS), ids=lambda f: f.__name__)
def test_graph_break_is_named(loss_fn):
    """The message starts with the graph break: Dynamo's reason, the file:line
    and the loss function, whichever piece of the loss fails first (the
    piece before the break, or the rest after it)."""
    text, reason = BREAKS[loss_fn]
    model = make_model("plain")
    before = seed_grads(model)
    compiled = compile_loss(loss_fn, longstraw.Backend(prefix_chunk_size=4))
    name, line = loss_fn.__name__, line_of(loss_fn, text)
    expected = (
        rf"^(this graph is the rest of a function after a graph break \(`torch_dynamo_resume_in_{name}_at_{line}`\): )?"
        rf"Dynamo broke the graph at test_whole_graph\.py:{line} \({name}\): {reason}.*fullgraph=True"
    )
    with raises_longstraw(expected):
        run_and_backward(compiled, model, *make_group(2, 9, 4))
    assert grads_equal(grads_of(model), before)


class UntracedForward(nn.Module):
    """A wrapper whose forward Dynamo does not trace but whose callees it
    compiles, as with DDP's forward: the loss breaks at the call and the
    model's forward is compiled on its own."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    @torch.compiler.disable(recursive=False)
    def forward(self, input_ids):
        return self.module(input_ids=input_ids)


def ids_loss(model, input_ids, responses, advantages, mask):
    """TRL's shape: the trainer builds `[prompt; response]` ids outside the loss."""
    prompt_len = input_ids.shape[1] - responses.shape[1]
    logits = logits_of(model(input_ids))[:, prompt_len - 1 : -1]
    return pg_tail(logits, responses, advantages, mask)


def test_model_compiled_on_its_own_inside_the_loss():
    model = make_model("plain")
    prompt, responses, advantages, mask = make_group(2, 9, 4)
    ids = torch.cat([prompt.expand(2, -1), responses], dim=1)
    before = seed_grads(model)
    compiled = compile_loss(ids_loss, longstraw.Backend(prefix_chunk_size=4))
    expected = (
        rf"^this graph is `forward`, compiled on its own because the compiled function `ids_loss` "
        rf"\(test_whole_graph\.py:{inspect.getsourcelines(ids_loss)[1]}\) broke the graph where it calls it"
    )
    with raises_longstraw(expected) as info:
        run_and_backward(compiled, UntracedForward(model), ids, responses, advantages, mask)
    assert "DDP" in str(info.value) and "fullgraph=True" in str(info.value)
    assert grads_equal(grads_of(model), before)


def list_advantages_loss(model, prompt, responses, advantages, mask):
    """`advantages` arrives as a Python list: `advantages[:, None]` raises in eager."""
    logits = logits_of(model(input_ids=torch.cat([prompt.expand(responses.shape[0], -1), responses], dim=1)))
    logp = torch.log_softmax(logits[:, prompt.shape[0] - 1 : -1], -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    return -((logp * advantages[:, None]) * mask).sum() / mask.sum()


@pytest.mark.parametrize("kind", ["plain", "qwen3"])
def test_a_bug_in_the_loss_shows_the_error_eager_raises(kind):
    """Dynamo gives up on a loss that raises while traced, runs it
    uncompiled and hands over the model's forward alone: the message says
    so first, with the exception eager raises."""
    model = make_model(kind)
    prompt, responses, advantages, mask = make_group(2, 9, 4)
    with pytest.raises(TypeError, match="list indices must be integers or slices, not tuple") as eager:
        list_advantages_loss(model, prompt, responses, advantages.tolist(), mask)
    before = seed_grads(model)
    compiled = compile_loss(list_advantages_loss, longstraw.Backend(prefix_chunk_size=4))
    expected = (
        rf"^Dynamo could not trace the compiled function `list_advantages_loss` \(test_whole_graph\.py:"
        rf"{inspect.getsourcelines(list_advantages_loss)[1]}\): the loss raises {re.escape(repr(eager.value))} in "
        r"eager too\. Dynamo then runs `list_advantages_loss` uncompiled and hands LongStraw only `\w+`, which it "
        r"calls, so this graph is not the loss\. Fix the loss as you would in eager"
    )
    with raises_longstraw(expected):
        run_and_backward(compiled, model, prompt, responses, advantages.tolist(), mask)
    assert grads_equal(grads_of(model), before)


def test_nested_torch_compile_is_inlined():
    """A torch.compile'd function called inside the compiled loss is traced
    into the loss's graph (its own backend is not used): one plan, eager's
    gradients."""
    model = make_model("plain")

    def forward_logits(m, ids):
        return logits_of(m(input_ids=ids))

    inner = torch.compile(forward_logits, backend="eager")

    def loss_with(run):
        def loss(model, prompt, responses, advantages, mask):
            ids = torch.cat([prompt.expand(responses.shape[0], -1), responses], dim=1)
            return pg_tail(run(model, ids)[:, prompt.shape[0] - 1 : -1], responses, advantages, mask)

        return loss

    args = make_group(3, 11, 4)
    backend = longstraw.Backend(prefix_chunk_size=4)
    got = compiled_loss_and_grads(compile_loss(loss_with(inner), backend), model, *args)
    want = eager_loss_and_grads(loss_with(forward_logits), model, *args)
    assert len(backend.plans) == 1 and backend.plans[-1].prefix_len == 10
    assert_close(got[0], want[0], 1e-9, "loss")
    assert_grads_close(got[1], want[1], 1e-9)


# --- attention LongStraw does not claim ----------------------------------------------


def hf_qwen3(attn_implementation: str) -> nn.Module:
    config = transformers.Qwen3Config(
        vocab_size=VOCAB, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        attn_implementation=attn_implementation, **_HF_SHAPES,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).to(torch.float64)
    assert model.config._attn_implementation == attn_implementation
    return model


def test_hf_eager_attention_says_load_sdpa():
    model = hf_qwen3("eager")
    before = seed_grads(model)
    compiled = compile_loss(grpo_loss_f64, longstraw.Backend(prefix_chunk_size=4))
    with raises_longstraw(r"softmax.*attn_implementation='eager'.*load the model with attn_implementation='sdpa'") as info:
        run_and_backward(compiled, model, *make_group(2, 9, 4))
    assert re.search(r"layers\.0\.self_attn.*modeling_qwen3\.py:\d+ \(eager_attention_forward\)", str(info.value))
    assert grads_equal(grads_of(model), before)


def test_hf_flex_attention_says_load_sdpa():
    """HF's flex path breaks the graph in `create_block_mask` (it passes the
    deprecated `_compile=True`, whose warning Dynamo cannot trace) before
    any flex_attention node is recorded: the break is named, and so is the fix."""
    model = hf_qwen3("flex_attention")
    before = seed_grads(model)
    compiled = compile_loss(grpo_loss_f64, longstraw.Backend(prefix_chunk_size=4))
    with raises_longstraw(r"^Dynamo broke the graph at flex_attention\.py:\d+ \(create_block_mask\), called from "
                          r"losses\.py:\d+ \(grpo_loss_f64\): .*flex attention.*attn_implementation='sdpa'"):
        run_and_backward(compiled, model, *make_group(2, 9, 4))
    assert grads_equal(grads_of(model), before)


def causal_score(score, b, h, q_idx, kv_idx):
    return torch.where(q_idx >= kv_idx, score, -float("inf"))


class FlexLM(nn.Module):
    """One causal flex-attention layer. Flex attention has no backward on the
    CPU (Dynamo refuses to trace it with inputs that require grad), so the
    test runs it under no_grad."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.qkv = nn.Linear(16, 48)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids):
        q, k, v = self.qkv(self.embed(input_ids)).unsqueeze(1).chunk(3, dim=-1)  # [B, 1, L, 16] each
        return self.head(flex_attention(q, k, v, score_mod=causal_score).squeeze(1))


def test_flex_attention_operator_says_load_sdpa():
    """flex_attention traced in the graph (with the `vmap` that builds its
    block mask): the flex_attention node is named, with the fix."""
    torch.manual_seed(0)
    model = FlexLM().double()
    compiled = compile_loss(grpo_loss_f64, longstraw.Backend(prefix_chunk_size=4))
    with raises_longstraw(r"^operator `flex_attention`.*is flex attention, which no pass claims: load the model "
                          r"with attn_implementation='sdpa'"):
        with torch.no_grad():
            compiled(model, *make_group(2, 9, 4))


class MLPOnlyLM(nn.Module):
    """Every position on its own: nothing to share between responses."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        return self.head(x + self.mlp(x))


class CumsumLM(MLPOnlyLM):
    """Positions mix only through a running sum, which no pass claims."""

    def forward(self, input_ids):
        x = self.embed(input_ids)
        x = x + torch.cumsum(x, dim=1) / input_ids.shape[1]
        return self.head(x + self.mlp(x))


@pytest.mark.parametrize(
    "model_cls, expected",
    [
        (MLPOnlyLM, r"^no attention \(or other position-mixing operator claimed by a pass\) found"),
        (CumsumLM, r"^operator `cumsum` \(node `cumsum`\).*test_whole_graph\.py:\d+ \(forward\) mixes sequence "
                   r"positions, and no attention or other operator a pass claims was found"),
    ],
    ids=["mlp_only", "cumsum_only"],
)
def test_no_claimed_operator(model_cls, expected):
    torch.manual_seed(0)
    model = model_cls().double()
    before = seed_grads(model)
    compiled = compile_loss(grpo_loss_f64, longstraw.Backend(prefix_chunk_size=4))
    with raises_longstraw(expected):
        run_and_backward(compiled, model, *make_group(2, 9, 4))
    assert grads_equal(grads_of(model), before)


def vmap_loss(model, prompt, responses, advantages, mask):
    """Per-response mean log-prob written with torch.vmap."""
    ids = torch.cat([prompt.expand(responses.shape[0], -1), responses], dim=1)
    logits = logits_of(model(input_ids=ids))[:, prompt.shape[0] - 1 : -1]
    logp = torch.log_softmax(logits, -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    per_response = torch.vmap(lambda lp, m: (lp * m).sum() / m.sum())(logp, mask)
    return -(per_response * advantages).mean()


def test_vmap_is_refused_by_name():
    model = make_model("plain")
    before = seed_grads(model)
    compiled = compile_loss(vmap_loss, longstraw.Backend(prefix_chunk_size=4))
    with raises_longstraw(r"^operator `_vmap_increment_nesting`.*enters a functorch transform"):
        run_and_backward(compiled, model, *make_group(2, 9, 4))
    assert grads_equal(grads_of(model), before)


# --- two sequences ---------------------------------------------------------------------


def kl_to(reference: nn.Module, ref_ids, ref_start: int):
    """A loss with a KL term to `reference` run over `ref_ids(prompt, responses)`,
    whose logits for the responses start at position `ref_start(prompt)`."""

    def loss(model, prompt, responses, advantages, mask):
        ids = torch.cat([prompt.expand(responses.shape[0], -1), responses], dim=1)
        logp = torch.log_softmax(logits_of(model(input_ids=ids))[:, prompt.shape[0] - 1 : -1], -1)
        with torch.no_grad():
            start = ref_start(prompt)
            ref = torch.log_softmax(logits_of(reference(input_ids=ref_ids(prompt, responses)))[:, start:-1], -1)
        kl = (logp.exp() * (logp - ref)).sum(-1)
        taken = logp.gather(-1, responses.unsqueeze(-1)).squeeze(-1)
        return -((taken * advantages[:, None]) * mask).sum() / mask.sum() + 0.1 * (kl * mask).sum() / mask.sum()

    return loss


def test_two_sequences_name_both_attention_nodes():
    """The reference model sees only the last 4 prompt tokens: its positions
    are another axis than the policy's."""
    model, reference = make_model("plain"), make_model("plain", seed=1)
    short = kl_to(reference, lambda p, r: torch.cat([p[-4:].expand(r.shape[0], -1), r], dim=1), lambda p: 3)
    before = seed_grads(model)
    compiled = compile_loss(short, longstraw.Backend(prefix_chunk_size=4))
    with raises_longstraw(r"two different sequences") as info:
        run_and_backward(compiled, model, *make_group(2, 9, 4))
    message = str(info.value)
    assert re.search(
        r"^operator `scaled_dot_product_attention` \(node `\w+`\) in module `model\.blocks\.0\.attn`.* and operator "
        r"`scaled_dot_product_attention` \(node `\w+`\) in module `\S*reference\.blocks\.0\.attn`", message
    ), message
    assert "Build the input ids once" in message
    assert grads_equal(grads_of(model), before)


def test_two_sequences_along_one_axis_are_shared():
    """A reference model over reversed responses after the same prompt: the
    same positions, two inputs whose rows share the prompt. Exact gradients."""
    model, reference = make_model("plain"), make_model("plain", seed=1)
    flipped = kl_to(
        reference, lambda p, r: torch.cat([p.expand(r.shape[0], -1), r.flip(1)], dim=1), lambda p: p.shape[0] - 1
    )
    args = make_group(3, 11, 4)
    backend = longstraw.Backend(prefix_chunk_size=4)
    got = compiled_loss_and_grads(compile_loss(flipped, backend), model, *args)
    want = eager_loss_and_grads(flipped, model, *args)
    assert len(backend.plans[-1].partition.roots) == 2 and backend.plans[-1].prefix_len == 10
    assert_close(got[0], want[0], 1e-9, "loss")
    assert_grads_close(got[1], want[1], 1e-9)


# --- on_unsupported="eager" -------------------------------------------------------------


def inplace_loss(model, prompt, responses, advantages, mask):
    """Clips the caller's advantages in place: refused while specialising."""
    advantages.clamp_(-0.5, 0.5)
    return grpo_loss_f64(model, prompt, responses, advantages, mask)


@pytest.mark.parametrize(
    "case",
    ["hf_eager_attention", "item_after_model", "vmap", "inplace_argument"],
)
def test_on_unsupported_eager_runs_eager(case):
    """Each of these graphs is refused by default (see above); with
    on_unsupported='eager' the loss runs unchanged with a warning and gives
    eager's loss and gradients."""
    loss_fn, model, tol = {
        "hf_eager_attention": (grpo_loss_f64, hf_qwen3("eager"), 1e-6),
        "item_after_model": (item_after_model_loss, make_model("plain"), 1e-9),
        "vmap": (vmap_loss, make_model("plain"), 1e-9),
        "inplace_argument": (inplace_loss, make_model("plain"), 1e-9),
    }[case]
    args = make_group(2, 9, 4)
    backend = longstraw.Backend(prefix_chunk_size=4, on_unsupported="eager")
    compiled = compile_loss(loss_fn, backend)
    with pytest.warns(UserWarning, match="running the loss graph unchanged"):
        got = compiled_loss_and_grads(compiled, model, *[a.clone() for a in args])
    (fallback,) = backend.fallbacks  # the record the warning announced
    kind, node = {"hf_eager_attention": ("unsupported", "softmax"), "item_after_model": ("partial_graph", None),
                  "vmap": ("unsupported", None), "inplace_argument": ("unsupported", None)}[case]
    assert (fallback.kind, fallback.node) == (kind, node)
    assert fallback.module == ("model.model.layers.0.self_attn" if node else None)
    want = eager_loss_and_grads(loss_fn, model, *[a.clone() for a in args])
    assert_close(got[0], want[0], tol, "loss")
    assert_grads_close(got[1], want[1], tol)


def test_a_lora_adapter_on_expert_weights_names_the_modules_to_target():
    """PEFT's "all-linear" reaches a mixture of experts' 3-D expert weights,
    which it wraps with a parametrization Dynamo does not trace: the refusal
    says so, and its advice (name the attention projections) compiles to
    eager's gradients."""
    import peft

    from helpers.families import FAMILIES

    group = make_group(3, 11, 4, pad=True)
    adapted = peft.get_peft_model(FAMILIES["qwen3_moe"].build(),
                                  peft.LoraConfig(r=2, target_modules="all-linear", init_lora_weights=False))
    with raises_longstraw(r"torch\.nn\.utils\.parametrize, which PEFT uses for a LoRA adapter on a parameter it "
                          r"wraps directly .* `target_modules=\[\"q_proj\", \"k_proj\", \"v_proj\", \"o_proj\"\]`"):
        compile_loss(grpo_loss_f64, longstraw.Backend())(adapted, *group)
    torch._dynamo.reset()
    advised = peft.get_peft_model(FAMILIES["qwen3_moe"].build(), peft.LoraConfig(
        r=2, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False))
    got_loss, got = compiled_loss_and_grads(compile_loss(grpo_loss_f64, longstraw.Backend(verify_state=True)), advised,
                                            *group)
    want_loss, want = eager_loss_and_grads(grpo_loss_f64, advised, *group)
    assert_close(got_loss, want_loss, 1e-6, "loss")
    assert_grads_close(got, want, 1e-6)
