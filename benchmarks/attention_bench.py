"""The attention step's kernels at Qwen3.5-27B's head shapes (24 query
heads over 4 key heads of 256, bf16): a step of n queries after o earlier
positions, forward over all keys and backward block by block as the
attention pass runs them, for flash and cuDNN. TFLOP/s count the causal
work only (n * (o + n/2) scores), the backward as 2.5 forwards.

    python benchmarks/attention_bench.py --out benchmarks/results/attention_bench_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from grpo.results import provenance  # noqa: E402
from longstraw.runtime.kernels import attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 24, 4, 256


def step_backward(kernel, grad_out, q, keys, values, out, lse, o):
    """dQ, dK, dV over every key block, as `AttentionOverState.backward` assembles them."""
    grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    grad_k, grad_v = torch.zeros_like(keys), torch.zeros_like(values)
    for start, length in kernel.blocks(q, o):
        gq, gk, gv = kernel.backward(grad_out, q, keys.narrow(-2, start, length), values.narrow(-2, start, length),
                                     out, lse, None, None, o, start)
        grad_q += gq
        grad_k.narrow(-2, start, length).add_(gk)
        grad_v.narrow(-2, start, length).add_(gv)
    return grad_q, grad_k, grad_v


def timed(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def measure(name: str, n: int, o: int, repeats: int) -> dict:
    kernel = attention.KERNELS[name]
    rand = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q, grad_out = rand(1, HEADS, n, HEAD_DIM), rand(1, HEADS, n, HEAD_DIM)
    keys, values = rand(1, KV_HEADS, o + n, HEAD_DIM), rand(1, KV_HEADS, o + n, HEAD_DIM)
    out, lse = kernel.forward(q, keys, values, None, None, o)
    flop = 4 * n * (o + n / 2) * HEAD_DIM * HEADS
    forward = timed(lambda: kernel.forward(q, keys, values, None, None, o), repeats)
    backward = timed(lambda: step_backward(kernel, grad_out, q, keys, values, out, lse, o), repeats)
    return {"kernel": name, "n": n, "o": o, "forward_s": forward, "backward_s": backward,
            "forward_tflops": flop / forward / 1e12, "backward_tflops": 2.5 * flop / backward / 1e12}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", default="4096,8192", help="queries per step")
    parser.add_argument("--o", default="0,65536,262144", help="earlier positions")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = []
    for n in map(int, args.n.split(",")):
        for o in map(int, args.o.split(",")):
            for name in ("flash", "cudnn"):
                rows.append(measure(name, n, o, args.repeats))
                torch.cuda.empty_cache()
    result = {**provenance("python " + " ".join(sys.argv)), "runs": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"{'kernel':6} {'n':>5} {'o':>7} {'fwd s':>8} {'fwd TF/s':>8} {'bwd s':>8} {'bwd TF/s':>8}")
    for r in rows:
        print(f"{r['kernel']:6} {r['n']:5d} {r['o']:7d} {r['forward_s']:8.4f} {r['forward_tflops']:8.1f} "
              f"{r['backward_s']:8.4f} {r['backward_tflops']:8.1f}")


if __name__ == "__main__":
    main()
