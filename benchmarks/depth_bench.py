"""Full-depth GRPO step on one GPU (issue 14): Qwen3.5-27B layer shapes at
any depth, LoRA (peft, rank 16 on every linear layer but the head, base
frozen), LongStraw exact and detached.

Every run is one fresh compile and one step at (mode, P); it records the
peak allocated memory, the seconds of the step split into planning, forward
(capture and the branches) and backward (replays and the reverse pass), and
the floor it should sit near: weights + trainable grads + state (+ d(state)).

    python benchmarks/depth_bench.py --layers 64 --runs exact:131072,detached:524288 --recompute-layers \
        --out benchmarks/results/depth_bench_a_h200.json
    python benchmarks/depth_bench.py --layers 64 --runs exact:32768:8192:memory,exact:32768:8192:profile ...
    python benchmarks/depth_bench.py --layers 64 --budget-gb 135 --runs exact:131072 ...   # the planner chooses
    python benchmarks/depth_bench.py --tiny --layers 8 --runs exact:64,detached:64   # CPU smoke run
    python benchmarks/depth_bench.py --ranks 2 --layers 64 --runs exact:786432 --recompute-layers ...  # context parallel

`:memory` lists what is live at each runtime phase's peak (a dispatch mode:
slow, keep it to short runs), `:trace` what was live at the step's peak by
the allocator's own trace (`live_at_peak`: every allocation, a kernel's
workspace too, grouped by the source line that made it) with the peak of
each runtime phase (with ranks, rank 0's), `:profile` the CUDA time per
operator and phase. Every run records seconds per phase (prompt capture, branch
forwards, replays, reverse pass) and MFU against 790 TFLOP/s.

`--ranks W` shards the prompt state over W processes
(`Options.context_parallel`, `grpo/ranks.py`: a GPU each where there are
enough, NCCL): every rank runs each run, the result keeps rank 0's with
every rank's peak (`peak_gb_per_rank`) and a floor of one rank's share.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.utils._pytree as pytree
import transformers
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))

import longstraw  # noqa: E402
from grpo.flops import PEAK_FLOPS, FlopModel  # noqa: E402
from grpo.measure import GiB, is_oom, live_at_peak, phase_peaks, phase_seconds, release, sync  # noqa: E402
from grpo.models import grpo_loss, make_group  # noqa: E402
from grpo.ranks import agreed, init_rank, spawn  # noqa: E402
from grpo.results import provenance  # noqa: E402
from longstraw.backend import CompiledGroupLoss  # noqa: E402
from longstraw.runtime.schedule import ChunkSchedule  # noqa: E402
from longstraw.runtime.kernels import fla_causal_conv  # noqa: E402
from longstraw.models import qwen3_5  # noqa: E402
from longstraw.planning.report import ExplainReport  # noqa: E402
from longstraw.runtime.runner import GroupRunner  # noqa: E402
from longstraw.runtime.phases import phase_of  # noqa: E402


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


def build(layers: int, tiny: bool, dtype: torch.dtype, device: torch.device, lora: bool,
          float32_adapters: bool = True) -> torch.nn.Module:
    """The model; with `lora`, peft's LoRA with its adapters in float32
    (peft's default for a 16-bit base) or, without `float32_adapters`, in
    the base's dtype."""
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Qwen3_5ForCausalLM._from_config(config(layers, tiny), dtype=dtype)
    model.train()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"),
                               autocast_adapter_dtype=float32_adapters)
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
        self._phases = phase_seconds()
        self.steps = self._phases.__enter__()  # seconds per runtime phase (prompt capture, branches, replays, reverse pass)
        return self

    def __exit__(self, *exc) -> None:
        self._phases.__exit__(*exc)
        for (owner, name), original in self._originals.items():
            setattr(owner, name, original)


def each_phase(around: Callable[[str], contextlib.AbstractContextManager]) -> contextlib.AbstractContextManager:
    """Run `around(phase)` around every step the runtime runs."""
    return longstraw.around_steps(lambda where: around(phase_of(where)))


