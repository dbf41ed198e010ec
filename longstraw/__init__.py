"""LongStraw: a torch.compile backend for GRPO-style losses over long shared prompts.

    step = torch.compile(grpo_loss, backend="longstraw")
    step = torch.compile(grpo_loss, backend=longstraw.Backend(prompt_grad="detached"))
"""

from .backend import Backend, Fallback, GroupPlan, longstraw_backend
from .carry import CarryKernel
from .data_parallel import LossModule
from .errors import InputError, LongStrawError, UnsupportedGraphError
from .graph_model import CapturedTensor
from .report import ExplainReport, MemoryPlan, explain
from .options import Options
from .pass_registry import register_pass
from .runtime import around_steps
from .models import install_trace_bindings

install_trace_bindings()

__all__ = [
    "Backend",
    "CapturedTensor",
    "CarryKernel",
    "ExplainReport",
    "Fallback",
    "MemoryPlan",
    "GroupPlan",
    "InputError",
    "LongStrawError",
    "LossModule",
    "Options",
    "UnsupportedGraphError",
    "around_steps",
    "explain",
    "longstraw_backend",
    "register_pass",
]
