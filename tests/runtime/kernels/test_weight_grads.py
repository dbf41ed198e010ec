"""Weight gradients added into `.grad` by the kernel that computes them
(`longstraw/runtime/kernels/weight_grads.py`): the same gradients as
PyTorch's `F.linear` / `F.embedding` with `AccumulateGrad`, inside and
outside `accumulating_into`, and the step graphs of a compiled loss use it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from longstraw.runtime.kernels.weight_grads import accumulating_into, embedding, linear
from helpers.tiny_models import make_qwen3

VOCAB, HIDDEN, OUT = 11, 6, 5


def _tensors(dtype: torch.dtype = torch.float64, device: str = "cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {"table": (VOCAB, HIDDEN), "weight": (OUT, HIDDEN), "bias": (OUT,), "head": (VOCAB, OUT)}
    return {k: torch.randn(shape, generator=g, dtype=dtype).to(device) for k, shape in shapes.items()}


IDS = [torch.tensor([[1, 2, 2, 0, 7]]), torch.tensor([[3, 0, 3, 3, 10]]), torch.tensor([[4, 4, 4, 4, 4]])]


def _loss(ops, t: dict[str, torch.Tensor], ids: torch.Tensor, tied: bool) -> torch.Tensor:
    """An embedding (padding index 0), a linear with bias, and a head: the
    embedding's table itself when `tied`."""
    linear_, embedding_ = ops
    h = linear_(torch.tanh(embedding_(ids, t["table"], padding_idx=0)), t["weight"], t["bias"])
    logits = linear_(F.pad(h, (0, HIDDEN - OUT)), t["table"]) if tied else linear_(h, t["head"])
    return logits.log_softmax(-1)[..., 3].sin().sum()


def _leaves(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().requires_grad_(True) for k, v in t.items()}


DEVICES = [pytest.param(("cpu", torch.float64, 1e-13), id="cpu-float64"),
           pytest.param(("cuda", torch.float32, 1e-5), id="cuda-float32", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("where", DEVICES)
def test_gradients_added_in_place_equal_autograds_over_several_backwards(tied: bool, where) -> None:
    device, dtype, tol = where
    t = _tensors(dtype, device)
    reference = _leaves(t)
    for ids in IDS:
        _loss((F.linear, F.embedding), reference, ids.to(device), tied).backward()
    leaves = _leaves(t)
    with accumulating_into(list(leaves.values())):
        for ids in IDS:
            loss = _loss((linear, embedding), leaves, ids.to(device), tied)
            torch.autograd.backward([loss], inputs=list(leaves.values()))
    for name in t:
        expected = reference[name].grad
        if expected is None:
            assert leaves[name].grad is None, name
            continue
        torch.testing.assert_close(leaves[name].grad, expected, rtol=tol, atol=tol, msg=name)


def test_outside_the_block_gradients_are_returned_not_added() -> None:
    """`torch.autograd.grad`, and a backward over leaves that are not the
    block's, see the ordinary gradients; no `.grad` is written behind them."""
    t = _tensors()
    reference = _leaves(t)
    expected = torch.autograd.grad(_loss((F.linear, F.embedding), reference, IDS[0], False), list(reference.values()))
    leaves = _leaves(t)
    others = _leaves(t)
    with accumulating_into(list(others.values())):
        got = torch.autograd.grad(_loss((linear, embedding), leaves, IDS[0], False), list(leaves.values()))
    for name, a, b in zip(t, got, expected):
        torch.testing.assert_close(a, b, rtol=1e-14, atol=1e-14, msg=name)
    assert all(x.grad is None for x in (*leaves.values(), *others.values()))


def test_a_computed_or_strided_weight_takes_pytorchs_path() -> None:
    t = _tensors()
    x = torch.randn(3, OUT, dtype=torch.float64)
    strided = t["weight"].detach().clone().T.requires_grad_(True)  # [HIDDEN, OUT], not contiguous
    scale = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
    with accumulating_into([strided, scale]):
        out = linear(x, strided).sum() + linear(x, t["weight"].T * scale).sum()
        out.backward()
    torch.testing.assert_close(strided.grad, torch.ones(3, HIDDEN, dtype=torch.float64).T @ x)
    torch.testing.assert_close(scale.grad, (torch.ones(3, HIDDEN, dtype=torch.float64).T @ x * t["weight"].T).sum())


def test_under_autocast_the_gradients_equal_autocasts() -> None:
    """bfloat16 autocast over float32 weights: the product runs in bfloat16
    and is added into the float32 `.grad`, as `AccumulateGrad` adds it."""
    t = _tensors(torch.float32)
    reference, leaves = _leaves(t), _leaves(t)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for ids in IDS[:2]:
            _loss((F.linear, F.embedding), reference, ids, False).backward()
        with accumulating_into(list(leaves.values())):
            for ids in IDS[:2]:
                torch.autograd.backward([_loss((linear, embedding), leaves, ids, False)], inputs=list(leaves.values()))
    for name in t:
        assert leaves[name].grad.dtype == torch.float32
        torch.testing.assert_close(leaves[name].grad, reference[name].grad, rtol=0, atol=0, msg=name)


def test_a_compiled_loss_makes_one_dense_embedding_gradient_a_call() -> None:
    """Every branch step and prompt chunk adds into the embedding's `.grad`;
    only the first makes the dense `[vocab, hidden]` gradient (PyTorch's
    path makes one per step), and the weights' products add into `.grad`."""
    torch.manual_seed(0)
    model = make_qwen3()
    G, P, R = 3, 24, 6
    prompt = torch.randint(1, model.config.vocab_size, (P,))
    responses = torch.randint(1, model.config.vocab_size, (G, R))

    def loss_fn(model, prompt, responses):
        ids = torch.cat([prompt.expand(G, -1), responses], dim=1)
        return model(input_ids=ids).logits[:, P - 1:-1].log_softmax(-1).gather(-1, responses[..., None]).sum()

    options = {"prefix_chunk_size": 8, "branch_rows": 1, "keep_graphs": False}
    compiled = torch.compile(loss_fn, backend="longstraw", options=options, fullgraph=True)
    compiled(model, prompt, responses).backward()
    model.zero_grad()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        compiled(model, prompt, responses).backward()
    counts = {e.key: e.count for e in prof.key_averages()}
    assert counts.get("aten::embedding_dense_backward") == 1
    assert counts.get("aten::index_put_", 0) >= G + P // 8 - 1
    assert counts.get("aten::addmm_", 0) > 0
