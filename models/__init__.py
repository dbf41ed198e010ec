"""Model bindings: HF model code routed to LongStraw's registered operators.

Some HF layers compute a position-mixing operator in plain Python (Qwen3.5's
Gated DeltaNet loops over 64-token chunks), which Dynamo would unroll into a
graph no pass can claim. A binding module (`longstraw.models.qwen3_5`) has
drop-ins for those functions that call LongStraw's operators instead;
`longstraw.models.mamba2` and `longstraw.models.mamba` route Mamba-2's and
Mamba-1's scans to `longstraw::ssd_scan`, `longstraw.models.kimi_linear`
Kimi Delta Attention to `longstraw::kimi_delta_rule`, `longstraw.models.minimax`
MiniMax's lightning attention to `longstraw::ssd_scan`; `longstraw.models.llama4`
has Dynamo trace Llama 4's MoE with the token axis apart from the expert
axis; `longstraw.models.moe` traces
HF's grouped_mm experts as one per-position
operator; `longstraw.models.sinks` traces gpt-oss's and MiMo-V2-Flash's
eager attention with learned sinks as one operator;
`longstraw.models.hf_logging` makes HF's once-only logging calls
(`logger.warning_once`) no-ops in traces instead of graph breaks.

`install_trace_bindings()` runs when `longstraw` is imported: for every HF
modeling module with a binding, imported before or after, Dynamo traces the
drop-ins in place of HF's functions (`torch.compiler.substitute_in_graph`),
so `torch.compile(loss, backend="longstraw")` works on the model as it is.
This holds for every compiled graph in the process, whatever its backend;
the operators compute what HF's functions compute. Eager execution is
untouched; a binding's `bind()` routes eager calls too.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

BINDINGS = {
    "transformers.models.qwen3_5.modeling_qwen3_5": "longstraw.models.qwen3_5",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe": "longstraw.models.qwen3_5",
    "transformers.models.qwen3_next.modeling_qwen3_next": "longstraw.models.qwen3_5",
    "transformers.models.olmo_hybrid.modeling_olmo_hybrid": "longstraw.models.qwen3_5",
    "transformers.integrations.moe": "longstraw.models.moe",
    "transformers.models.lfm2.modeling_lfm2": "longstraw.models.lfm2",
    "transformers.models.lfm2_moe.modeling_lfm2_moe": "longstraw.models.lfm2",
    **{name: "longstraw.models.mamba2" for name in (
        "transformers.models.mamba2.modeling_mamba2",
        "transformers.models.nemotron_h.modeling_nemotron_h",
        "transformers.models.granitemoehybrid.modeling_granitemoehybrid",
        "transformers.models.falcon_h1.modeling_falcon_h1",
        "transformers.models.bamba.modeling_bamba",
        "transformers.models.zamba2.modeling_zamba2",
    )},
    **{name: "longstraw.models.mamba" for name in (
        "transformers.models.mamba.modeling_mamba",
        "transformers.models.falcon_mamba.modeling_falcon_mamba",
        "transformers.models.jamba.modeling_jamba",
    )},
    "transformers.models.kimi_linear.modeling_kimi_linear": "longstraw.models.kimi_linear",
    "transformers.models.llama4.modeling_llama4": "longstraw.models.llama4",
    "transformers.models.minimax.modeling_minimax": "longstraw.models.minimax",
    "transformers.models.gpt_oss.modeling_gpt_oss": "longstraw.models.sinks",
    "transformers.models.mimo_v2_flash.modeling_mimo_v2_flash": "longstraw.models.sinks",
    "transformers.utils.logging": "longstraw.models.hf_logging",
}
"""HF modeling module -> the binding module that substitutes its functions in traces."""


def install_trace_bindings() -> None:
    """Substitute the bound functions of the HF modules already imported, and
    of those imported later (an import hook)."""
    for name in BINDINGS:
        if name in sys.modules:
            _substitute(sys.modules[name])
    if not any(isinstance(finder, _BindingFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _BindingFinder())


_SUBSTITUTED: set[tuple[str, str]] = set()


def substitute_functions(module: types.ModuleType, drop_ins: dict[str, Callable]) -> None:
    """Have Dynamo trace each drop-in in place of `module`'s function of
    that name, where the module has one (once per process; eager calls are
    untouched)."""
    for attr, drop_in in drop_ins.items():
        if (module.__name__, attr) in _SUBSTITUTED or not hasattr(module, attr):
            continue
        torch.compiler.substitute_in_graph(getattr(module, attr), skip_signature_check=True)(drop_in)
        _SUBSTITUTED.add((module.__name__, attr))


def substitute_forward(module: types.ModuleType, class_name: str,
                       traced: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Make `module.<class_name>.forward` the function `traced(hf_forward)`
    returns (once per process), which picks the drop-in while Dynamo traces
    and calls `hf_forward` otherwise. For a module's `forward`, which
    `substitute_in_graph` does not reach: Dynamo inlines it without looking
    it up."""
    if (module.__name__, class_name) in _SUBSTITUTED:
        return
    cls = getattr(module, class_name)
    cls.forward = functools.wraps(cls.forward)(traced(cls.forward))
    _SUBSTITUTED.add((module.__name__, class_name))


def _substitute(module: types.ModuleType) -> None:
    importlib.import_module(BINDINGS[module.__name__]).substitute_in_traces(module)


class _BindingFinder(importlib.abc.MetaPathFinder):
    """Finds a bound HF module with the other finders and substitutes its
    functions once the module has run."""

    def find_spec(self, name, path, target=None):
        if name not in BINDINGS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _SubstitutingLoader(spec.loader)
        return spec


class _SubstitutingLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self.loader.exec_module(module)
        _substitute(module)
