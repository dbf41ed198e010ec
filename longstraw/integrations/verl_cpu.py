"""A verl platform for the CPU, so verl's engine runs without a GPU.

verl 0.9.1 knows CUDA, ROCm and NPU platforms and falls back to CUDA. Its
FSDP engine itself runs on the CPU over gloo once the platform answers for
the CPU; the tests and the offline example (`examples/verl_actor_update.py`)
use this:

    from longstraw.integrations.verl_cpu import use_cpu_platform
    use_cpu_platform()  # before verl builds an engine
"""

from __future__ import annotations

import contextlib
from types import ModuleType
from typing import Any

import torch
from verl.plugin.platform import platform_manager
from verl.plugin.platform.platform_base import PlatformBase


class CpuPlatform(PlatformBase):
    """The CPU as verl's accelerator: one device, gloo, no profiler."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return torch.cpu

    def is_available(self) -> bool:
        return True

    def current_device(self) -> Any:
        return "cpu"  # verl passes it to `.to(...)`

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index: int | None = None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    def nvtx_range(self, msg: str) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def use_cpu_platform() -> None:
    """Make the CPU verl's platform in this process (before it builds an engine)."""
    if not isinstance(platform_manager._current_platform, CpuPlatform):
        platform_manager.set_platform(CpuPlatform())
