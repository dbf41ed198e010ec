"""In-place writes in the loss graph (longstraw/trace/functionalize.py): every
write becomes a pure node, every later read of the written storage (through
the same node or any view of it) sees the write, and a write the caller
would see is refused with the operator and what to do.

Unit tests run Dynamo's graph of a small function through `specialize`
(which records FakeTensor values and functionalises) and compare the
rewritten graph on real tensors with the function run eagerly; end to end,
a decoder whose keys are built as HF DeepSeek-V3's `expand_kv` does
(`new_empty` and two slice `copy_`) is compiled against eager, also with
uninitialised memory filled with NaN (deterministic algorithms)."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import longstraw
from longstraw.trace.functionalize import functionalize, is_updated, updated
from longstraw.trace.specialize import specialize

from conftest import raises_longstraw
from helpers.compare import assert_close, assert_grads_close
from helpers.harness import compile_loss, compiled_loss_and_grads
from helpers.losses import grpo_loss_f64, pg_loss, pg_tail
from helpers.plain_transformer import PlainConfig, apply_rope, make_plain
from helpers.reference import detached_reference, eager_loss_and_grads
from helpers.tiny_models import make_group, make_model

_IN_PLACE_OPERATORS = {
    operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift,
}


def writes(gm: fx.GraphModule) -> list[fx.Node]:
    """Nodes that write in place, told by their target alone: `setitem` and
    the augmented assignments, `name_` methods and functions, `out=` and
    `inplace=True` calls."""
    found = []
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_method"):
            continue
        name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
        trailing = name.endswith("_") and not name.startswith("_") and name != "requires_grad_"
        if n.target in _IN_PLACE_OPERATORS or trailing or "out" in n.kwargs or n.kwargs.get("inplace") is True:
            found.append(n)
    return found


def dynamo_graph(fn, *args) -> tuple[fx.GraphModule, list]:
    """The one graph Dynamo captures for `fn(*args)`, and its example inputs."""
    torch._dynamo.reset()
    graphs = []

    def capture(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch.compile(fn, backend=capture, fullgraph=True)(*args)
    assert len(graphs) == 1
    return graphs[0]


def outputs(value) -> tuple:
    return value if isinstance(value, (tuple, list)) else (value,)


def check_functionalized(fn, *args):
    """`specialize` removes every write of Dynamo's graph of `fn`, and the
    rewritten graph computes what `fn` computes eagerly, bit for bit."""
    gm, example_inputs = dynamo_graph(fn, *args)
    assert writes(gm), "the traced graph should write in place (else this test proves nothing)"
    special = specialize(gm, example_inputs).gm
    assert writes(special) == [], [n.format_node() for n in writes(special)]
    assert any(is_updated(n) for n in special.graph.nodes)
    inputs = [a.clone() for a in example_inputs]
    got = outputs(special(*example_inputs))
    assert all(torch.equal(a, b) for a, b in zip(example_inputs, inputs)), "the rewritten graph wrote into its input"
    want = outputs(fn(*args))
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert (g.dtype, g.shape) == (w.dtype, w.shape), f"output {i}: {g.dtype} {g.shape}, want {w.dtype} {w.shape}"
        assert torch.equal(g, w), f"output {i} differs:\n{g}\n{w}"


ARGS = (torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)),
        torch.randn(5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1)))


# --- patterns -------------------------------------------------------------------------


def mla_keys(a, b):
    """HF DeepSeek-V3's `expand_kv`: a `new_empty` buffer, two slice `copy_`."""
    k = a.new_empty(a.shape[0], 6)
    k[..., :4].copy_(a)
    k[..., 4:].copy_(b[:, :2].expand(-1, 2))
    return k * 2


def index_put(a, b):
    x = a * 1
    x.index_put_((torch.tensor([0, 2]),), b[:2, :4])
    y = torch.zeros_like(a)
    y.index_put_((torch.tensor([0, 0, 3]),), b[:3, 1:5], accumulate=True)
    return x, y


def setitem_slice(a, b):
    x = a.clone()
    x[1:3, ::2] = 7.0
    x[-1] = b[0, :4]
    return x + 0


def setitem_bool_mask(a, b):
    x = a.clone()
    x[a > 0] = 0.5
    x[b[:, :4] < 0] = b[0, 0]
    return x


