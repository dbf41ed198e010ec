"""The memory contract on the CPU (docs/architecture.md, "The memory contract").

(a) Peak live bytes do not grow with G. Measured from the CPU allocator's
    running total (`torch.profiler` with profile_memory=True records every
    allocation with the allocator's total at that moment), which sees the
    backend's own buffers too, not only autograd-saved tensors. The same
    measurement must show eager growing by one sequence's activations per
    branch, and must see at least the captured prompt state in the compiled
    run, so it cannot pass by measuring nothing.
(b) No logits at prompt positions: a TorchDispatchMode counts the rows of
    every LM-head output, forward and backward.
(c) The captured state is K/V after RoPE at the KV-head count.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch._C._profiler import _EventType
from torch.utils._python_dispatch import TorchDispatchMode

import longstraw

from helpers.harness import compile_loss
from helpers.losses import grpo_loss_f64
from helpers.plain_transformer import make_plain
from helpers.tiny_models import make_group

MODES = ("exact", "detached")

# A prompt-dominated group: the prompt is 128x the response.
BIG = dict(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16, num_layers=2)
P_BIG, R_BIG, CHUNK_BIG = 1024, 8, 256


def peak_allocated_bytes(fn) -> int:
    """Peak CPU bytes allocated while `fn()` runs, above what was allocated
    when it started."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    allocs = []  # (time, allocator total after this event, size of this event)
    todo = list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        node = todo.pop()
        todo.extend(node.children)
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            allocs.append((node.start_time_ns, node.extra_fields.total_allocated, node.extra_fields.alloc_size))
    assert allocs, "the profiler recorded no CPU allocations"
    allocs.sort()
    start = allocs[0][1] - allocs[0][2]
    return max(total for _, total, _ in allocs) - start


def measure(model, G, mode):
    """Peak bytes of one loss forward + backward (from .grad = None), after a
    warm-up call that compiles. mode None = eager. Returns (peak, plan)."""
    torch._dynamo.reset()
    args = make_group(G, P_BIG, R_BIG, seed=G)
    backend = None
    if mode is None:
        fn = grpo_loss_f64
    else:
        backend = longstraw.Backend(prompt_grad=mode, prefix_chunk_size=CHUNK_BIG)
        fn = compile_loss(grpo_loss_f64, backend)

    def step():
        fn(model, *args).backward()

    step()
    model.zero_grad(set_to_none=True)
    peak = peak_allocated_bytes(step)
    model.zero_grad(set_to_none=True)
    return peak, None if backend is None else backend.plans[-1]


@pytest.fixture(scope="module")
def big_model():
    return make_plain(**BIG)


@pytest.fixture(scope="module")
def eager_peaks(big_model):
    return {G: measure(big_model, G, None)[0] for G in (2, 8)}


def test_eager_grows_with_G(eager_peaks):
    """The yardstick: eager keeps G full sequences of activations."""
    per_branch = (eager_peaks[8] - eager_peaks[2]) / 6
    one_hidden_per_position = (P_BIG + R_BIG) * BIG["hidden_size"] * 8 * BIG["num_layers"]
    assert per_branch > 4 * one_hidden_per_position, eager_peaks


@pytest.mark.parametrize("mode", MODES)
def test_compiled_peak_is_independent_of_G(big_model, eager_peaks, mode):
    per_branch_eager = (eager_peaks[8] - eager_peaks[2]) / 6
    peaks, plans = {}, {}
    for G in (2, 8):
        peaks[G], plans[G] = measure(big_model, G, mode)
    report = f"compiled {peaks}, eager {eager_peaks}, eager per branch {per_branch_eager:.3e}"
    for G, plan in plans.items():
        assert plan.num_branches == G and plan.prefix_len == P_BIG - 1
        state = plan.prefix_len * plan.state_bytes_per_position
        # the measurement sees the backend's own buffers: the state is live
        assert peaks[G] >= state > 0, f"state {state}; {report}"
    # six more branches cost less than a tenth of ONE eager sequence
    assert peaks[8] - peaks[2] <= 0.1 * per_branch_eager, report
    # and the whole run is far below eager's
    assert peaks[8] < 0.5 * eager_peaks[8], report


# --- (b) no prompt-position logits -------------------------------------------

