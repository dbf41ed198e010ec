"""`Options` (`longstraw/options.py`): every option is validated once, at
construction, with a message naming it and the value given; a mapping is
taken only with known names; a kernels mapping becomes a `KernelPolicy`."""

from __future__ import annotations

import dataclasses

import pytest

import longstraw
from longstraw.options import Options
from longstraw.runtime.kernels import KernelPolicy

BAD = [
    ("prompt_grad", "both", "prompt_grad must be 'exact' or 'detached'"),
    ("prefix_chunk_size", 0, "prefix_chunk_size must be a positive int or None"),
    ("prefix_chunk_size", True, "prefix_chunk_size must be a positive int or None"),  # a bool is no size
    ("memory_budget_gb", -1.0, "memory_budget_gb must be a positive number or None"),
    ("memory_budget_gb", True, "memory_budget_gb must be a positive number or None"),
    ("plan_cache_size", 0, "plan_cache_size must be a positive int"),
    ("verify_state", 1, "verify_state must be a bool"),
    ("recompute_layers", "yes", "recompute_layers must be a bool or None"),
    ("recompute_layers", 1, "recompute_layers must be a bool or None"),  # 1 == True, but not a bool
    ("keep_group_states", 0, "keep_group_states must be a bool or None"),
    ("keep_graphs", "no", "keep_graphs must be a bool or None"),
    ("attention_outputs_on_host", None, "attention_outputs_on_host must be a bool"),
    ("branch_rows", 0, "branch_rows must be a positive int or None"),
    ("head_chunk_size", 2.5, "head_chunk_size must be a positive int or None"),
    ("cuda_graphs", None, "cuda_graphs must be a bool"),
    ("check_finite", "on", "check_finite must be a bool"),
    ("progress", 1.0, "progress must be None, True or False"),  # 1.0 == True, but not a bool
    ("context_parallel", 2, "context_parallel must be a torch.distributed ProcessGroup or None"),
    ("on_unsupported", "warn", "on_unsupported must be 'error' or 'eager'"),
    ("passes", "attention", "passes must be a list or tuple of architecture passes"),
    ("disable_passes", "attention", "disable_passes must be a list of pass names"),
    ("kernels", {"fastest": "flash"}, r"unknown kernels option\(s\) \['fastest'\]"),
    ("kernels", "flash", "kernels must be a longstraw.runtime.kernels.KernelPolicy or a dict"),
]


@pytest.mark.parametrize("name, value, message", BAD, ids=[f"{n}={v!r}" for n, v, _ in BAD])
def test_a_bad_value_is_refused_by_name(name, value, message):
    with pytest.raises(longstraw.LongStrawError, match=message):
        Options(**{name: value})


def test_every_option_has_a_default_that_validates():
    options = Options()
    assert {f.name for f in dataclasses.fields(options)} >= {name for name, _, _ in BAD}
    assert isinstance(options.kernels, KernelPolicy) and options.passes == () and options.disable_passes == ()


def test_a_mapping_is_taken_only_with_known_names():
    assert Options.from_any(None) == Options()
    given = Options(branch_rows=4)
    assert Options.from_any(given) is given
    options = Options.from_any({"prompt_grad": "detached", "kernels": {}, "disable_passes": ["attention"]})
    assert options.prompt_grad == "detached" and isinstance(options.kernels, KernelPolicy)
    assert options.disable_passes == ("attention",)
    with pytest.raises(longstraw.LongStrawError, match=r"unknown longstraw option\(s\) \['chunk'\]; valid: \["):
        Options.from_any({"chunk": 8})


def test_options_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Options().prompt_grad = "detached"
