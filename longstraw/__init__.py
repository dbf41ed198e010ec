"""LongStraw: a torch.compile backend for GRPO-style losses over long shared prompts.

    step = torch.compile(grpo_loss, backend="longstraw")
    step = torch.compile(grpo_loss, backend=longstraw.Backend(prompt_grad="detached"))
"""

from longstraw.backend import Backend, Fallback, GroupPlan, longstraw_backend
from longstraw.runtime.carry import CarryKernel
from longstraw.parallel.data_parallel import LossModule
from longstraw.errors import InputError, LongStrawError, UnsupportedGraphError
from longstraw.planning.graph_model import CapturedTensor
from longstraw.planning.report import ExplainReport, MemoryPlan, explain
from longstraw.options import Options
from longstraw.pass_registry import register_pass
from longstraw.runtime.phases import around_steps
from longstraw.models import install_trace_bindings
from longstraw.pipeline import enable_dumps

install_trace_bindings()
enable_dumps()

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
