"""One GRPO step, LongStraw against the eager baselines, on the same inputs.

Modes (same model, prompt, responses, advantages and loss in every one):

  eager                the concatenated [prompt; response_g] batch under
                       autograd, with `logits_to_keep` (what TRL/verl do)
  eager_ckpt           the same with HF gradient checkpointing
  eager_shared_prefix  the prompt once, the branches attend to it, one
                       autograd graph (the PrefixGrouper idea). Dense: the
                       packed sequence [prompt, r_1 .. r_G] under a flex
                       attention block mask, so nothing is copied G times.
                       Hybrid: the branches continue from the prompt's HF
                       cache, repeated G times (flex packing cannot express
                       recurrent layers).
  longstraw_detached   torch.compile(loss, backend=longstraw, prompt_grad="detached")
  longstraw_exact      the same with prompt_grad="exact"

Models: `dense` is the 4-layer slice with Qwen3-8B layer shapes, `hybrid`
3 Gated DeltaNet + 1 full attention layers at transformers' default
Qwen3_5TextConfig shapes; bf16, random init. Eager hybrid modes run HF's
PyTorch Gated DeltaNet (fla's backward does not run on this Triton).

Parts (`--parts`), all in one process; every run is bounded by
`--budget-s` so a command stays inside the 10-minute device limit:

  sweep    per mode (--sweep-modes, in that order), P doubles from --p-min
           (or --start MODE:P) until it runs out of memory, would exceed
           the time left, or reaches --p-max; then bisection between the
           last success and the first failure. Every run's peak allocated
           memory and step time are recorded (plot: peak vs P).
  gdelta   peak(G=8) - peak(G=2) at --p-gdelta for the longstraw modes.
  speed    warm step time of every mode at --p-speed (and MFU); the
           report keeps the entries of every P measured.
  parity   longstraw exact against eager (checkpointed, same math) at
           --p-parity, float32 (relative L2) and bf16 (cosine); both
           float32 runs also against a float64 eager run.
  kernels  flash and cuDNN against the explicit-softmax kernel, and their
           forward speed at a capture chunk.
  capture  the compiled forward at --p-capture, flash and cuDNN attention.
  trace    what is live at the peak of a longstraw step (allocator trace).
  profile  where a longstraw step's time goes (torch.profiler), at --p-speed.

MFU counts model FLOPs the mode's algorithm needs, without recomputation:
2 per parameter-token in every linear (the LM head only on the kept
positions), 4*H*D per visible key per query in attention, 4*H*Dk*Dv per
token in Gated DeltaNet; backward is twice forward. At prompt positions the
last layer counts only what its state needs (its output feeds no kept logit). Eager modes process G
copies of the prompt, shared-prefix and exact one, detached one without
backward. Against 790 TFLOP/s (H200 dense bf16, see the device notes).

Each run writes `<out-dir>/grpo_bench_<model>.json`; `--report` turns result
files into the plot and `summary.json` (on a machine with matplotlib):

    python benchmarks/grpo_bench.py --model dense --out-dir $OUT
    python benchmarks/grpo_bench.py --report benchmarks/results/grpo_bench_*.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import logging
import math
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from longstraw.models import qwen3_5
from torch.nn.attention import SDPBackend, sdpa_kernel

import longstraw

PEAK_FLOPS = 790e12
MODES = ("eager", "eager_ckpt", "eager_shared_prefix", "longstraw_detached", "longstraw_exact")
GiB = 1e9  # decimal GB, as nvidia-smi and the issue report memory


# model --------------------------------------------------------------------


def dense_config(tiny: bool) -> transformers.PretrainedConfig:
    if tiny:
        shapes = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256}
    else:
        shapes = {"hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936}
    return transformers.Qwen3Config(num_hidden_layers=4, max_position_embeddings=1 << 22, **shapes)


def hybrid_config(tiny: bool) -> transformers.PretrainedConfig:
    layers = ["linear_attention"] * 3 + ["full_attention"]
    if tiny:
        return qwen3_5.tiny_config(layer_types=layers, max_position_embeddings=1 << 22)
    return transformers.Qwen3_5TextConfig(num_hidden_layers=4, layer_types=layers, max_position_embeddings=1 << 22)


def build_model(kind: str, tiny: bool, dtype: torch.dtype, device: torch.device) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = dense_config(tiny) if kind == "dense" else hybrid_config(tiny)
    cls = transformers.Qwen3ForCausalLM if kind == "dense" else transformers.Qwen3_5ForCausalLM
    with torch.device(device):
        model = cls(config).to(dtype)
    model.train()  # attention dropout is 0; train() is what checkpointing needs
    return model


# loss and inputs ------------------------------------------------------------


def grpo_loss(model, input_ids, advantages, completion_mask, logits_to_keep: int):
    """TRL's GRPO loss at one policy step (ratio 1, no KL), per-token mean."""
    logits = model(input_ids=input_ids, logits_to_keep=logits_to_keep + 1).logits[:, :-1].float()
    completion = input_ids[:, -logits_to_keep:]
    logp = logits.gather(-1, completion.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
    return _policy_loss(logp, advantages, completion_mask)


def _policy_loss(logp, advantages, completion_mask):
    ratio = torch.exp(logp - logp.detach())
    return -((ratio * advantages[:, None]) * completion_mask).sum() / completion_mask.sum()


@dataclasses.dataclass
class Group:
    prompt: torch.Tensor  # [P]
    responses: torch.Tensor  # [G, R]
    advantages: torch.Tensor  # [G]
    mask: torch.Tensor  # [G, R]

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt.expand(self.responses.shape[0], -1), self.responses], 1)


def make_group(G: int, P: int, R: int, vocab: int, device: torch.device) -> Group:
    gen = torch.Generator().manual_seed(P * 1000 + G)
    return Group(
        prompt=torch.randint(0, vocab, (P,), generator=gen).to(device),
        responses=torch.randint(0, vocab, (G, R), generator=gen).to(device),
        advantages=torch.randn(G, generator=gen).to(device),
        mask=torch.ones(G, R, device=device),
    )


# the modes --------------------------------------------------------------------


