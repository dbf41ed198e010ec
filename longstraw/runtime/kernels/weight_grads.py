"""Weight gradients added into `.grad` by the kernel that computes them.

A call differentiates many steps (each branch step, each prompt chunk),
and every step's backward produces a whole gradient of every weight that
autograd's `AccumulateGrad` then adds into `.grad`: one extra pass over
every weight per step, and for the embedding a dense `[vocab, hidden]`
gradient filled with zeros every step, though a step reads a few hundred
rows of it. Eager runs one backward and pays this once; at short prompts
it was a tenth of LongStraw's step (decision 0042).

The step graphs call `linear` and `embedding` below instead of PyTorch's
(`codegen/stepgraph.py`). Their forward is PyTorch's own over the detached
weight, so values and autocast are unchanged; a small autograd function
on the output carries the weight's gradient. Inside `accumulating_into`
(the runtime's backward over the leaves it owns) that gradient goes
straight into the leaf's `.grad`: the weight-gradient GEMM adds into it
(`addmm_`), the embedding adds only the rows the step read. Anywhere else
(a weight that is not one of those leaves, `torch.autograd.grad`, a
computed weight) the function returns the gradient and autograd
accumulates it as usual.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import addmm_flop, register_flop_formula

_LEAVES: dict[int, torch.Tensor] = {}
"""The leaves whose `.grad` the weight-gradient functions add into, by id;
module-wide, not thread-local: autograd runs a CUDA backward on a thread
of its own."""


@contextlib.contextmanager
def accumulating_into(leaves: Sequence[torch.Tensor]) -> Iterator[None]:
    """Within this block, a backward through `linear` or `embedding` adds
    the gradient of a weight in `leaves` into its `.grad` directly."""
    added = [leaf for leaf in leaves if id(leaf) not in _LEAVES]
    _LEAVES.update((id(leaf), leaf) for leaf in added)
    try:
        yield
    finally:
        for leaf in added:
            del _LEAVES[id(leaf)]


register_flop_formula(torch.ops.aten.addmm_, get_raw=True)(addmm_flop)  # PyTorch counts `addmm`, not its in-place form


def _owned(weight: torch.Tensor) -> bool:
    return _LEAVES.get(id(weight)) is weight and weight.is_contiguous()


def _routes(weight: torch.Tensor) -> bool:
    """Whether a call's weight gradient goes through this module: a plain
    leaf (only a leaf has a `.grad` to add into; a tensor subclass such as
    a DTensor takes PyTorch's path) that autograd will differentiate."""
    return (type(weight) in (torch.Tensor, torch.nn.Parameter) and weight.is_leaf and weight.requires_grad
            and torch.is_grad_enabled())


class _LinearWeightGrad(torch.autograd.Function):
    """Identity on a linear's output; its backward is d(weight)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.weight = weight
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, torch.Tensor | None]:
        (x,) = ctx.saved_tensors
        weight = ctx.weight
        grad2 = grad.reshape(-1, grad.shape[-1])
        x2 = x.reshape(-1, x.shape[-1]).to(grad.dtype)  # autocast ran the product in the output's dtype
        if not _owned(weight):
            return grad, None, grad2.T @ x2
        held = weight.grad
        if held is None:
            weight.grad = (grad2.T @ x2).to(weight.dtype)
        elif held.dtype == grad2.dtype and held.is_contiguous():
            held.addmm_(grad2.T, x2)
        else:
            held.add_(grad2.T @ x2)
        return grad, None, None


def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` (same signature), with the weight's gradient added into `.grad` in place (module doc)."""
    if not _routes(weight):
        return F.linear(input, weight, bias)
    return _LinearWeightGrad.apply(F.linear(input, weight.detach(), bias), input, weight)


class _EmbeddingWeightGrad(torch.autograd.Function):
    """Identity on an embedding's output; its backward is d(weight)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.weight, ctx.padding_idx = weight, padding_idx
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, torch.Tensor | None, None]:
        (ids,) = ctx.saved_tensors
        weight, padding_idx = ctx.weight, ctx.padding_idx
        owned = _owned(weight)
        held = weight.grad if owned else None
        if held is None:
            dense = torch.ops.aten.embedding_dense_backward(grad, ids, weight.shape[0], padding_idx, False)
            if not owned:
                return grad, None, dense, None
            weight.grad = dense.to(weight.dtype)
            return grad, None, None, None
        rows, grad2 = ids.reshape(-1), grad.reshape(-1, grad.shape[-1])
        if padding_idx >= 0:
            grad2 = grad2.masked_fill((rows == padding_idx)[:, None], 0)
        held.index_put_((rows,), grad2.to(held.dtype), accumulate=True)
        return grad, None, None, None


def embedding(
    input: torch.Tensor, weight: torch.Tensor, padding_idx: int | None = None, max_norm: float | None = None,
    norm_type: float = 2.0, scale_grad_by_freq: bool = False, sparse: bool = False,
) -> torch.Tensor:
    """`F.embedding` (same signature), with the weight's gradient added into
    `.grad` in place (module doc); the options that change the gradient's
    form take PyTorch's path."""
    if not _routes(weight) or max_norm is not None or scale_grad_by_freq or sparse:
        return F.embedding(input, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)
    out = F.embedding(input, weight.detach(), padding_idx)
    if padding_idx is None:
        padding_idx = -1
    elif padding_idx < 0:
        padding_idx += weight.shape[0]
    return _EmbeddingWeightGrad.apply(out, input, weight, padding_idx)
