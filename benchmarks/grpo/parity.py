"""Gradient parity of every mode against eager, and the attention kernels against the explicit softmax."""

from __future__ import annotations

import json
import time

import torch

from .flops import PEAK_FLOPS
from .measure import release, sync
from .models import Group, build_model, make_group
from .modes import Runner, eager_step


def grads_of(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def compare(got: dict, want: dict) -> dict:
    """Relative L2 and cosine per parameter, in float64 one parameter at a
    time: float64 copies of whole gradient sets (76 GB at GLM-5's shapes)
    do not fit the host beside the sets compared."""
    rel, cos = {}, {}
    for n in want:
        a, b = got[n].double().flatten(), want[n].double().flatten()
        rel[n] = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
        # not `cosine_similarity`: its eps floors the norms, and a gradient of norm 1e-9 read as orthogonal
        norms = a.norm() * b.norm()
        cos[n] = (a @ b / norms).item() if norms > 0 else float(a.norm() == b.norm())
    worst = max(rel, key=rel.get)
    return {"max_rel_l2": rel[worst], "worst_parameter": worst, "min_cosine": min(cos.values()), "parameters": len(want)}


def reference_grads(model, kind: str, group: Group, bound: bool = False) -> dict[str, torch.Tensor]:
    """Eager gradients, accumulated branch by branch: the loss is a sum over
    branches, and one sequence at a time keeps float32 attention (SDPA's
    math kernel under grouped K/V, [G, H, N, N] scores at once) in memory.
    `bound` runs the hybrid's Gated DeltaNet through LongStraw's operators,
    which compute in the input dtype (HF's own kernel rounds through float32).
    Returns them on the host (`_grads_on_cpu`)."""
    model.zero_grad(set_to_none=True)
    with Runner(model, kind, "eager_ckpt", longstraw_operators=bound):
        for g in range(group.responses.shape[0]):
            branch = Group(group.prompt, group.responses[g : g + 1], group.advantages[g : g + 1], group.mask[g : g + 1])
            share = branch.mask.sum() / group.mask.sum()
            (eager_step(model, branch) * share).backward()
    return _grads_on_cpu(model)


def _grads_on_cpu(model) -> dict[str, torch.Tensor]:
    """Host copies of the model's gradients, which are then dropped: every
    gradient set compared waits on the host, so a run's device memory holds
    one model and its own gradients (at GLM-5's shapes in float32, 19 GB each)."""
    grads = {n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


PARITY_DTYPES = (torch.float64, torch.float32, torch.bfloat16)


def parity(kind, args, device, dtypes: tuple[torch.dtype, ...] = PARITY_DTYPES) -> dict:
    """longstraw exact against the eager reference (`reference_grads`) in
    float32 and bf16; both float32 runs also against a float64 eager run
    (`longstraw_vs_float64`, `eager_vs_float64`), which says whose rounding
    a float32 gap is. `dtypes` runs fewer (the CPU tests: each compile costs seconds)."""
    out = {}
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    truth = None
    for dtype in dtypes:
        model = build_model(kind, args.tiny, dtype, device)
        group = make_group(args.G, args.p_parity, args.R, model.config.vocab_size, device)
        result = {}
        try:
            if dtype == torch.float64:
                truth = reference_grads(model, kind, group, bound=True)
            else:
                want = reference_grads(model, kind, group)
                release()
                with Runner(model, kind, "longstraw_exact") as runner:
                    runner.step(group)
                got = _grads_on_cpu(model)
                result = compare(got, want)
                if dtype == torch.float32 and truth is not None:
                    result["longstraw_vs_float64"] = compare(got, truth)["max_rel_l2"]
                    result["eager_vs_float64"] = compare(want, truth)["max_rel_l2"]
        except Exception as error:  # noqa: BLE001
            result = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
        if dtype != torch.float64 or "error" in result:
            out[str(dtype).removeprefix("torch.")] = result
        print(f"  {kind} parity {dtype} P={args.p_parity}: {result}", flush=True)
        del model
        release()
    return out


def kernels(device) -> dict:
    """The attention step's fused kernels (flash, cuDNN forward) against the
    explicit-softmax kernel: forward, and the block-wise backward assembled
    as the step does; then each fused forward's speed at a capture chunk
    (8192 queries after 253,952 keys, Qwen3-8B heads)."""
    from longstraw.runtime.kernels import attention

    gen = torch.Generator().manual_seed(0)
    n, o, hq, hkv, d = 1024, 3 * 65536 + 100, 32, 8, 128
    q = torch.randn(1, hq, n, d, generator=gen).to(device, torch.bfloat16)
    keys = torch.randn(1, hkv, o + n, d, generator=gen).to(device, torch.bfloat16)
    values = torch.randn(1, hkv, o + n, d, generator=gen).to(device, torch.bfloat16)
    grad_out = torch.randn(1, hq, n, d, generator=gen).to(device, torch.bfloat16)
    fused = {"flash": attention.FLASH, "cudnn": attention.CUDNN}
    results, out = {}, {}
    for name, kernel in (*fused.items(), ("math", attention.MATH)):
        try:
            y, lse = kernel.forward(q, keys, values, None, None, o)
            gq = torch.zeros(q.shape, dtype=torch.float32, device=device)
            gk = torch.zeros(keys.shape, dtype=torch.float32, device=device)
            gv = torch.zeros(values.shape, dtype=torch.float32, device=device)
            for start, length in kernel.blocks(q, o):
                a, b, c = kernel.backward(grad_out, q, keys.narrow(-2, start, length), values.narrow(-2, start, length), y, lse, None, None, o, start)
                gq += a.float()
                gk.narrow(-2, start, length).add_(b.float())
                gv.narrow(-2, start, length).add_(c.float())
            results[name] = (y.float(), lse.float(), gq, gk, gv)
        except Exception as error:  # noqa: BLE001
            out[name] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
    for name in fused:
        if name not in results:
            continue
        out[name] = {}
        for i, what in enumerate(("out", "lse", "grad_q", "grad_k", "grad_v")):
            f, m = results[name][i], results["math"][i]
            out[name][what] = {"rel_l2": ((f - m).norm() / m.norm()).item(),
                               "cosine": torch.nn.functional.cosine_similarity(f.flatten(), m.flatten(), dim=0).item()}
    del q, keys, values, grad_out, results
    n, o = 8192, 262144 - 8192
    q = torch.randn(1, hq, n, d, device=device, dtype=torch.bfloat16)
    keys, values = (torch.randn(1, hkv, o + n, d, device=device, dtype=torch.bfloat16) for _ in range(2))
    work = 4 * hq * d * (n * o + n * (n + 1) / 2)
    for name, kernel in fused.items():
        if "error" in out.get(name, {}):
            continue
        kernel.forward(q, keys, values, None, None, o)
        sync()
        t0 = time.perf_counter()
        for _ in range(5):
            kernel.forward(q, keys, values, None, None, o)
        sync()
        seconds = (time.perf_counter() - t0) / 5
        out[name]["capture_chunk_forward"] = {"seconds": seconds, "tflops": work / seconds / 1e12, "mfu": work / seconds / PEAK_FLOPS}
    print(f"  kernels against math: {json.dumps(out)}", flush=True)
    return out