def out_argument(a, b):
    c = torch.empty_like(a)
    torch.add(a, b[:, :4], out=c)
    return c * 3


def write_through_view(a, b):
    """Writes into a view of an intermediate, then reads of the base and the view."""
    x = a * 2
    v = x[:, 1:3]
    v.add_(1.0)
    v.mul_(b[:, :2])
    return x.sum(0), v * 1


def augmented_assignment(a, b):
    x = a + 0
    alias = x
    x += b[:, :4]
    x[:, 1:3] += b[:, :2]  # Dynamo: getitem, iadd, setitem
    return alias * 1, x


def transposed_setitem(a, b):
    x = a.clone()
    x.transpose(0, 1)[1:3] = b[:, 2:4].t()
    return x


def chunk_and_split_pieces(a, b):
    x = a.clone()
    p, q = torch.chunk(x, 2, dim=1)
    p.mul_(2)
    q.copy_(b[:, :2])
    first, rest = x.split([1, 4], 0)  # split the written base again
    rest.add_(1)
    return x, p * 1, first * 1


def narrow_select_unbind(a, b):
    x = a.clone()
    x.mul_(2)
    x.narrow(1, -2, 2).add_(1)  # negative start
    x.select(0, 1).zero_()
    rows = x.unbind(0)
    rows[3].fill_(4.0)
    return x


def stale_views(a, b):
    """Views taken before a write read the written values afterwards."""
    x = a * 1
    row, t = x[1:3], x.t()
    x.add_(b[:, :4])
    t[0].mul_(3)
    x[4] = row[0]
    return row.sum(), x, t * 1


def reshaped_and_dtype_views(a, b):
    x = a * 1
    x.view(-1)[3:6] = 1.0
    x.reshape(2, 10)[1].mul_(2)
    x.unsqueeze(0)[0, 2] = -1.0
    x.view(torch.int64)[0] = 0  # reinterpreted bits: 0 is +0.0
    return x


def inplace_keyword_and_methods(a, b):
    x = a * 1
    F.relu(x[1:], inplace=True)
    x[:2].masked_fill_(b[:2, :4] > 0, -1.0)
    y = a.new_zeros(5, 4)
    y.scatter_add_(1, torch.tensor([[0, 1], [1, 1], [2, 3], [0, 0], [3, 3]]), b[:, :2])
    z = x[2:].clamp_(min=-0.5)  # the result of an in-place op is its target
    return x, y, z * 2


PATTERNS = [mla_keys, index_put, setitem_slice, setitem_bool_mask, out_argument, write_through_view,
            augmented_assignment, transposed_setitem, chunk_and_split_pieces, narrow_select_unbind, stale_views,
            reshaped_and_dtype_views, inplace_keyword_and_methods]


@pytest.mark.parametrize("fn", PATTERNS, ids=lambda f: f.__name__)
def test_pattern_is_functionalized(fn):
    check_functionalized(fn, *ARGS)


def test_functionalize_on_a_symbolic_trace():
    """The function itself: `values` are FakeTensor values of the nodes (here
    from FakeTensorProp); a graph without writes is left alone."""
    def f(a, b):
        k = a.new_empty(5, 6)
        k[:, :4].copy_(a)
        k[:, 4:].copy_(b[:, :2])
        return k * 2, k[:, 3:5].sum()

    def fake_values(gm):
        mode = FakeTensorMode()
        FakeTensorProp(gm, mode).propagate(*(mode.from_tensor(a) for a in ARGS))
        return {n: n.meta.get("val") for n in gm.graph.nodes}

    gm = fx.symbolic_trace(f)
    assert len(writes(gm)) == 2
    assert functionalize(gm, fake_values(gm)) is True
    assert writes(gm) == []
    assert all(torch.equal(g, w) for g, w in zip(gm(*ARGS), f(*ARGS)))
    pure = fx.symbolic_trace(lambda a, b: a * 2 + b[:, :4])
    code = pure.code
    assert functionalize(pure, fake_values(pure)) is False and pure.code == code


def test_updated_copies_its_target():
    t = torch.zeros(3, 4)
    out = updated(t, "setitem", (slice(None), slice(1, 3)), 5.0)
    assert torch.equal(t, torch.zeros(3, 4))
    assert out.sum().item() == 30.0
    added = updated(out, "add_", torch.ones(4), alpha=2)
    assert torch.equal(added, out + 2)