def eager_step(model, group: Group) -> torch.Tensor:
    return grpo_loss(model, group.input_ids, group.advantages, group.mask, group.responses.shape[1])


def shared_prefix_dense(model, group: Group) -> torch.Tensor:
    """Packed [prompt, r_1[:-1] .. r_G[:-1]]: each response token attends to
    the prompt and its own response; the prompt's last logit is shared."""
    from torch.nn.attention.flex_attention import create_block_mask

    (P,), (G, R) = group.prompt.shape, group.responses.shape
    device = group.prompt.device
    ids = torch.cat([group.prompt, group.responses[:, :-1].flatten()])[None]
    positions = torch.cat([torch.arange(P, device=device), (P + torch.arange(R - 1, device=device)).repeat(G)])[None]
    segment = torch.cat([torch.zeros(P, dtype=torch.long, device=device), torch.arange(1, G + 1, device=device).repeat_interleave(R - 1)])

    def same_branch_or_prompt(b, h, q, kv):
        return (kv <= q) & ((segment[kv] == 0) | (segment[kv] == segment[q]))

    n = ids.shape[1]
    block_mask = create_block_mask(same_branch_or_prompt, None, None, n, n, device=device, _compile=True)
    logits = model(input_ids=ids, position_ids=positions, attention_mask=block_mask, logits_to_keep=G * (R - 1) + 1).logits[0]
    first, rest = logits[:1].float(), logits[1:].float().view(G, R - 1, -1)
    per_branch = torch.cat([first.expand(G, 1, -1), rest], 1)  # [G, R, V]
    logp = per_branch.gather(-1, group.responses.unsqueeze(-1)).squeeze(-1) - per_branch.logsumexp(-1)
    return _policy_loss(logp, group.advantages, group.mask)


