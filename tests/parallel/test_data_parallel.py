"""DDP and FSDP2 on the CPU: two processes over gloo.

The documented recipes (`torch._dynamo.config.optimize_ddp = False` and
`torch.compile(DDP(longstraw.LossModule(model, loss_fn)))`;
`fully_shard(longstraw.LossModule(model, loss_fn))` compiled) must give, on
every rank, the gradients eager PyTorch gives with the same wrapper, reduced
across the ranks; in detached mode, the detached reference averaged over the
ranks. Each rank trains on its own GRPO group. The patterns that cannot work
(DDPOptimizer's split, a wrapped model called inside the compiled loss, FSDP2
on the layers) must raise a LongStrawError that says what to do, or, with
`on_unsupported="eager"`, warn and give eager's gradients.

Starting processes is slow, so each test spawns its two workers once and
runs several cases in them. A worker saves what it measured (gradients,
messages, warnings) with torch.save; the assertions run here.
"""

from __future__ import annotations

import os
import re
import traceback
import warnings

import torch
import torch.distributed as dist

from helpers import gloo
from helpers.compare import assert_grads_close, rel_err

WORLD = 2
STEPS = 3  # DDP rebuilds its buckets (bucket_cap_mb) after the first iterations: the last step runs with them
OPTIONS = {"prefix_chunk_size": 5}  # the 11 captured prompt positions in three chunks


# --- in the workers ----------------------------------------------------------


def _group(rank: int, step: int):
    """Each rank and step its own group: the reduced gradient differs from every rank's own."""
    from helpers.tiny_models import make_group

    return make_group(3, 12, 5, pad=True, seed=10 * step + rank)


def _grads(module: torch.nn.Module, prefix: str) -> dict:
    """name (without the wrappers' prefix) -> the full gradient (FSDP2's DTensor shards gathered)."""
    out = {}
    for name, p in module.named_parameters():
        grad = p.grad
        if grad is not None and hasattr(grad, "full_tensor"):
            grad = grad.full_tensor()
        out[name.removeprefix(prefix)] = None if grad is None else grad.detach().clone()
    return out


def _step(call, module: torch.nn.Module, prefix: str, args) -> dict:
    """One step from empty .grad through `call` (eager or compiled); the gradients `module` holds after it."""
    module.zero_grad(set_to_none=True)
    call(*args).backward()
    return _grads(module, prefix)


def _mean_over_ranks(grads: dict) -> dict:
    out = {}
    for name, grad in grads.items():
        grad = grad.clone()
        dist.all_reduce(grad)
        out[name] = grad / WORLD
    return out


def _error(run) -> str | None:
    """None if `run()` raises nothing; the LongStrawError's message if one is in
    the exception chain; else the whole traceback, for the parent to show."""
    import longstraw

    from conftest import _exception_chain

    try:
        run()
    except Exception as exc:  # noqa: BLE001 - classified below, reported to the parent
        ours = [e for e in _exception_chain(exc) if isinstance(e, longstraw.LongStrawError)]
        if ours:
            return f"{type(ours[0]).__name__}: {ours[0]}"
        return "no LongStrawError in the chain:\n" + "".join(traceback.format_exception(exc))
    return None


def _with_warnings(run) -> tuple:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run()
    return result, [str(w.message) for w in caught if str(w.message).startswith("longstraw")]