# --- random sequences of views, writes and reads -----------------------------------------


def _apply_view(v, op):
    kind, *a = op
    if kind == "slice":
        dim, start, stop = a
        return v[(slice(None),) * dim + (slice(start, stop),)]
    if kind == "narrow":
        return v.narrow(*a)
    if kind == "select":
        return v.select(*a)
    if kind == "transpose":
        return v.transpose(*a)
    if kind == "unsqueeze":
        return v.unsqueeze(*a)
    if kind == "flat":
        return v.view(-1)
    if kind == "chunk":
        dim, i = a
        return torch.chunk(v, 2, dim=dim)[i]
    if kind == "split":
        dim, i = a
        return v.split(2, dim)[i]
    if kind == "permute":
        return v.permute(*reversed(range(v.dim())))
    if kind == "unbind":
        dim, i = a
        return v.unbind(dim)[i]
    raise AssertionError(kind)


def _draw_view(draw, v):
    """A view op valid for tensor `v`."""
    kinds = ["slice", "narrow", "unsqueeze"]
    if v.dim() >= 2:
        kinds += ["select", "transpose", "chunk", "split", "unbind", "permute"]
    if v.is_contiguous():
        kinds.append("flat")
    kind = draw(st.sampled_from(kinds))
    dim = draw(st.integers(0, v.dim() - 1))
    size = v.shape[dim]
    if kind in ("slice", "narrow"):
        start = draw(st.integers(0, size - 1))
        stop = draw(st.integers(start + 1, size))
        if kind == "slice":
            return ("slice", dim, start, stop)
        negative = draw(st.booleans())
        return ("narrow", dim, start - size if negative else start, stop - start)
    if kind == "select":
        return ("select", dim, draw(st.integers(-size, size - 1)))
    if kind == "transpose":
        return ("transpose", dim, draw(st.integers(0, v.dim() - 1)))
    if kind == "unsqueeze":
        return ("unsqueeze", draw(st.integers(0, v.dim())))
    if kind == "chunk":
        return ("chunk", dim, draw(st.integers(0, len(torch.chunk(v, 2, dim=dim)) - 1)))
    if kind == "split":
        return ("split", dim, draw(st.integers(0, len(v.split(2, dim)) - 1)))
    if kind == "permute":
        return ("permute",)
    if kind == "unbind":
        return ("unbind", dim, draw(st.integers(0, size - 1)))
    return ("flat",)


WRITE_KINDS = ["add_", "mul_", "fill_", "zero_", "copy_", "add_tensor", "iadd", "setitem_mask", "setitem_first",
               "index_put_", "out"]


def _write(v, other, kind, c):
    """One write into view `v`; `other` is a tensor of `v`'s shape."""
    if kind == "add_":
        v.add_(c)
    elif kind == "mul_":
        v.mul_(c)
    elif kind == "fill_":
        v.fill_(c)
    elif kind == "zero_":
        v.zero_()
    elif kind == "copy_":
        v.copy_(other * c)
    elif kind == "add_tensor":
        v.add_(other, alpha=c)
    elif kind == "iadd":
        v += other
    elif kind == "setitem_mask":
        v[v > 0] = c  # reads `v`, then writes it
    elif kind == "setitem_first":
        v[0] = other[0]
    elif kind == "index_put_":
        index = torch.tensor([0, 0])
        v.index_put_((index,), other[index] * c, accumulate=True)
    elif kind == "out":
        torch.mul(other, c, out=v)


@st.composite
def programs(draw):
    """Steps over a (4, 6) buffer: ("view", parent, op) adds a view of an
    earlier tensor (the buffer is tensor 0), ("write", i, kind, c) writes
    into tensor i, ("read", i) records tensor i's current value."""
    shapes = [torch.empty(4, 6)]
    steps = []
    for _ in range(draw(st.integers(1, 8))):
        action = draw(st.sampled_from(["view", "write", "write", "read"]))
        i = draw(st.integers(0, len(shapes) - 1))
        if action == "view":
            op = _draw_view(draw, shapes[i])
            shapes.append(_apply_view(shapes[i], op))
            steps.append(("view", i, op))
        elif action == "write":
            kind = draw(st.sampled_from(WRITE_KINDS))
            if kind == "out" and not shapes[i].is_contiguous():
                kind = "add_tensor"  # Dynamo refuses a non-contiguous out=
            if shapes[i].dim() == 0 and kind in ("setitem_mask", "setitem_first", "index_put_"):
                kind = "fill_"
            steps.append(("write", i, kind, draw(st.sampled_from([-1.5, 0.5, 2.0]))))
        else:
            steps.append(("read", i))
    return steps