def shared_prefix_cached(model, group: Group) -> torch.Tensor:
    """Prompt[:-1] once with a cache, then the G branches from that cache
    (repeated along the batch), all under autograd."""
    (P,), (G, R) = group.prompt.shape, group.responses.shape
    cache = model(input_ids=group.prompt[None, :-1], use_cache=True).past_key_values
    for layer in cache.layers:
        _repeat_layer(layer, G)
    ids = torch.cat([group.prompt[-1:].expand(G, 1), group.responses[:, :-1]], 1)
    positions = torch.arange(P - 1, P - 1 + R, device=ids.device)[None].expand(G, -1)
    logits = model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True).logits.float()
    logp = logits.gather(-1, group.responses.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
    return _policy_loss(logp, group.advantages, group.mask)


def _repeat_layer(layer, G: int) -> None:
    """Repeat a cache layer G times along the batch, keeping autograd: HF's
    linear-attention layers update their states in place, which would
    overwrite tensors the prompt's backward needs, so the branch pass gets
    functional updates instead."""
    if hasattr(layer, "recurrent_states"):
        conv = layer.conv_states[0].repeat_interleave(G, 0)
        layer.recurrent_states[0] = layer.recurrent_states[0].repeat_interleave(G, 0)
        layer.update_conv_state = lambda new, state_idx=0, **kw: torch.cat([conv, new], -1)
        layer.update_recurrent_state = lambda state, state_idx=0, **kw: state
    else:
        layer.batch_repeat_interleave(G)


class Runner:
    """Builds the step of one mode for one model; `step(group)` runs loss + backward.
    The hybrid's Gated DeltaNet runs LongStraw's operators in the longstraw
    modes and, with `longstraw_operators`, in the eager ones too; else HF's own."""

    def __init__(self, model, kind: str, mode: str, longstraw_operators: bool = False) -> None:
        self.model, self.kind, self.mode = model, kind, mode
        self.longstraw_operators = longstraw_operators or mode.startswith("longstraw")
        self.compiled: Callable | None = None

    def __enter__(self):
        model = self.model
        if self.kind == "hybrid":
            self._unbind = qwen3_5.bind() if self.longstraw_operators else _torch_gated_delta()
        if self.mode == "eager_ckpt":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.mode == "eager_shared_prefix" and self.kind == "dense":
            model.set_attn_implementation("flex_attention")
        if self.mode.startswith("longstraw"):
            torch._dynamo.reset()
            backend = longstraw.Backend(prompt_grad=self.mode.removeprefix("longstraw_"))
            self.compiled = torch.compile(grpo_loss, backend=backend)
        return self

    def __exit__(self, *exc):
        if self.mode == "eager_ckpt":
            self.model.gradient_checkpointing_disable()
        if self.mode == "eager_shared_prefix" and self.kind == "dense":
            self.model.set_attn_implementation("sdpa")
        if self.kind == "hybrid":
            qwen3_5.unbind(self._unbind)
        self.compiled = None
        torch._dynamo.reset()

    def step(self, group: Group) -> torch.Tensor:
        model = self.model
        model.zero_grad(set_to_none=True)
        if self.compiled is not None:
            loss = self.compiled(model, group.input_ids, group.advantages, group.mask, group.responses.shape[1])
        elif self.mode == "eager_shared_prefix":
            loss = (shared_prefix_dense if self.kind == "dense" else shared_prefix_cached)(model, group)
        else:
            loss = eager_step(model, group)
        loss.backward()
        return loss.detach()


def _torch_gated_delta():
    """Eager hybrid runs HF's own PyTorch kernels, whatever HF resolved at import."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as hf

    replaced = {}
    for name in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn"):
        fn = getattr(hf, name)
        replaced[(hf, name)] = fn
        setattr(hf, name, getattr(fn, "__wrapped__", fn))
    return replaced


# measuring ----------------------------------------------------------------------


def is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


def release(model=None) -> None:
    """Drop gradients (of `model`, when given) and cached device memory."""
    if model is not None:
        model.zero_grad(set_to_none=True)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure(runner: Runner, group: Group, repeats: int = 1, warmup: bool = False) -> dict:
    """One (or `repeats`) steps: peak allocated memory and seconds per step.
    The first call at a new shape plans (and compiles); with `warmup` it is
    run once untimed."""
    model = runner.model
    try:
        if warmup:
            runner.step(group)
            release(model)
        times = []
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            runner.step(group)
            sync()
            times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
        return {"ok": True, "seconds": min(times), "peak_gb": peak / GiB, "includes_planning": not warmup}
    except Exception as error:  # noqa: BLE001 - every failure is recorded, the sweep goes on
        if not is_oom(error):
            return {"ok": False, "error": f"{type(error).__name__}: {str(error)[:400]}"}
        return {"ok": False, "oom": True}
    finally:
        release(model)


# FLOPs --------------------------------------------------------------------------


# What the last layer must compute at a prompt position whose own output no
# logit reads: the state later tokens need (K/V, or the recurrent state's inputs).
LAST_LAYER_STATE_PARAMS = {
    "full_attention": ("k_proj", "v_proj"),
    "linear_attention": ("in_proj_qkv", "in_proj_a", "in_proj_b"),
}


@dataclasses.dataclass
class FlopModel:
    """Forward FLOPs per token and per (query, key) pair, from the config.

    Only the last R+1 logits are read, so at prompt positions the last
    layer's output is dead: the prompt needs only its state (`prompt`).
    LongStraw's capture computes exactly that; eager computes more, and MFU
    counts the useful work of every mode alike."""

    linear_per_token: float  # all linears but the LM head, per token
    head_per_token: float
    attention_per_pair: float  # summed over full-attention layers
    recurrent_per_token: float  # Gated DeltaNet state update and readout
    dead_per_token: float = 0.0  # last layer's work at a prompt position beyond its state
    dead_per_pair: float = 0.0

    @classmethod
    def of(cls, model) -> FlopModel:
        cfg = model.config
        head = model.get_output_embeddings().weight.numel()
        embed = model.get_input_embeddings().weight.numel()
        linear = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2) - head - (0 if cfg.tie_word_embeddings else embed)
        types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
        pair = 4 * cfg.num_attention_heads * cfg.head_dim
        recurrent = 4 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim if "linear_attention" in types else 0
        full = sum(t == "full_attention" for t in types)
        kept = LAST_LAYER_STATE_PARAMS[types[-1]]
        dead_linear = sum(p.numel() for n, p in model.model.layers[-1].named_parameters()
                          if p.dim() == 2 and not any(k in n for k in kept))
        last_full = types[-1] == "full_attention"
        # a last linear-attention layer still updates its state (half of `recurrent`); its readout is dead
        return cls(2 * linear, 2 * head, full * pair, (len(types) - full) * recurrent,
                   dead_per_token=2 * dead_linear + (0 if last_full else recurrent / 2), dead_per_pair=pair if last_full else 0)

    def forward(self, tokens: int, pairs: float, head_tokens: int) -> float:
        return (self.linear_per_token + self.recurrent_per_token) * tokens + self.attention_per_pair * pairs + self.head_per_token * head_tokens

    def prompt(self, P: int) -> float:
        pairs = P * (P + 1) / 2
        return self.forward(P, pairs, 0) - self.dead_per_token * P - self.dead_per_pair * pairs

    def branches(self, G: int, P: int, R: int) -> float:
        return self.forward(G * R, G * (R * P + R * (R + 1) / 2), G * R)

    def compiled_forward(self, G: int, P: int, R: int) -> float:
        """The compiled loss's forward: prompt capture plus the G branch forwards."""
        return self.prompt(P) + self.branches(G, P, R)

    def step(self, mode: str, G: int, P: int, R: int) -> float:
        if mode in ("eager", "eager_ckpt"):
            return 3 * (G * self.prompt(P) + self.branches(G, P, R))
        if mode == "longstraw_detached":
            return self.prompt(P) + 3 * self.branches(G, P, R)
        return 3 * (self.prompt(P) + self.branches(G, P, R))


# parts ----------------------------------------------------------------------------


class Clock:
    def __init__(self, budget_s: float) -> None:
        self.end = time.perf_counter() + budget_s

    def left(self) -> float:
        return self.end - time.perf_counter()


# Seconds a mode's first sweep step needs before it is started: flex attention
# compiles its kernels and block mask per prompt length (about 150 s on the H200).
FIRST_STEP_S = {("dense", "eager_shared_prefix"): 180.0}
MODE_RESERVE_S = 60.0  # kept back for each later mode of the sweep


def next_step_seconds(runs: list[dict]) -> float:
    """The step time at the next doubling of P, from the last two successes:
    their ratio (attention makes it up to 4x), with a 20% margin."""
    ok = [r for r in runs if r["ok"]]
    if not ok:
        return 0.0
    last = ok[-1]["seconds"]
    if len(ok) < 2 or ok[-2]["P"] * 2 != ok[-1]["P"]:
        return 4 * last
    return last * min(4.0, max(2.0, 1.2 * last / ok[-2]["seconds"]))


BISECT_ALIGN = 1024  # the bisection tries multiples of this (of the resolution when that is smaller)


def bisect_largest(lo: int, hi: int, attempt: Callable[[int], dict], resolution: int, has_time: Callable[[], bool]) -> tuple[int, int]:
    """Narrow `lo` (runs) and `hi` (out of memory) to `resolution`, or lo/16
    when that is larger; stops early when the aligned midpoint is no new
    length, a run fails otherwise, or time runs out."""
    align = min(BISECT_ALIGN, resolution)
    while hi - lo > max(resolution, lo // 16) and has_time():
        mid = (lo + hi) // 2 // align * align
        if not lo < mid < hi:
            break
        result = attempt(mid)
        if result["ok"]:
            lo = mid
        elif result.get("oom"):
            hi = mid
        else:
            break
    return lo, hi


def sweep(model, kind, modes, args, clock: Clock, flops: FlopModel, out: dict, save: Callable[[], None]) -> dict:
    """Peak memory vs P and the largest P per mode: doubling, then bisection.
    Modes run in the order given; each may use the time left but
    MODE_RESERVE_S for every later mode. `out` is filled and saved after every run."""
    vocab = model.config.vocab_size
    for i, mode in enumerate(modes):
        mode_clock = Clock(clock.left() - MODE_RESERVE_S * (len(modes) - i - 1))
        runs, last_ok, first_bad = [], None, None
        out[mode] = entry = {"runs": runs, "max_prompt_tokens": None, "first_failure": None, "limited_by": "time"}
        stop = "p_max"
        with Runner(model, kind, mode) as runner:

            def attempt(P, runner=runner, mode=mode, runs=runs):
                result = measure(runner, make_group(args.G, P, args.R, vocab, model.device))
                result.update(P=P, G=args.G, R=args.R)
                if result["ok"]:
                    result["mfu"] = flops.step(mode, args.G, P, args.R) / result["seconds"] / PEAK_FLOPS
                runs.append(result)
                save()
                print(f"  {kind} {mode:20} P={P:>8} {_describe(result)}", flush=True)
                return result

            P = args.start.get(mode, args.p_min)
            if mode_clock.left() < FIRST_STEP_S.get((kind, mode), 30.0):
                print(f"  {kind} {mode:20} not run: {mode_clock.left():.0f}s left", flush=True)
                continue
            while P <= args.p_max:
                if next_step_seconds(runs) > mode_clock.left():
                    stop = "time"
                    break
                result = attempt(P)
                if not result["ok"]:
                    first_bad, stop = P, "oom" if result.get("oom") else "error"
                    break
                last_ok = P
                P *= 2
            if last_ok is not None and first_bad is not None and stop == "oom":
                has_time = lambda runs=runs, clock=mode_clock: next_step_seconds(runs) < clock.left()  # noqa: E731
                last_ok, first_bad = bisect_largest(last_ok, first_bad, attempt, args.bisect_resolution, has_time)
        entry.update(max_prompt_tokens=last_ok, first_failure=first_bad, limited_by=stop)
        save()
    return out


def gdelta(model, kind, args, clock: Clock, sweep_out: dict) -> dict:
    """The G=8 peak is the sweep's run at the same P when there is one."""
    out = {}
    vocab = model.config.vocab_size
    for mode in ("longstraw_detached", "longstraw_exact"):
        with Runner(model, kind, mode) as runner:
            peaks = {}
            for run in sweep_out.get(mode, {}).get("runs", []):
                if run["P"] == args.p_gdelta and run["G"] == 8 and run["ok"]:
                    peaks[8] = run
            for G in [G for G in (2, 8) if G not in peaks]:
                if clock.left() < 30:
                    break
                result = measure(runner, make_group(G, args.p_gdelta, args.R, vocab, model.device))
                print(f"  {kind} {mode:20} P={args.p_gdelta:>8} G={G} {_describe(result)}", flush=True)
                peaks[G] = result
        if all(peaks.get(G, {}).get("ok") for G in (2, 8)):
            out[mode] = {"P": args.p_gdelta, "peak_g2_gb": peaks[2]["peak_gb"], "peak_g8_gb": peaks[8]["peak_gb"],
                         "delta_gb": peaks[8]["peak_gb"] - peaks[2]["peak_gb"]}
        else:
            out[mode] = {"P": args.p_gdelta, "runs": peaks}
    return out


def speed(model, kind, modes, args, clock: Clock, flops: FlopModel) -> dict:
    out = {}
    vocab = model.config.vocab_size
    group = make_group(args.G, args.p_speed, args.R, vocab, model.device)
    for mode in modes:
        if clock.left() < 30:
            out[mode] = {"skipped": "time budget"}
            continue
        with Runner(model, kind, mode) as runner:
            result = measure(runner, group, repeats=2, warmup=True)
        result["P"] = args.p_speed
        if result["ok"]:
            result["mfu"] = flops.step(mode, args.G, args.p_speed, args.R) / result["seconds"] / PEAK_FLOPS
        print(f"  {kind} {mode:20} P={args.p_speed:>8} warm {_describe(result)}", flush=True)
        out[mode] = result
    return out


def capture_mfu(model, kind, args, clock: Clock, flops: FlopModel) -> dict:
    """The compiled loss's forward at --p-capture (prompt capture plus the G
    branch forwards, both counted), once per attention kernel: the default
    (flash) and cuDNN, chosen as users choose it, through PyTorch's SDPA switch."""
    vocab = model.config.vocab_size
    group = make_group(args.G, args.p_capture, args.R, vocab, model.device)
    work = flops.compiled_forward(args.G, args.p_capture, args.R)
    out = {"P": args.p_capture, "forward_flops": work, "kernels": {}}
    for kernel, backends in (("flash", None), ("cudnn", [SDPBackend.CUDNN_ATTENTION])):
        if clock.left() < 60:
            break
        with Runner(model, kind, "longstraw_detached") as runner:

            def forward(runner=runner):  # no backward
                runner.compiled(model, group.input_ids, group.advantages, group.mask, args.R)

            try:
                forward()  # plan
                release(model)
                # the switch is read when the steps run (tracing under it would plan SDPA for cuDNN alone)
                with sdpa_kernel(backends) if backends else contextlib.nullcontext():
                    forward()  # untimed: cuDNN builds an execution plan per new shape on first use
                    release(model)
                    sync()
                    t0 = time.perf_counter()
                    forward()
                    sync()
                    seconds = time.perf_counter() - t0
                out["kernels"][kernel] = {"forward_seconds": seconds, "mfu": work / seconds / PEAK_FLOPS}
            except Exception as error:  # noqa: BLE001
                out["kernels"][kernel] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
            finally:
                release(model)
        print(f"  {kind} capture P={args.p_capture} {kernel}: {out['kernels'][kernel]}", flush=True)
    done = {k: v for k, v in out["kernels"].items() if "mfu" in v}
    if done:
        best = max(done, key=lambda k: done[k]["mfu"])
        out.update(kernel=best, **done[best])
    return out


def grads_of(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def compare(got: dict, want: dict) -> dict:
    got, want = ({n: g.double() for n, g in grads.items()} for grads in (got, want))
    rel = {n: ((got[n] - want[n]).norm() / want[n].norm().clamp_min(1e-30)).item() for n in want}
    cos = {n: torch.nn.functional.cosine_similarity(got[n].flatten(), want[n].flatten(), dim=0).item() for n in want}
    worst = max(rel, key=rel.get)
    return {"max_rel_l2": rel[worst], "worst_parameter": worst, "min_cosine": min(cos.values()), "parameters": len(want)}


def reference_grads(model, kind: str, group: Group, bound: bool = False) -> dict[str, torch.Tensor]:
    """Eager gradients, accumulated branch by branch: the loss is a sum over
    branches, and one sequence at a time keeps float32 attention (SDPA's
    math kernel under grouped K/V, [G, H, N, N] scores at once) in memory.
    `bound` runs the hybrid's Gated DeltaNet through LongStraw's operators,
    which compute in the input dtype (HF's own kernel rounds through float32)."""
    model.zero_grad(set_to_none=True)
    with Runner(model, kind, "eager_ckpt", longstraw_operators=bound):
        for g in range(group.responses.shape[0]):
            branch = Group(group.prompt, group.responses[g : g + 1], group.advantages[g : g + 1], group.mask[g : g + 1])
            share = branch.mask.sum() / group.mask.sum()
            (eager_step(model, branch) * share).backward()
    return grads_of(model)


def _on_cpu(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Host copies: the float64 gradients wait there while the float32 runs use the device."""
    return {n: g.cpu() for n, g in grads.items()}


def parity(kind, args, device) -> dict:
    """longstraw exact against the eager reference (`reference_grads`) in
    float32 and bf16; both float32 runs also against a float64 eager run
    (`longstraw_vs_float64`, `eager_vs_float64`), which says whose rounding
    a float32 gap is."""
    out = {}
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    truth = None
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        model = build_model(kind, args.tiny, dtype, device)
        group = make_group(args.G, args.p_parity, args.R, model.config.vocab_size, device)
        result = {}
        try:
            if dtype == torch.float64:
                truth = _on_cpu(reference_grads(model, kind, group, bound=True))
            else:
                want = reference_grads(model, kind, group)
                with Runner(model, kind, "longstraw_exact") as runner:
                    runner.step(group)
                got = grads_of(model)
                result = compare(got, want)
                if dtype == torch.float32 and truth is not None:
                    result["longstraw_vs_float64"] = compare(_on_cpu(got), truth)["max_rel_l2"]
                    result["eager_vs_float64"] = compare(_on_cpu(want), truth)["max_rel_l2"]
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
    from longstraw.kernels import attention

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


def _describe(result: dict) -> str:
    if result.get("ok"):
        mfu = f" MFU {result['mfu']:.1%}" if "mfu" in result else ""
        return f"{result['seconds']:.2f}s {result['peak_gb']:.1f}GB{mfu}"
    return "OOM" if result.get("oom") else result.get("error", "failed")


def peak_breakdown(model, kind, mode, args, top: int = 14) -> dict:
    """What is live at the peak of one step: the allocator's trace replayed
    to its maximum, live blocks grouped by the innermost frame in this
    project or transformers."""
    group = make_group(args.G, args.p_trace, args.R, model.config.vocab_size, model.device)
    with Runner(model, kind, mode) as runner:
        runner.step(group)  # plan outside the trace
        release(model)
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
        try:
            runner.step(group)
            snapshot = torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
            release(model)
    events = [e for trace in snapshot["device_traces"] for e in trace if e["action"] in ("alloc", "free_requested")]
    current = peak = peak_at = 0
    for i, e in enumerate(events):
        current += e["size"] if e["action"] == "alloc" else -e["size"]
        if current > peak:
            peak, peak_at = current, i
    live: dict[int, dict] = {}
    for e in events[: peak_at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        else:
            live.pop(e["addr"], None)
    groups: dict[str, int] = {}
    for e in live.values():
        frames = [f for f in e.get("frames", []) if any(k in f["filename"] for k in ("longstraw", "passes", "transformers", "grpo_bench"))]
        where = f"{os.path.basename(frames[0]['filename'])}:{frames[0]['line']} {frames[0]['name']}" if frames else "(no python frame)"
        groups[where] = groups.get(where, 0) + e["size"]
    ranked = sorted(groups.items(), key=lambda kv: -kv[1])[:top]
    out = {"mode": mode, "P": args.p_trace, "traced_growth_gb": peak / GiB,
           "top": [{"where": w, "gb": b / GiB} for w, b in ranked]}
    print(f"  {kind} {mode} P={args.p_trace} live at peak (growth during the step {peak / GiB:.1f} GB):", flush=True)
    for w, b in ranked:
        print(f"    {b / GiB:7.2f} GB  {w}", flush=True)
    return out


def profile_step(model, kind, mode, args, top: int = 12) -> dict:
    """Where a warm step's time goes: the top operators by device and by host
    time, and which attention kernel the steps chose."""
    chosen: dict[str, int] = {}

    class Counting(logging.Handler):
        """Counts the attention kernels the steps choose (logged at DEBUG)."""

        def emit(self, record: logging.LogRecord) -> None:
            key = record.getMessage()
            chosen[key] = chosen.get(key, 0) + 1

    group = make_group(args.G, args.p_speed, args.R, model.config.vocab_size, model.device)
    log, handler = logging.getLogger("longstraw.attention"), Counting()
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        with Runner(model, kind, mode) as runner:
            runner.step(group)
            release(model)
            chosen.clear()
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=activities) as prof:
                runner.step(group)
                sync()
            release(model)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    events = prof.key_averages()
    by_device = sorted(events, key=lambda e: -e.self_device_time_total)[:top]
    by_host = sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]
    out = {
        "mode": mode, "P": args.p_speed, "kernels": chosen,
        "device_ms": [{"op": e.key, "ms": e.self_device_time_total / 1e3, "calls": e.count} for e in by_device],
        "host_ms": [{"op": e.key, "ms": e.self_cpu_time_total / 1e3, "calls": e.count} for e in by_host],
    }
    print(f"  {kind} {mode} P={args.p_speed} profile: kernels {chosen}", flush=True)
    for e in by_device:
        print(f"    device {e.self_device_time_total / 1e3:9.1f} ms {e.count:6d}x {e.key[:90]}", flush=True)
    for e in by_host:
        print(f"    host   {e.self_cpu_time_total / 1e3:9.1f} ms {e.count:6d}x {e.key[:90]}", flush=True)
    return out


# memory floor ---------------------------------------------------------------------


def memory_floor(model, kind, args, sweep_out: dict) -> dict:
    """weights + grads + state(P) (+ d(state) in exact mode) + one branch + one chunk,
    per longstraw run (`floor_gb`). The state comes from the plan of a small
    run; one branch and one chunk are the activations of eager fwd+bwd over R
    and over one chunk of a single sequence (detached: the chunk without
    grad), measured with every .grad already held, as LongStraw holds the
    sum while it replays the branches and chunks after the first. The
    hybrid's Gated DeltaNet runs LongStraw's operators there, as in the
    step (HF's PyTorch kernel keeps several times their activations)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    vocab = model.config.vocab_size
    backend = longstraw.Backend(prompt_grad="exact")
    group = make_group(2, 4096, 64, vocab, model.device)
    with Runner(model, kind, "longstraw_exact") as runner:
        runner.compiled = torch.compile(grpo_loss, backend=backend)
        runner.step(group)
    plan = backend.plans[-1]
    release(model)
    chunk = plan.options.prefix_chunk_size  # as planned: the option itself may be None
    activations = {}
    with Runner(model, kind, "eager", longstraw_operators=True) as runner:
        for name, P, R, grad in (("branch", 1, args.R, True), ("chunk_grad", chunk, 1, True), ("chunk_nograd", chunk, 1, False)):
            g = make_group(1, P, R, vocab, model.device)
            release(model)
            if grad:
                runner.step(g)  # allocates every .grad
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            with torch.set_grad_enabled(grad):
                if grad:
                    eager_step(model, g).backward()  # accumulates into the held .grad
                else:
                    model(input_ids=g.input_ids, logits_to_keep=1)
            activations[name] = torch.cuda.max_memory_allocated() - base
            release(model)
    out = {"weights_gb": weights / GiB, "grads_gb": weights / GiB, "grads_held": True, "longstraw_operators": True,
           "state_bytes_per_position": plan.state_bytes_per_position, "state_fixed_bytes": plan.state_fixed_bytes,
           "activations_gb": {k: v / GiB for k, v in activations.items()}, "prefix_chunk_size": chunk, "runs": []}
    for mode in ("longstraw_detached", "longstraw_exact"):
        for run in sweep_out.get(mode, {}).get("runs", []):
            if run["ok"]:
                out["runs"].append({"mode": mode, "P": run["P"], "peak_gb": run["peak_gb"]})
    return score_floor(out, args.R)


def score_floor(floor: dict, R: int) -> dict:
    """`floor_gb` and `over_floor` of every run from the measured terms: the
    issue's sum. `phase_floor_gb` takes the larger of the branch and the
    chunk instead, as the step never holds both: the prompt chunks run
    before the branches, the reverse pass after them.
    Files without `grads_held` measured the branch and chunk from empty
    .grad, so their peaks include the gradients the backward allocated;
    those come off, which leaves a lower bound on the activations (the
    eager step's peak can fall where its activations and its gradients are
    not both live): their floors are lower bounds."""
    acts = floor["activations_gb"]
    grads = 0.0 if floor.get("grads_held") else floor["grads_gb"]
    for run in floor["runs"]:
        P, exact = run["P"], run["mode"] == "longstraw_exact"
        chunks = math.ceil((P - 1) / floor["prefix_chunk_size"])
        state = (floor["state_bytes_per_position"] * (P - 1 + R) + floor["state_fixed_bytes"] * (chunks + 1)) / GiB
        chunk = acts["chunk_grad"] - grads if exact else acts["chunk_nograd"]
        held = floor["weights_gb"] + floor["grads_gb"] + state * (2 if exact else 1)
        run["floor_gb"] = held + acts["branch"] - grads + chunk
        run["over_floor"] = run["peak_gb"] / run["floor_gb"] - 1
        run["phase_floor_gb"] = held + max(acts["branch"] - grads, chunk)
        run["over_phase_floor"] = run["peak_gb"] / run["phase_floor_gb"] - 1
    return floor


# output -----------------------------------------------------------------------------


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m in results if "sweep" in results[m]]
    if not models:
        return
    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 5), squeeze=False)
    for ax, kind in zip(axes[0], models):
        for mode, data in sorted(results[kind]["sweep"].items(), key=lambda item: MODES.index(item[0])):
            ok = [r for r in data["runs"] if r["ok"]]
            for warm in speed_runs(results[kind]):
                if warm["mode"] == mode and warm.get("ok") and all(r["P"] != warm["P"] for r in ok):
                    ok.append(warm)
            if ok:
                ok.sort(key=lambda r: r["P"])
                color = f"C{MODES.index(mode)}"  # one colour per mode in every panel
                ax.plot([r["P"] for r in ok], [r["peak_gb"] for r in ok], marker="o", label=mode, color=color)
        ax.axhline(141, color="gray", linestyle=":", label="H200 (141 GB)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens P")
        ax.set_ylabel("peak allocated GB")
        ax.set_title(f"{kind}: one GRPO step, G={results[kind]['G']}, R={results[kind]['R']}, bf16")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summarize(result: dict) -> dict:
    sweep_out = result.get("sweep", {})
    summary = {
        "max_prompt_tokens": {m: d["max_prompt_tokens"] for m, d in sweep_out.items()},
        "max_prompt_limited_by": {m: d["limited_by"] for m, d in sweep_out.items()},
        "command": [s["command"] for s in result["sources"]],
        "git_commit": [s["git_commit"] for s in result["sources"]],
        "sources": result["sources"],
    }
    gd = result.get("gdelta", {})
    summary["peak_delta_g2_to_g8_gb"] = {m: d.get("delta_gb") for m, d in gd.items()}
    timed = speed_runs(result)
    warm = {(r["mode"], r["P"]): r for r in timed if r.get("ok")}
    speedups = {P: warm[("eager_ckpt", P)]["seconds"] / warm[("longstraw_exact", P)]["seconds"]
                for mode, P in warm if mode == "longstraw_exact" and ("eager_ckpt", P) in warm}
    if timed:
        summary["speedup_vs_eager_ckpt_at_32k"] = speedups.get(32768)
        summary["speedup_vs_eager_ckpt_by_p"] = dict(sorted(speedups.items()))
    if "capture" in result:
        summary["prefix_capture_mfu"] = result["capture"].get("mfu")
        summary["prefix_capture_at_p"] = result["capture"].get("P")
        summary["prefix_capture_kernel"] = result["capture"].get("kernel", "flash")
        summary["prefix_capture_mfu_by_kernel"] = {k: v.get("mfu") for k, v in result["capture"].get("kernels", {}).items()}
    for key, by_mode in floor_ranges(result).items():
        summary[f"peak_{key}"] = by_mode
    par = result.get("parity", {})
    if par:
        summary["parity_fp32_max_rel_l2"] = par.get("float32", {}).get("max_rel_l2")
        summary["parity_bf16_min_cosine"] = par.get("bfloat16", {}).get("min_cosine")
        if "longstraw_vs_float64" in par.get("float32", {}):
            summary["parity_fp32_max_rel_l2_vs_float64"] = {
                "longstraw": par["float32"]["longstraw_vs_float64"], "eager": par["float32"]["eager_vs_float64"]}
    return summary


def floor_ranges(result: dict) -> dict[str, dict[str, dict[str, float]]]:
    """Per score (`over_floor`, `over_phase_floor`) and mode, its min and max over the floor runs."""
    runs = result.get("memory_floor", {}).get("runs", [])
    return {
        key: {mode: {"max": max(r[key] for r in runs if r["mode"] == mode), "min": min(r[key] for r in runs if r["mode"] == mode)}
              for mode in sorted({r["mode"] for r in runs})}
        for key in ("over_floor", "over_phase_floor") if runs
    }


def print_table(kind: str, result: dict) -> None:
    print(f"\n== {kind} (G={result['G']}, R={result['R']})")
    if "sweep" in result:
        print(f"{'mode':22} {'max P':>9} {'limit':>6}   peak GB by P")
        for mode, data in result["sweep"].items():
            by_p = {r["P"]: r["peak_gb"] for r in data["runs"] if r["ok"]}  # a length may have run more than once
            peaks = " ".join(f"{P // 1024}K:{peak:.0f}" for P, peak in by_p.items())
            print(f"{mode:22} {data['max_prompt_tokens'] or 0:>9} {data['limited_by']:>6}   {peaks}")
    if speed_runs(result):
        print(f"{'mode':22} {'P':>9} {'s/step':>8} {'MFU':>6}")
        for r in sorted(speed_runs(result), key=lambda r: r["P"]):
            if r.get("ok"):
                print(f"{r['mode']:22} {r['P']:>9} {r['seconds']:>8.2f} {r['mfu']:>6.1%}")
            else:
                print(f"{r['mode']:22} {r['P']:>9} {_describe(r):>8}")
    ranges = floor_ranges(result)
    for mode in ranges.get("over_floor", {}):
        over, phase = ranges["over_floor"][mode], ranges["over_phase_floor"][mode]
        print(f"{mode:22} peak over floor {over['min']:+.1%}..{over['max']:+.1%}, "
              f"over phase floor {phase['min']:+.1%}..{phase['max']:+.1%}")
    for key in ("gdelta", "capture", "parity"):
        if key in result:
            print(f"{key}: {json.dumps(result[key])}")


def git_commit() -> str:
    """LONGSTRAW_COMMIT when set (a copied working tree may carry a stale .git), else git's HEAD."""
    if os.environ.get("LONGSTRAW_COMMIT"):
        return os.environ["LONGSTRAW_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


MODE_KEYED_PARTS = ("sweep", "speed")


def speed_runs(result: dict) -> list[dict]:
    """Warm step times as a list of entries with `mode` and `P` (a merged
    result keeps them so; a file keys them by mode, and files before the
    entries carried P hold the file's `--p-speed`)."""
    if "speed_runs" in result:
        return result["speed_runs"]
    return [{**r, "mode": mode, "P": r.get("P", result["p_speed"])} for mode, r in result.get("speed", {}).items()]


def merge(results: list[dict]) -> dict:
    """Results of one model from several commands (the device's 10-minute
    limit): per mode and P, the sweep, speed and memory-floor runs of the
    last file that has them (so a command can extend another's sweep);
    every other part from the last file that has it. `sources` says which
    command measured what."""
    merged: dict = {"sources": []}
    warm: dict[tuple[str, int], dict] = {}
    for result in results:
        parts = [k for k in result if k in (*MODE_KEYED_PARTS, "gdelta", "capture", "parity", "kernels", "memory_floor", "trace", "profile")]
        merged["sources"].append({"command": result["command"], "git_commit": result["git_commit"], "parts": parts,
                                  "modes": sorted({m for k in MODE_KEYED_PARTS for m in result.get(k, {})})})
        warm.update({(r["mode"], r["P"]): r for r in speed_runs(result)})
        for key, value in result.items():
            if key == "sweep":
                sweeps = merged.setdefault(key, {})
                for mode, entry in value.items():
                    sweeps[mode] = _merge_sweep(sweeps.get(mode), entry)
            elif key == "memory_floor":
                merged[key] = _merge_floor(merged.get(key), value)
            elif key not in ("sources", "speed"):
                merged[key] = value
    merged["speed_runs"] = list(warm.values())
    return merged


def _merge_sweep(old: dict | None, new: dict) -> dict:
    """Runs by P, the later file's where both ran one; the largest P run,
    and what stopped it, from the file that reached further."""
    if old is None:
        return new
    runs = {r["P"]: r for r in old["runs"]} | {r["P"]: r for r in new["runs"]}
    further = new if (new["max_prompt_tokens"] or 0) >= (old["max_prompt_tokens"] or 0) else old
    return {**further, "runs": [runs[P] for P in sorted(runs)]}


def _merge_floor(old: dict | None, new: dict) -> dict:
    """A later file's floor runs replace the earlier ones of the same mode and P."""
    fresh = {(r["mode"], r["P"]) for r in new["runs"]}
    kept = [r for r in (old or {}).get("runs", []) if (r["mode"], r["P"]) not in fresh]
    return {**new, "runs": kept + new["runs"]}


def rescore(result: dict, kind: str) -> dict:
    """MFU of every timed entry from the current FLOP model, and the memory
    floor from its measured terms (files measured earlier may carry an
    older count)."""
    flops = FlopModel.of(build_model(kind, False, torch.bfloat16, torch.device("meta")))
    G, R = result["G"], result["R"]
    for mode, entry in result.get("sweep", {}).items():
        for run in entry["runs"]:
            if run.get("ok"):
                run["mfu"] = flops.step(mode, run["G"], run["P"], run["R"]) / run["seconds"] / PEAK_FLOPS
    for run in speed_runs(result):
        if run.get("ok"):
            run["mfu"] = flops.step(run["mode"], G, run["P"], R) / run["seconds"] / PEAK_FLOPS
    if "memory_floor" in result:
        score_floor(result["memory_floor"], R)
    capture = result.get("capture", {})
    if "P" in capture:
        work = flops.compiled_forward(G, capture["P"], R)
        capture["forward_flops"] = work
        for entry in [capture, *capture.get("kernels", {}).values()]:
            if "forward_seconds" in entry:
                entry["mfu"] = work / entry["forward_seconds"] / PEAK_FLOPS
    return result


def report(paths: list[str], out_dir: str) -> None:
    """The plot and summary.json from result files (run where matplotlib is).
    Files of the same model are merged in the order given."""
    by_model: dict[str, list[dict]] = {}
    for path in paths:
        with open(path) as f:
            result = json.load(f)
        by_model.setdefault(result["model"], []).append(result)
    results = {kind: rescore(merge(files), kind) for kind, files in by_model.items()}
    plot(results, os.path.join(out_dir, "grpo_bench_peak_memory.png"))
    summary = {kind: summarize(r) for kind, r in results.items()}
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    for kind, result in results.items():
        print_table(kind, result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("dense", "hybrid"), default="dense")
    parser.add_argument("--parts", default="kernels,parity,speed,capture,gdelta,sweep")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--sweep-modes", default=None, help="modes of the sweep (default: --modes)")
    parser.add_argument("--G", type=int, default=8)
    parser.add_argument("--R", type=int, default=1024)
    parser.add_argument("--p-min", type=int, default=8192)
    parser.add_argument("--start", default="", help="per-mode first P of the sweep, MODE:P,... (flex recompiles per P)")
    parser.add_argument("--p-max", type=int, default=1 << 20)
    parser.add_argument("--bisect-resolution", type=int, default=8192)
    parser.add_argument("--p-gdelta", type=int, default=262144)
    parser.add_argument("--p-speed", type=int, default=32768)
    parser.add_argument("--p-capture", type=int, default=262144)
    parser.add_argument("--p-parity", type=int, default=8192)
    parser.add_argument("--p-trace", type=int, default=131072)
    parser.add_argument("--budget-s", type=float, default=520, help="wall-clock budget of the whole command")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke run of the script)")
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--name", default=None, help="result file stem (default grpo_bench_<model>)")
    parser.add_argument("--command", default=None, help="the command line to record (default: argv)")
    parser.add_argument("--report", nargs="+", metavar="RESULT_JSON", help="only write the plot and summary.json from these")
    args = parser.parse_args()
    args.start = {m: int(p) for m, p in (item.split(":") for item in args.start.split(",") if item)}
    if args.report:
        report(args.report, args.out_dir)
        return

    clock = Clock(args.budget_s)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    parts = args.parts.split(",")
    modes = [m for m in args.modes.split(",") if m]
    commit = git_commit()
    # from the repository's root, the output folder named where the repository keeps it, whatever folder it ran in
    argv = [f"benchmarks/{Path(os.sys.argv[0]).name}",
            *["benchmarks/results" if a == args.out_dir else a for a in os.sys.argv[1:]]]
    command = args.command or "python " + " ".join(argv)
    result = {"model": args.model, "G": args.G, "R": args.R, "p_speed": args.p_speed, "dtype": "bfloat16",
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "transformers": transformers.__version__,
              "command": command, "git_commit": commit, "peak_tflops": PEAK_FLOPS / 1e12}
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, (args.name or f"grpo_bench_{args.model}") + ".json")

    def save():  # after every part: a command stopped at its limit keeps what it measured
        with open(path, "w") as f:
            json.dump(result, f, indent=2)

    model = flops = None
    for part in parts:
        if part == "kernels" and device.type == "cuda":
            result["kernels"] = kernels(device)
        elif part == "parity":
            result["parity"] = parity(args.model, args, device)
        else:
            if model is None:
                model = build_model(args.model, args.tiny, torch.bfloat16, device)
                flops = FlopModel.of(model)
            if part == "trace" and device.type == "cuda":
                if clock.left() > 60:
                    result["trace"] = [peak_breakdown(model, args.model, m, args) for m in ("longstraw_detached", "longstraw_exact")]
            elif part == "profile" and device.type == "cuda":
                result["profile"] = [profile_step(model, args.model, m, args) for m in ("longstraw_detached", "longstraw_exact")]
            elif part == "speed":
                result["speed"] = speed(model, args.model, modes, args, clock, flops)
            elif part == "capture":
                result["capture"] = capture_mfu(model, args.model, args, clock, flops)
            elif part == "gdelta":
                result["gdelta"] = gdelta(model, args.model, args, clock, result.get("sweep", {}))
            elif part == "sweep":
                sweep_modes = [m for m in args.sweep_modes.split(",") if m] if args.sweep_modes is not None else modes
                sweep(model, args.model, sweep_modes, args, clock, flops, result.setdefault("sweep", {}), save)
                if device.type == "cuda":
                    result["memory_floor"] = memory_floor(model, args.model, args, result["sweep"])
        save()
    print_table(args.model, result)


if __name__ == "__main__":
    main()