VOCAB_ODD = 97  # differs from every other size in the model and the group
# op -> what a vocab-last output of it is. Only these are counted: views and
# copies of the LM-head weight ([H, V]) also end in V and must not count.
CATEGORIES = {
    torch.ops.aten.mm.default: "lm_head",
    torch.ops.aten.addmm.default: "lm_head",
    torch.ops.aten.bmm.default: "lm_head",
    torch.ops.aten.baddbmm.default: "lm_head",
    torch.ops.aten._log_softmax.default: "softmax",
    torch.ops.aten._softmax.default: "softmax",
    torch.ops.aten._log_softmax_backward_data.default: "softmax_grad",
    torch.ops.aten._softmax_backward_data.default: "softmax_grad",
}


class VocabRows(TorchDispatchMode):
    """Sums the rows (product of all but the last dim) of LM-head matmul and
    (log-)softmax outputs whose last dim is the vocabulary size, per phase."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab
        self.phase = None
        self.rows = {}  # (phase, category) -> rows

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # off while Dynamo traces (a recompile must not fall back to eager),
        # on while the compiled artifact runs
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        category = CATEGORIES.get(func)
        if category and isinstance(out, torch.Tensor) and out.dim() >= 2 and out.shape[-1] == self.vocab:
            key = (self.phase, category)
            self.rows[key] = self.rows.get(key, 0) + math.prod(out.shape[:-1])
        return out

    def __getitem__(self, key):
        return self.rows.get(key, 0)


def count_vocab_rows(fn, model, args):
    rec = VocabRows(VOCAB_ODD)
    with rec:
        rec.phase = "forward"
        loss = fn(model, *args)
        rec.phase = "backward"
        loss.backward()
    model.zero_grad(set_to_none=True)
    return rec


@pytest.mark.parametrize("head_chunk", [None, 4])
@pytest.mark.parametrize("mode", MODES)
def test_no_prompt_position_logits(mode, head_chunk):
    """Eager computes logits at all G * (P + R) positions; the backend at
    most at the G * (R + 1) branch positions, in each pass. With the head
    chunked (`head.py`) the backward computes them twice: the replay's
    forward, then each chunk's recomputation under checkpoint."""
    G, P, R = 3, 40, 6
    model = make_plain(vocab_size=VOCAB_ODD)
    args = make_group(G, P, R, vocab=VOCAB_ODD, pad=True)

    eager = count_vocab_rows(grpo_loss_f64, model, args)
    assert eager["forward", "lm_head"] == G * (P + R), f"the counter must see eager's LM head: {eager.rows}"

    backend = longstraw.Backend(prompt_grad=mode, prefix_chunk_size=7, head_chunk_size=head_chunk)
    compiled = compile_loss(grpo_loss_f64, backend)
    compiled(model, *args).backward()  # compile outside the mode
    model.zero_grad(set_to_none=True)
    rec = count_vocab_rows(compiled, model, args)
    bound = G * (R + 1)
    assert G * R <= rec["forward", "lm_head"] <= bound, rec.rows
    for phase in ("forward", "backward"):
        for category in set(CATEGORIES.values()):
            runs = 2 if head_chunk and phase == "backward" and category != "softmax_grad" else 1
            assert rec[phase, category] <= runs * bound, (phase, category, rec.rows)


# --- (c) what is captured ----------------------------------------------------


@pytest.mark.parametrize("kv_mode", ["gqa", "repeat", "repeat_interleave"])
def test_state_is_kv_at_kv_head_count(kv_mode):
    """One K/V head (16 values per layer per position for K and V together)
    is cheaper than any hidden-size cut (32), and HF-style repeat_kv must be
    cut before the repeat, never after it (4 heads)."""
    cfg = dict(num_heads=4, num_kv_heads=1, head_dim=8, hidden_size=32, kv_mode=kv_mode)
    model = make_plain(**cfg)
    G, P, R = 2, 13, 5
    backend = longstraw.Backend(prefix_chunk_size=5)
    compile_loss(grpo_loss_f64, backend)(model, *make_group(G, P, R)).backward()
    plan = backend.plans[-1]
    kv_bytes = 2 * model.cfg.num_layers * cfg["num_kv_heads"] * cfg["head_dim"] * 8
    assert plan.state_bytes_per_position == kv_bytes, plan.summary()
    assert plan.prefix_len == P - 1
    assert isinstance(plan.summary(), str) and plan.summary()