def step_flops(flops: FlopModel, mode: str, G: int, P: int, R: int, lora: bool) -> float:
    """The FLOPs a step needs, without recomputation: the prompt's forward
    (its state only, at the last layer), the G branches' forward and
    backward, and in exact mode the prompt's backward. A frozen linear's
    backward is the input's gradient alone (1x its forward, LoRA), a trained
    one's 2x; attention and the recurrence have no weights (2x)."""
    weights = 1 if lora else 2
    pairs = P * (P + 1) / 2
    prompt_linear = (flops.linear_per_token + flops.recurrent_per_token - flops.dead_per_token) * P
    prompt_attention = (flops.attention_per_pair - flops.dead_per_pair) * pairs
    tokens, branch_pairs = G * R, G * (R * P + R * (R + 1) / 2)
    branch_linear = (flops.linear_per_token + flops.recurrent_per_token + flops.head_per_token) * tokens
    branch_attention = flops.attention_per_pair * branch_pairs
    total = prompt_linear + prompt_attention + (1 + weights) * branch_linear + 3 * branch_attention
    if mode == "exact":
        total += weights * prompt_linear + 2 * prompt_attention
    return total


class MemoryByPhase(TorchDispatchMode):
    """What is live at each phase's peak of allocated CUDA memory, grouped
    by the operator, shape and phase that created each storage (tensors
    made before the step, the weights, are `untracked`). The peak inside
    an operator (a kernel's workspace) counts as the operator's."""

    STEP = 0.25 * GiB  # re-list the live tensors only when the peak rose by this much

    def __init__(self) -> None:
        super().__init__()
        self.phase = "setup"
        self.names: dict[int, tuple[StorageWeakRef, str, int]] = {}
        self.best: dict[str, dict] = {}
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        torch.cuda.reset_peak_memory_stats()
        out = func(*args, **(kwargs or {}))
        peak = torch.cuda.max_memory_allocated()
        inputs = {StorageWeakRef(t.untyped_storage()).cdata for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_cuda:
                ref = StorageWeakRef(t.untyped_storage())
                known = self.names.get(ref.cdata)
                if ref.cdata not in inputs and (known is None or known[0].expired()):  # new storage, not a view
                    label = f"{func.__name__} {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} @{self.phase}"
                    self.names[ref.cdata] = (ref, label, t.untyped_storage().nbytes())
        self.ops += 1
        if self.ops % 4096 == 0:
            self.names = {k: v for k, v in self.names.items() if not v[0].expired()}
        best = self.best.setdefault(self.phase, {"peak_gb": 0.0})
        if peak > (best["peak_gb"] * GiB) + self.STEP:
            groups: dict[str, int] = {}
            live = 0
            for key in list(self.names):
                ref, label, nbytes = self.names[key]
                if ref.expired():
                    del self.names[key]
                    continue
                groups[label] = groups.get(label, 0) + nbytes
                live += nbytes
            top = sorted(groups.items(), key=lambda kv: -kv[1])[:14]
            best.update(peak_gb=peak / GiB, op=str(func), untracked_gb=(torch.cuda.memory_allocated() - live) / GiB,
                        in_op_gb=(peak - torch.cuda.memory_allocated()) / GiB,
                        live=[{"gb": b / GiB, "what": w} for w, b in top])
        return out

    @contextlib.contextmanager
    def around_the_runner(self):
        """Active inside GroupRunner.forward and backward only: Dynamo and the
        planner's FakeTensor propagation run outside it."""
        originals = {name: getattr(GroupRunner, name) for name in ("forward", "backward")}

        def wrapped(original):
            def run(*args, **kwargs):
                with self:
                    return original(*args, **kwargs)
            return run

        for name, original in originals.items():
            setattr(GroupRunner, name, wrapped(original))
        try:
            with each_phase(self._in_phase):
                yield self
        finally:
            for name, original in originals.items():
                setattr(GroupRunner, name, original)

    @contextlib.contextmanager
    def _in_phase(self, phase: str):
        previous, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = previous


@contextlib.contextmanager
def profiled(run: dict):
    """torch.profiler over the step: self CUDA time per operator, and per phase."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with each_phase(lambda phase: record_function("phase: " + phase)):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            yield
    events = prof.key_averages()
    run["profile"] = events.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=60)
    run["profile_phases"] = {e.key: e.device_time_total / 1e6 for e in events if e.key.startswith("phase: ")}


class Stopped(BaseException):
    """SIGTERM (`timeout`) inside a run: the run is recorded with the phases it finished."""


def _stop(signum, frame):
    raise Stopped(f"stopped by signal {signum} after {time.perf_counter() - _STARTED:.0f} s")


_STARTED = time.perf_counter()


def _step(compiled: Callable, model: torch.nn.Module, group, R: int) -> torch.Tensor:
    loss = compiled(model, group.input_ids, group.advantages, group.mask, R)
    loss.backward()
    sync()
    return loss


def one_run(model, layers: int, mode: str, P: int, G: int, R: int, options: dict, device: torch.device,
            diagnose: str | None = None) -> dict:
    group_of_ranks = options.get("context_parallel")
    ranks = 1 if group_of_ranks is None else torch.distributed.get_world_size(group_of_ranks)
    run = {"layers": layers, "mode": mode, "P": P, "G": G, "R": R, "ranks": ranks, "ok": False,
           "options": {k: v for k, v in options.items() if k != "context_parallel"}}
    group = make_group(G, P, R, model.config.vocab_size, device)
    backend = longstraw.Backend(prompt_grad=mode, **options)
    compiled = torch.compile(grpo_loss, backend=backend)
    params = list(model.parameters())
    run["weights_gb"] = sum(p.numel() * p.element_size() for p in params) / GiB
    run["grads_gb"] = sum(p.numel() * p.element_size() for p in params if p.requires_grad) / GiB
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    elif diagnose == "trace":  # the allocator's trace is CUDA's
        run["diagnosis_skipped"], diagnose = "trace: no CUDA", None
    start = time.perf_counter()
    try:
        diagnostics = {"memory": lambda: MemoryByPhase().around_the_runner(), "profile": lambda: profiled(run),
                       "trace": phase_peaks}

        step = functools.partial(_step, compiled, model, group, R)
        with Phases() as phases, (diagnostics[diagnose]() if diagnose else contextlib.nullcontext()) as diagnosis:
            if diagnose == "trace":
                loss, run["live_at_peak"] = live_at_peak(step, top=24)
            else:
                loss = step()
        if diagnose == "memory":
            run["memory_by_phase"] = diagnosis.best
        if diagnose == "trace":  # phase_peaks resets the allocator's peak that Phases reads: the trace's is the step's
            run["step_peaks_gb"] = diagnosis
        run.update(ok=True, loss=loss.item())
    except (Exception, Stopped) as error:  # noqa: BLE001 - every failure is a result here
        if not (is_oom(error) or isinstance(error, Stopped)):
            raise
        run["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
        if hasattr(error, "live_at_peak"):  # `:trace`: what was live at the peak before the failure
            run["live_at_peak"] = error.live_at_peak
        run["where"] = [n for n in getattr(error, "__notes__", [])]
    run["seconds"] = time.perf_counter() - start
    run["phases"] = phases.seconds
    run["steps"] = phases.steps
    if run["ok"]:
        # MFU over the runtime's work (forward and backward), against the measured bf16 ceiling
        lora = any("lora_" in n for n, _ in model.named_parameters())
        run["model_tflop"] = step_flops(FlopModel.of(model.get_base_model() if lora else model), mode, G, P, R, lora) / 1e12
        run["mfu"] = run["model_tflop"] * 1e12 / (phases.seconds["forward"] + phases.seconds["backward"]) / PEAK_FLOPS
    run["phase_memory_gb"] = phases.peak_gb
    if torch.cuda.is_available():
        run["peak_gb"] = max([torch.cuda.max_memory_allocated() / GiB, *phases.peak_gb.values(),
                              *run.get("step_peaks_gb", {}).values(), run.get("live_at_peak", {}).get("peak_gb", 0.0)])
    if backend.plans:
        chosen = backend.plans[-1].options  # the planner's choice where options left it open
        run["chosen"] = {"prefix_chunk_size": chosen.prefix_chunk_size, "recompute_layers": chosen.recompute_layers}
        report = ExplainReport(backend.plans[-1])
        per_position = report.state_bytes_per_position
        # one rank's share
        held = P - 1 + R if ranks == 1 else ChunkSchedule(P - 1, chosen.prefix_chunk_size, ranks).largest_share
        run["state_gb"] = (per_position * held + report.state_fixed_bytes) / GiB
        run["state_grad_gb"] = per_position * (P - 1 if ranks == 1 else held) / GiB if mode == "exact" else 0.0
        run["floor_gb"] = run["weights_gb"] + run["grads_gb"] + run["state_gb"] + run["state_grad_gb"]
    del group, compiled, backend
    release(model)
    torch._dynamo.reset()
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--runs", required=True,
                        help="MODE:P[:CHUNK][:memory|:trace|:profile][:auto|:torch],... in order (mode: exact or detached; "
                             "memory: what is live at each phase's peak; trace: the allocator's trace at the step's "
                             "peak; profile: CUDA time per operator and phase; "
                             "auto|torch: kernels['causal_conv'] for this run)")
    parser.add_argument("--G", type=int, default=8)
    parser.add_argument("--R", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=8192, help="prefix_chunk_size (MODE:P:CHUNK in --runs overrides it)")
    parser.add_argument("--recompute-layers", action="store_true")
    parser.add_argument("--budget-gb", type=float, default=None,
                        help="memory_budget_gb: the planner chooses the chunk (unless MODE:P:CHUNK gives it) and recomputation")
    parser.add_argument("--no-lora", action="store_true", help="train every parameter instead of LoRA")
    parser.add_argument("--bf16-adapters", action="store_true",
                        help="LoRA adapters in the base's bf16 (peft's default upcasts them to float32)")
    parser.add_argument("--attention-on-host", action="store_true",
                        help="attention_outputs_on_host: the reverse pass reads the capture's attention outputs")
    parser.add_argument("--head-chunk", type=int, default=256, help="head_chunk_size (0: the LM head runs whole)")
    parser.add_argument("--conv", choices=["auto", "torch"], default="auto",
                        help="kernels['causal_conv'] (MODE:P[:CHUNK]:torch in --runs overrides it for one run)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (a smoke run of the script)")
    parser.add_argument("--budget-s", type=float, default=560, help="skip runs once this much wall time is spent")
    parser.add_argument("--sdpa", choices=["flash", "cudnn"], default="flash",
                        help="attention forward kernel: PyTorch's default order (flash first) or cuDNN first")
    parser.add_argument("--out", required=True, help="result JSON path")
    parser.add_argument("--ranks", type=int, default=1, help="context parallelism over this many processes")
    args = parser.parse_args()

    started = time.perf_counter()
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    options = {"prefix_chunk_size": args.chunk, "recompute_layers": args.recompute_layers, "progress": False}
    if args.budget_gb is not None:
        options = {"prefix_chunk_size": None, "recompute_layers": None, "memory_budget_gb": args.budget_gb, "progress": False}
    options["attention_outputs_on_host"] = args.attention_on_host
    options["head_chunk_size"] = args.head_chunk or None
    options["kernels"] = {"causal_conv": args.conv}
    # from the repository's root, the output named where the repository keeps it, whatever folder it ran in
    command = " ".join(["python", f"benchmarks/{Path(sys.argv[0]).name}",
                        *[f"benchmarks/results/{Path(a).name}" if a == args.out else a for a in sys.argv[1:]]])
    result = {
        **provenance(command), "transformers": transformers.__version__, "lora": not args.no_lora,
        "sdpa": args.sdpa, "float32_adapters": not args.bf16_adapters,
        "fla_causal_conv": fla_causal_conv.fla_ops() is not None, "runs": [],
    }
    if args.ranks > 1:
        run_ranks(args, result, dtype, options)
    else:
        previous = signal.signal(signal.SIGTERM, _stop)
        try:
            run_all(args, result, device, dtype, options, started)
        finally:
            signal.signal(signal.SIGTERM, previous)
    print_table(result)


def run_ranks(args: argparse.Namespace, result: dict, dtype: torch.dtype, options: dict) -> None:
    """`run_all` on `--ranks` processes with the prompt state sharded over
    them; `--out` gets the first recorded rank's runs with every recorded
    rank's peak, also when a rank failed (the runs every recorded rank
    finished; `ranks_without_record` names the ranks that ended before
    recording any, e.g. when another's failure closed the group)."""
    try:
        spawn(_rank_worker, args.ranks, args, result, dtype, options)
    finally:
        paths = [Path(f"{args.out}.rank{r}") for r in range(args.ranks)]
        per_rank = {r: json.loads(p.read_text()) for r, p in enumerate(paths) if p.exists()}
        if per_rank:
            result.update(per_rank[min(per_rank)])
            result["runs"] = result["runs"][:min(len(r["runs"]) for r in per_rank.values())]
            result["ranks_without_record"] = [r for r in range(args.ranks) if r not in per_rank]
            for i, run in enumerate(result["runs"]):
                errors = {r: got["runs"][i].get("error") for r, got in per_rank.items()}
                run["errors_per_rank"] = {r: error for r, error in errors.items() if error}
                if "peak_gb" in run:
                    run["peak_gb_per_rank"] = [got["runs"][i]["peak_gb"] for got in per_rank.values()]
                    run["peak_gb"] = max(run["peak_gb_per_rank"])
            Path(args.out).write_text(json.dumps(result, indent=1))
        for path in paths:
            path.unlink(missing_ok=True)


def _rank_worker(rank: int, world: int, port: int, args: argparse.Namespace, result: dict, dtype: torch.dtype,
                 options: dict) -> None:
    device, backend = init_rank(rank, world, port)
    result = {**result, "ranks": world, "backend": backend, "shared_gpu": 0 < torch.cuda.device_count() < world}
    options = {**options, "context_parallel": torch.distributed.group.WORLD}
    run_all(args, result, device, dtype, options, time.perf_counter(), out=f"{args.out}.rank{rank}",
            go=lambda ok: agreed(ok, device))
    torch.distributed.destroy_process_group()


def run_all(args: argparse.Namespace, result: dict, device: torch.device, dtype: torch.dtype, options: dict,
            started: float, out: str | None = None, go: Callable[[bool], bool] = bool) -> None:
    """Every run of `--runs` into `result`, written to `out` (default
    `--out`) after each; a run stopped by SIGTERM ends them. `go` turns the
    clock's verdict into the decision to start a run (ranks: rank 0's)."""
    out = out or args.out
    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    kernels = sdpa_kernel(order, set_priority=True) if args.sdpa == "cudnn" else contextlib.nullcontext()
    with qwen3_5.bound(), kernels:
        model = build(args.layers, args.tiny, dtype, device, lora=not args.no_lora, float32_adapters=not args.bf16_adapters)
        result["build_seconds"] = time.perf_counter() - started
        for item in args.runs.split(","):
            mode, P, *rest = item.split(":")
            chunk = [x for x in rest if x.isdigit()]
            diagnose = next((x for x in rest if x in ("memory", "trace", "profile")), None)
            conv = next((x for x in rest if x in ("auto", "torch")), options["kernels"]["causal_conv"])
            if not go(time.perf_counter() - started <= args.budget_s):
                result["runs"].append({"layers": args.layers, "mode": mode, "P": int(P), "ok": False, "skipped": "time"})
            else:
                run_options = {**options, "kernels": {"causal_conv": conv}}
                if chunk:
                    run_options["prefix_chunk_size"] = int(chunk[0])
                result["runs"].append(one_run(model, args.layers, mode, int(P), args.G, args.R, run_options, device,
                                              diagnose=diagnose))
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text(json.dumps(result, indent=1))
            if result["runs"][-1].get("error", "").startswith("Stopped"):
                break


def print_table(result: dict) -> None:
    print(f"{'mode':9} {'P':>9} {'chunk':>6} {'ok':>3} {'peak GB':>8} {'floor GB':>8} {'fwd pk':>7} {'bwd pk':>7} "
          f"{'s':>7} {'plan':>6} {'fwd':>7} {'bwd':>7}")
    for r in result["runs"]:
        ph, mem = r.get("phases", {}), r.get("phase_memory_gb", {})
        print(f"{r['mode']:9} {r['P']:>9} {r.get('chosen', r.get('options', {})).get('prefix_chunk_size') or 0:>6} {str(r['ok'])[0]:>3} "
              f"{r.get('peak_gb', 0):8.1f} {r.get('floor_gb', 0):8.1f} {mem.get('forward_peak', 0):7.1f} {mem.get('backward_peak', 0):7.1f} "
              f"{r.get('seconds', 0):7.1f} {ph.get('plan', 0):6.1f} {ph.get('forward', 0):7.1f} {ph.get('backward', 0):7.1f}"
              + (f"  {r['error'][:60]}" if "error" in r else ""))
        if r.get("steps"):
            print("    seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in r["steps"].items()) + f"; MFU {r.get('mfu', 0):.1%}")
        for phase, best in r.get("memory_by_phase", {}).items():
            print(f"  [{phase}] peak {best['peak_gb']:.1f} GB at {best.get('op')} (untracked {best.get('untracked_gb', 0):.1f}, "
                  f"inside the op {best.get('in_op_gb', 0):.2f})")
            for a in best.get("live", [])[:10]:
                print(f"    {a['gb']:7.2f} GB  {a['what'][:140]}")
        if r.get("step_peaks_gb"):
            print("    peaks (GB): " + ", ".join(f"{k} {v:.1f}" for k, v in r["step_peaks_gb"].items()))
        if "live_at_peak" in r:
            print(f"    live at the traced peak ({r['live_at_peak']['peak_gb']:.1f} GB, {r['live_at_peak']['events']} events):")
            for row in r["live_at_peak"]["top"]:
                print(f"    {row['gb']:7.2f} GB  {row['where'][:140]}")
                if row["gb"] >= 0.25 and len(row.get("stack", [])) > 1:
                    print("               " + " <- ".join(row["stack"][1:6]))
        if "profile" in r:
            print(r["profile"])
            print({k: round(v, 1) for k, v in r["profile_phases"].items()})


if __name__ == "__main__":
    main()
