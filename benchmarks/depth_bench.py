"""Full-depth GRPO step on one GPU (issue 14): Qwen3.5-27B layer shapes at
any depth, LoRA (peft, rank 16 on every linear layer but the head, base
frozen), LongStraw exact and detached.

Every run is one fresh compile and one step at (mode, P); it records the
peak allocated memory, the seconds of the step split into planning, forward
(capture and the branches) and backward (replays and the reverse pass), and
the floor it should sit near: weights + trainable grads + state (+ d(state)).

    python benchmarks/depth_bench.py --layers 64 --runs exact:131072,detached:524288 --recompute-layers \
        --out benchmarks/results/depth_bench_a_h200.json
    python benchmarks/depth_bench.py --tiny --layers 8 --runs exact:64,detached:64   # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))

import longstraw  # noqa: E402
from grpo_bench import GiB, git_commit, grpo_loss, is_oom, make_group, release, sync  # noqa: E402
from longstraw.backend import CompiledGroupLoss  # noqa: E402
from longstraw.models import qwen3_5  # noqa: E402
from longstraw.report import ExplainReport  # noqa: E402
from longstraw.runtime import GroupRunner  # noqa: E402


def hybrid_layers(layers: int) -> list[str]:
    """Qwen3.5's pattern: three Gated DeltaNet layers, then one full attention."""
    return [("full_attention" if i % 4 == 3 else "linear_attention") for i in range(layers)]


def config(layers: int, tiny: bool) -> transformers.PretrainedConfig:
    if tiny:
        return qwen3_5.tiny_config(num_hidden_layers=layers, layer_types=hybrid_layers(layers),
                                   max_position_embeddings=1 << 22)
    return transformers.Qwen3_5TextConfig(
        hidden_size=5120, intermediate_size=17408, num_hidden_layers=layers, layer_types=hybrid_layers(layers),
        num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=248320,
        max_position_embeddings=1 << 22,
    )


def build(layers: int, tiny: bool, dtype: torch.dtype, device: torch.device, lora: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Qwen3_5ForCausalLM._from_config(config(layers, tiny), dtype=dtype)
    model.train()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"))
        for name, p in model.named_parameters():
            if "lora_B" in name:  # peft starts B at zero, which would leave A without a gradient
                torch.nn.init.normal_(p, std=1e-3)
    return model


class Phases:
    """Seconds spent planning, in the forward and in the backward (device-synchronised)."""

    def __init__(self) -> None:
        self.seconds = {"plan": 0.0, "forward": 0.0, "backward": 0.0}
        self.peak_gb: dict[str, float] = {}  # allocated at the phase's start, and its peak
        self._originals = {}

    def _timed(self, owner: type, name: str, phase: str) -> None:
        original = getattr(owner, name)
        self._originals[(owner, name)] = original
        seconds, peaks = self.seconds, self.peak_gb
        cuda = torch.cuda.is_available()

        def timed(*args, **kwargs):
            sync()
            if cuda:
                peaks[f"{phase}_start"] = torch.cuda.memory_allocated() / GiB
                peaks[f"{phase}_peak"] = max(peaks.get(f"{phase}_peak", 0.0), torch.cuda.max_memory_allocated() / GiB)
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                sync()
                seconds[phase] += time.perf_counter() - start
                if cuda:
                    peaks[f"{phase}_peak"] = torch.cuda.max_memory_allocated() / GiB

        setattr(owner, name, timed)

    def __enter__(self) -> "Phases":
        self._timed(CompiledGroupLoss, "_plan", "plan")
        self._timed(GroupRunner, "forward", "forward")
        self._timed(GroupRunner, "backward", "backward")
        return self

    def __exit__(self, *exc) -> None:
        for (owner, name), original in self._originals.items():
            setattr(owner, name, original)


def peak_allocations(snapshot: dict, top: int = 20) -> list[dict]:
    """The allocations live at the peak of a `torch.cuda.memory._snapshot()`
    trace, grouped by the innermost frame in LongStraw, its passes, HF or peft."""
    live: dict[int, tuple[int, list]] = {}
    total = peak = 0
    at_peak: list[tuple[int, list]] = []
    for event in snapshot["device_traces"][0]:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], event.get("frames", []))
            total += event["size"]
            if total > peak:
                peak, at_peak = total, list(live.values())
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    groups: dict[str, int] = {}
    for size, frames in at_peak:
        names = [f"{f['filename'].rsplit('/', 2)[-1]}:{f['line']} {f['name']}" for f in frames
                 if any(k in f["filename"] for k in ("longstraw", "passes", "transformers", "peft", "grpo_bench"))]
        key = " <- ".join(names[:3]) or "?"
        groups[key] = groups.get(key, 0) + size
    ranked = sorted(groups.items(), key=lambda kv: -kv[1])[:top]
    return [{"gb": size / GiB, "where": where} for where, size in ranked]