def run_program(steps, a, b):
    """The program on buffer `a * 1`; `b` (same shape) gives each view's
    operand, through the same view ops."""
    tensors, operands, reads = [a * 1], [b], []
    for step in steps:
        if step[0] == "view":
            _, i, op = step
            tensors.append(_apply_view(tensors[i], op))
            operands.append(_apply_view(operands[i], op))
        elif step[0] == "write":
            _, i, kind, c = step
            _write(tensors[i], operands[i], kind, c)
        else:
            reads.append(tensors[step[1]] * 1)
    return (tensors[0], *reads, *(t * 1 for t in tensors[1:]))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_random_writes_through_views(steps):
    a = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    b = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))

    def fn(a, b):
        return run_program(steps, a, b)

    gm, example_inputs = dynamo_graph(fn, a, b)
    special = specialize(gm, example_inputs).gm
    assert writes(special) == [], [n.format_node() for n in writes(special)]
    got, want = special(*example_inputs), fn(a, b)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"output {i} differs for {steps}"


# --- refusals ------------------------------------------------------------------------------


def normalised_by_mask(model, prompt, responses, advantages, mask):
    mask.mul_(2)  # the caller's mask would change
    return grpo_loss_f64(model, prompt, responses, advantages, mask)


def centred_advantages(model, prompt, responses, advantages, mask):
    advantages.sub_(advantages.mean())
    return grpo_loss_f64(model, prompt, responses, advantages, mask)


def first_token_masked(model, prompt, responses, advantages, mask):
    mask[:, 0] = 0.0  # a write through a view of an input
    return grpo_loss_f64(model, prompt, responses, advantages, mask)


def clipped_head(model, prompt, responses, advantages, mask):
    with torch.no_grad():
        model.lm_head.weight.clamp_(-0.5, 0.5)
    return grpo_loss_f64(model, prompt, responses, advantages, mask)


@pytest.mark.parametrize(
    "loss_fn, operator_name, written",
    [
        (normalised_by_mask, "mul_", "mask"),
        (centred_advantages, "sub_", "advantages"),
        (first_token_masked, "setitem", "mask"),
        (clipped_head, "clamp_", r"model\.lm_head\.weight"),
    ],
    ids=["mask.mul_", "advantages.sub_", "mask[:, 0] = 0", "weight.clamp_"],
)
def test_write_into_an_argument_is_refused(loss_fn, operator_name, written):
    model = make_model("plain")
    args = make_group(2, 9, 4)
    before = [a.clone() for a in args] + [model.lm_head.weight.detach().clone()]
    step = compile_loss(loss_fn, longstraw.Backend(prefix_chunk_size=4))
    with raises_longstraw(
        rf"operator `{operator_name}` \(node `\w+`\) at .*test_functionalize\.py:\d+ \({loss_fn.__name__}\) writes in "
        rf"place into `{written}`, an argument of the loss \(a parameter, buffer or input\): the caller would see the "
        r"write.*Write into a copy \(`x = x\.clone\(\)`\) or use the out-of-place operation"
    ):
        step(model, *args)
    after = list(args) + [model.lm_head.weight.detach()]
    assert all(torch.equal(x, y) for x, y in zip(after, before)), "the refused call wrote into its arguments"


def test_write_through_a_view_it_cannot_invert_is_refused():
    def diagonal_zeroed(model, prompt, responses, advantages, mask):
        scores = (mask * 1)[:, :2] @ mask[:, :2].t()
        scores.diagonal().zero_()
        return grpo_loss_f64(model, prompt, responses, advantages, mask) + scores.sum()

    step = compile_loss(diagonal_zeroed, longstraw.Backend(prefix_chunk_size=4))
    with raises_longstraw(r"operator `zero_` \(node `\w+`\) .*writes through `diagonal` \(node `\w+`\), a view "
                          r"LongStraw cannot invert; write into a fresh tensor instead"):
        step(make_model("plain"), *make_group(2, 9, 4))


