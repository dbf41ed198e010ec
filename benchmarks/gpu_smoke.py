"""GPU smoke run: correctness of the CUDA paths on tiny models.

1. Dense (tiny Qwen3, float32 on CUDA): compiled exact mode against eager,
   detached mode against the HF-cache reference (exercises the CUDA
   lower-right causal bias path).
2. Hybrid (tiny Qwen3.5, float32 on CUDA, bound): compiled exact mode
   against bound eager; fla's forward (if importable) against LongStraw's
   chunked kernel, and used for prompt capture.

Scale and the baselines are `grpo_bench.py`'s.

    python benchmarks/gpu_smoke.py --out results.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import transformers

import longstraw
from longstraw.runtime.kernels import fla_gated_delta
from longstraw.runtime.kernels.gated_delta import gated_delta_rule_reference
from longstraw.models import qwen3_5
from longstraw.models.tiny import tiny_causal_lm

from grpo.parity import compare as compare_grads
from grpo.results import provenance


def grpo_loss(model, prompt, responses, advantages, mask):
    ids = torch.cat([prompt.expand(responses.shape[0], -1), responses], dim=1)
    logits = model(input_ids=ids).logits[:, prompt.shape[0] - 1 : -1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    ratio = torch.exp(logp - logp.detach())
    return -((ratio * advantages[:, None]) * mask).sum() / mask.sum()


def detached_loss(model, prompt, responses, advantages, mask):
    G = responses.shape[0]
    with torch.no_grad():
        cache = model(input_ids=prompt[None, :-1].expand(G, -1), use_cache=True).past_key_values
    ids = torch.cat([prompt[-1:].expand(G, 1), responses[:, :-1]], 1)
    logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits.float()
    logp = torch.log_softmax(logits, -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    ratio = torch.exp(logp - logp.detach())
    return -((ratio * advantages[:, None]) * mask).sum() / mask.sum()


def group(G, P, R, vocab, device, dtype=torch.float32, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    prompt = torch.randint(0, vocab, (P,), generator=gen).to(device)
    responses = torch.randint(0, vocab, (G, R), generator=gen).to(device)
    advantages = torch.randn(G, generator=gen).to(device, dtype)
    mask = torch.ones(G, R, device=device, dtype=dtype)
    return prompt, responses, advantages, mask


def grads(model, fn, *args):
    model.zero_grad(set_to_none=True)
    loss = fn(model, *args)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def compare(got, want):
    (lg, g), (lw, w) = got, want
    return {"loss_got": lg.item(), "loss_want": lw.item(), **compare_grads(g, w)}


def parity(model, args, reference, mode, chunk):
    torch._dynamo.reset()
    step = torch.compile(grpo_loss, backend=longstraw.Backend(prompt_grad=mode, prefix_chunk_size=chunk))
    return compare(grads(model, step, *args), grads(model, reference, *args))


def dense_parity(device):
    model = tiny_causal_lm("qwen3", dtype=torch.float32, hidden_size=256, head_dim=64, intermediate_size=512).to(device)
    args = group(4, 700, 33, model.config.vocab_size, device)
    return {
        "exact": parity(model, args, grpo_loss, "exact", 96),
        "detached": parity(model, args, detached_loss, "detached", 96),
    }


def hybrid_parity(device):
    out = {"fla_available": fla_gated_delta.fla_ops() is not None}
    with qwen3_5.bound():
        torch.manual_seed(0)
        cfg = qwen3_5.tiny_config(hidden_size=128, linear_key_head_dim=32, linear_value_head_dim=32, head_dim=32)
        model = transformers.Qwen3_5ForCausalLM(cfg).to(device)
        args = group(3, 600, 17, cfg.vocab_size, device)
        out["exact"] = parity(model, args, grpo_loss, "exact", 100)
    if out["fla_available"]:
        gen = torch.Generator(device="cpu").manual_seed(0)
        B, L, Hk, Hv, D = 1, 1000, 4, 8, 64
        q, k = (torch.randn(B, L, Hk, D, generator=gen).to(device, torch.bfloat16) for _ in range(2))
        v = torch.randn(B, L, Hv, D, generator=gen).to(device, torch.bfloat16)
        g = -torch.rand(B, L, Hv, generator=gen).to(device)
        beta = torch.rand(B, L, Hv, generator=gen).to(device, torch.bfloat16)
        state0 = torch.randn(B, Hv, D, D, generator=gen).to(device)
        o1, s1 = fla_gated_delta.gated_delta_forward(q, k, v, g, beta, state0, True)
        o2, s2 = gated_delta_rule_reference(q, k, v, g, beta, state0, True)
        out["fla_vs_reference_bf16"] = {
            "out_rel_l2": ((o1.float() - o2.float()).norm() / o2.float().norm()).item(),
            "state_rel_l2": ((s1 - s2).norm() / s2.norm()).item(),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    result = {**provenance(f"python benchmarks/gpu_smoke.py --out benchmarks/results/{Path(args.out).name}"),
              "transformers": transformers.__version__}
    result["dense_parity_fp32"] = dense_parity(device)
    print("dense", result["dense_parity_fp32"], flush=True)
    result["hybrid_parity_fp32"] = hybrid_parity(device)
    print("hybrid", result["hybrid_parity_fp32"], flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