def one_run(model, layers: int, mode: str, P: int, G: int, R: int, options: dict, device: torch.device,
            trace: bool = False) -> dict:
    run = {"layers": layers, "mode": mode, "P": P, "G": G, "R": R, "options": options, "ok": False}
    group = make_group(G, P, R, model.config.vocab_size, device)
    backend = longstraw.Backend(prompt_grad=mode, **options)
    compiled = torch.compile(grpo_loss, backend=backend)
    params = list(model.parameters())
    run["weights_gb"] = sum(p.numel() * p.element_size() for p in params) / GiB
    run["grads_gb"] = sum(p.numel() * p.element_size() for p in params if p.requires_grad) / GiB
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    if trace:
        torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    start = time.perf_counter()
    try:
        with Phases() as phases:
            loss = compiled(model, group.input_ids, group.advantages, group.mask, R)
            loss.backward()
            sync()
        run.update(ok=True, loss=loss.item())
    except Exception as error:  # noqa: BLE001 - every failure is a result here
        if not is_oom(error):
            raise
        run["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
        run["where"] = [n for n in getattr(error, "__notes__", [])]
    run["seconds"] = time.perf_counter() - start
    if trace:
        run["peak_allocations"] = peak_allocations(torch.cuda.memory._snapshot())
        torch.cuda.memory._record_memory_history(enabled=None)
    run["phases"] = phases.seconds
    run["phase_memory_gb"] = phases.peak_gb
    if torch.cuda.is_available():
        run["peak_gb"] = max([torch.cuda.max_memory_allocated() / GiB, *phases.peak_gb.values()])
    if backend.plans:
        report = ExplainReport(backend.plans[-1])
        per_position = report.state_bytes_per_position
        run["state_gb"] = (per_position * (P - 1 + R) + report.state_fixed_bytes) / GiB
        run["state_grad_gb"] = per_position * (P - 1) / GiB if mode == "exact" else 0.0
        run["floor_gb"] = run["weights_gb"] + run["grads_gb"] + run["state_gb"] + run["state_grad_gb"]
    del group, compiled, backend
    release(model)
    torch._dynamo.reset()
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--runs", required=True, help="MODE:P,... in order (mode: exact or detached)")
    parser.add_argument("--G", type=int, default=8)
    parser.add_argument("--R", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=8192, help="prefix_chunk_size (MODE:P:CHUNK in --runs overrides it)")
    parser.add_argument("--recompute-layers", action="store_true")
    parser.add_argument("--no-lora", action="store_true", help="train every parameter instead of LoRA")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (a smoke run of the script)")
    parser.add_argument("--memory-trace", action="store_true", help="record allocations; list those live at the peak")
    parser.add_argument("--budget-s", type=float, default=560, help="skip runs once this much wall time is spent")
    parser.add_argument("--out", required=True, help="result JSON path")
    args = parser.parse_args()

    started = time.perf_counter()
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    options = {"prefix_chunk_size": args.chunk, "recompute_layers": args.recompute_layers, "progress": False}
    result = {
        "command": " ".join(["python", *sys.argv]), "commit": git_commit(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__, "lora": not args.no_lora, "runs": [],
    }
    with qwen3_5.bound():
        model = build(args.layers, args.tiny, dtype, device, lora=not args.no_lora)
        result["build_seconds"] = time.perf_counter() - started
        for item in args.runs.split(","):
            mode, P, *chunk = item.split(":")
            if time.perf_counter() - started > args.budget_s:
                result["runs"].append({"layers": args.layers, "mode": mode, "P": int(P), "ok": False, "skipped": "time"})
                continue
            run_options = {**options, "prefix_chunk_size": int(chunk[0])} if chunk else options
            result["runs"].append(one_run(model, args.layers, mode, int(P), args.G, args.R, run_options, device,
                                          trace=args.memory_trace))
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"{'mode':9} {'P':>9} {'chunk':>6} {'ok':>3} {'peak GB':>8} {'floor GB':>8} {'fwd pk':>7} {'bwd pk':>7} "
          f"{'s':>7} {'plan':>6} {'fwd':>7} {'bwd':>7}")
    for r in result["runs"]:
        ph, mem = r.get("phases", {}), r.get("phase_memory_gb", {})
        print(f"{r['mode']:9} {r['P']:>9} {r.get('options', {}).get('prefix_chunk_size', 0):>6} {str(r['ok'])[0]:>3} "
              f"{r.get('peak_gb', 0):8.1f} {r.get('floor_gb', 0):8.1f} {mem.get('forward_peak', 0):7.1f} {mem.get('backward_peak', 0):7.1f} "
              f"{r.get('seconds', 0):7.1f} {ph.get('plan', 0):6.1f} {ph.get('forward', 0):7.1f} {ph.get('backward', 0):7.1f}"
              + (f"  {r['error'][:60]}" if "error" in r else ""))
        for a in r.get("peak_allocations", [])[:12]:
            print(f"    {a['gb']:7.2f} GB  {a['where'][:150]}")


if __name__ == "__main__":
    main()