def _ddp_worker(rank: int, world: int, port: int, out: str) -> None:
    gloo.init(rank, world, port)
    from torch.nn.parallel import DistributedDataParallel as DDP

    import longstraw

    from helpers.losses import grpo_loss_f64
    from helpers.reference import detached_reference, eager_loss_and_grads
    from helpers.tiny_models import make_model

    res: dict = {}

    # The recipe, with DDP's gradients in many buckets (bucket_cap_mb). Dynamo
    # reads optimize_ddp when it compiles, at the first call: DDP is built
    # with the default.
    for mode in ("exact", "detached"):
        torch._dynamo.reset()
        torch._dynamo.config.optimize_ddp = True
        ddp = DDP(longstraw.LossModule(make_model("qwen3"), grpo_loss_f64), bucket_cap_mb=0.01)
        torch._dynamo.config.optimize_ddp = False
        step = torch.compile(ddp, backend="longstraw", options={**OPTIONS, "prompt_grad": mode})
        ref = DDP(longstraw.LossModule(make_model("qwen3"), grpo_loss_f64), bucket_cap_mb=0.01)
        plain = make_model("qwen3")
        for i in range(STEPS):
            args = _group(rank, i)
            if mode == "exact":
                want = _step(ref, ref, "module.model.", args)
                local = eager_loss_and_grads(grpo_loss_f64, plain, *args)[1]
            else:
                want = _mean_over_ranks(detached_reference(plain, *args)[1])
                local = None
            res[f"recipe {mode} step {i}"] = (_step(step, ddp, "module.model.", args), want, local)
        res[f"buckets {mode}"] = ddp._get_ddp_logging_data().get("rebuilt_bucket_sizes", "")

    # The default optimize_ddp with more parameters than DDPOptimizer's first
    # bucket (1 MiB): split at buckets before the backend sees the loss.
    torch._dynamo.config.optimize_ddp = True
    args = _group(rank, 0)

    def big():
        return DDP(longstraw.LossModule(make_model("qwen3", vocab_size=4096), grpo_loss_f64))

    torch._dynamo.reset()
    ddp = big()
    res["split error"] = _error(lambda: torch.compile(ddp, backend="longstraw")(*args).backward())
    torch._dynamo.reset()
    ddp, ref = big(), big()
    step = torch.compile(ddp, backend="longstraw", options={"on_unsupported": "eager"})
    got, caught = _with_warnings(lambda: _step(step, ddp, "module.model.", args))
    res["split eager"] = (got, _step(ref, ref, "module.model.", args), caught)

    # A DDP model called inside the compiled loss, nothing configured.
    torch._dynamo.reset()
    ddp = DDP(make_model("qwen3"))
    res["inside error"] = _error(lambda: torch.compile(grpo_loss_f64, backend="longstraw")(ddp, *args).backward())

    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _fsdp_worker(rank: int, world: int, port: int, out: str) -> None:
    gloo.init(rank, world, port)
    from torch.distributed.fsdp import fully_shard

    import longstraw

    from helpers.losses import grpo_loss_f64
    from helpers.reference import detached_reference, eager_loss_and_grads
    from helpers.tiny_models import make_model

    res: dict = {}

    # The recipe: fully_shard on the module whose forward returns the loss.
    for mode in ("exact", "detached"):
        torch._dynamo.reset()
        module = longstraw.LossModule(make_model("plain"), grpo_loss_f64)
        fully_shard(module)
        step = torch.compile(module, backend="longstraw", options={**OPTIONS, "prompt_grad": mode})
        plain = make_model("plain")
        for i in range(2):
            args = _group(rank, i)
            if mode == "exact":
                want = _step(module, module, "model.", args)  # eager, the same FSDP2 module
                local = eager_loss_and_grads(grpo_loss_f64, plain, *args)[1]
            else:
                want = _mean_over_ranks(detached_reference(plain, *args)[1])
                local = None
            res[f"recipe {mode} step {i}"] = (_step(step, module, "model.", args), want, local)
        res[f"sharded {mode}"] = {type(p).__name__ for p in module.parameters()}

    # fully_shard on the layers too: a graph break around every layer.
    args = _group(rank, 0)

    def per_layer():
        module = longstraw.LossModule(make_model("plain"), grpo_loss_f64)
        for block in module.model.blocks:
            fully_shard(block)
        fully_shard(module)
        return module

    torch._dynamo.reset()
    module = per_layer()
    res["layers error"] = _error(lambda: torch.compile(module, backend="longstraw")(*args).backward())
    torch._dynamo.reset()
    module = per_layer()
    step = torch.compile(module, backend="longstraw", options={"on_unsupported": "eager"})
    got, caught = _with_warnings(lambda: _step(step, module, "model.", args))
    res["layers eager"] = (got, _step(module, module, "model.", args), caught)

    # An FSDP2 model called inside the compiled loss.
    torch._dynamo.reset()
    model = make_model("plain")
    fully_shard(model)
    res["inside error"] = _error(lambda: torch.compile(grpo_loss_f64, backend="longstraw")(model, *args).backward())

    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


# --- in the parent ------------------------------------------------------------


def _assert_reduced(got: dict, want: dict, local: dict, tol: float) -> None:
    assert_grads_close(got, want, tol)
    # The ranks' groups differ, so a missing reduction would show.
    assert max(rel_err(want[n], local[n]) for n in want) > 1e-2


def _assert_message(message: str | None, *patterns: str) -> None:
    assert message is not None, "nothing was raised"
    assert not message.startswith("no LongStrawError"), message
    for pattern in patterns:
        assert re.search(pattern, message), f"{pattern!r} not in: {message}"


DDP_FIX = (
    r"torch\._dynamo\.config\.optimize_ddp = False",
    re.escape('torch.compile(DDP(longstraw.LossModule(model, loss_fn)), backend="longstraw")'),
)
FSDP_FIX = (r"only to the module whose forward returns the loss", re.escape("fully_shard(module)"))


def test_ddp(tmp_path):
    results = gloo.spawn(_ddp_worker, WORLD, tmp_path)
    for res in results:
        for mode in ("exact", "detached"):
            for i in range(STEPS):
                got, want, local = res[f"recipe {mode} step {i}"]
                if mode == "exact":
                    _assert_reduced(got, want, local, 1e-6)  # HF model: float32 rounding in norms and RoPE
                else:
                    assert_grads_close(got, want, 1e-6)
            assert len(res[f"buckets {mode}"].split(",")) > 1, res[f"buckets {mode}"]

        _assert_message(res["split error"], r"^UnsupportedGraphError: Dynamo's DDP optimizer split", *DDP_FIX)
        assert "While executing" not in res["split error"]  # raised at run time, not inside DDPOptimizer's interpreter
        got, want, caught = res["split eager"]
        assert_grads_close(got, want, 1e-12)
        assert caught and all("DDP optimizer split" in m for m in caught), caught

        _assert_message(res["inside error"], r"A DistributedDataParallel module called inside", *DDP_FIX)
    # every rank holds the same reduced gradient
    assert_grads_close(results[0]["recipe exact step 2"][0], results[1]["recipe exact step 2"][0], 0.0)


def test_fsdp2(tmp_path):
    results = gloo.spawn(_fsdp_worker, WORLD, tmp_path)
    for res in results:
        for mode in ("exact", "detached"):
            for i in range(2):
                got, want, local = res[f"recipe {mode} step {i}"]
                if mode == "exact":
                    _assert_reduced(got, want, local, 1e-9)
                else:
                    assert_grads_close(got, want, 1e-9)
            assert res[f"sharded {mode}"] == {"DTensor"}  # resharded after the step

        _assert_message(res["layers error"], r"FSDP2 \(`fully_shard`\)", *FSDP_FIX)
        got, want, caught = res["layers eager"]
        assert_grads_close(got, want, 1e-12)
        assert caught and all("FSDP2" in m for m in caught), caught

        _assert_message(res["inside error"], r"FSDP2 \(`fully_shard`\)", *FSDP_FIX)
    # every rank gathers the same reduced gradient
    assert_grads_close(results[0]["recipe exact step 1"][0], results[1]["recipe exact step 1"][0], 0.0)