# --- end to end: keys built in place, as HF DeepSeek-V3 does ---------------------------------


class SplitKeyAttention(nn.Module):
    """Attention whose keys are built as HF DeepSeek-V3's `expand_kv` builds
    them: a `new_empty` buffer, its first head dims written with `copy_` from
    a projection without RoPE, the last `rope_dim` from a rotated key shared
    by the K/V heads (`expand`ed). `forward(x, past)` is `plain_transformer.
    Attention`'s, so `reference.detached_reference` runs it with a past."""

    def __init__(self, cfg: PlainConfig, rope_dim: int = 4) -> None:
        super().__init__()
        self.cfg, self.rope_dim = cfg, rope_dim
        c, h, hkv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(c, h * d, bias=False)
        self.k_nope_proj = nn.Linear(c, hkv * (d - rope_dim), bias=False)
        self.k_rot_proj = nn.Linear(c, rope_dim, bias=False)
        self.v_proj = nn.Linear(c, hkv * d, bias=False)
        self.o_proj = nn.Linear(h * d, c, bias=False)

    def forward(self, x, past=None):
        cfg, rot = self.cfg, self.rope_dim
        nope = cfg.head_dim - rot
        b, L, _ = x.shape
        s = 0 if past is None else past[0].shape[2]
        positions = torch.arange(L, device=x.device) + s
        q = self.q_proj(x).view(b, L, cfg.num_heads, cfg.head_dim).transpose(1, 2)  # [B, H, L, D]
        q = torch.cat([q[..., :nope], apply_rope(q[..., nope:], positions, cfg.rope_theta)], dim=-1)
        k_nope = self.k_nope_proj(x).view(b, L, cfg.num_kv_heads, nope).transpose(1, 2)  # [B, Hkv, L, nope]
        k_rot = apply_rope(self.k_rot_proj(x).view(b, 1, L, rot), positions, cfg.rope_theta)  # [B, 1, L, rot]
        k_rot = k_rot.expand(-1, cfg.num_kv_heads, -1, -1)
        k = k_nope.new_empty(b, cfg.num_kv_heads, L, cfg.head_dim)  # [B, Hkv, L, D]
        k[..., :nope].copy_(k_nope)
        k[..., nope:].copy_(k_rot)
        v = self.v_proj(x).view(b, L, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        new_kv = (k, v)
        if past is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
            mask = torch.ones(L, s + L, dtype=torch.bool, device=x.device).tril(diagonal=s)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        o = o.transpose(1, 2).reshape(b, L, cfg.num_heads * cfg.head_dim)
        return self.o_proj(o), new_kv


def make_split_key_model(seed: int = 0) -> nn.Module:
    model = make_plain(seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    for block in model.blocks:
        attn = SplitKeyAttention(model.cfg)
        with torch.no_grad():
            for p in attn.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        block.attn = attn.to(torch.float64)
    return model


@pytest.fixture(params=[False, True], ids=["default", "deterministic"])
def deterministic(request):
    """With deterministic algorithms PyTorch fills `new_empty` with NaN: a
    lost write shows in every value downstream."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(request.param)
    try:
        yield request.param
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@pytest.mark.parametrize("mode", ["exact", "detached"])
def test_keys_written_in_place_end_to_end(mode, deterministic):
    model = make_split_key_model()
    args = make_group(3, 13, 5, pad=True)
    backend = longstraw.Backend(prompt_grad=mode, prefix_chunk_size=4, verify_state=True)
    got_loss, got = compiled_loss_and_grads(compile_loss(pg_loss, backend), model, *args)
    if mode == "exact":
        want_loss, want = eager_loss_and_grads(pg_loss, model, *args)
    else:
        want_loss, want = detached_reference(model, *args, tail=pg_tail)
    assert torch.isfinite(want_loss)
    assert_close(got_loss, want_loss, 1e-9, "loss")
    assert_grads_close(got, want, 1e-9)
    plan = backend.plans[-1]
    assert plan.prefix_len == 12 and len(plan.partition.slots) == 4
    assert writes(plan.runner.prefix.module) == [] and writes(plan.runner.branch.module) == []
