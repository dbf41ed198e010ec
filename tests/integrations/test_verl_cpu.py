"""verl's CPU platform (`longstraw/integrations/verl_cpu.py`): `CpuPlatform`
implements every hook of verl's `PlatformBase` for one CPU device over
gloo, and `use_cpu_platform` makes it the platform verl's device helpers
answer from, replacing the CUDA platform verl falls back to, once."""

from __future__ import annotations

import types

import pytest
import torch
from verl.plugin.platform import platform_manager
from verl.utils import device

from longstraw.integrations.verl_cpu import CpuPlatform, use_cpu_platform


@pytest.fixture
def no_platform(monkeypatch):
    """verl's platform singleton, restored after the test."""
    monkeypatch.setattr(platform_manager, "_current_platform", None)


def test_the_cpu_is_one_device_over_gloo():
    """Made at all: every abstract hook of `PlatformBase` is implemented."""
    platform = CpuPlatform()
    assert (platform.device_name, platform.vendor_name, platform.device_module) == ("cpu", "cpu", torch.cpu)
    assert platform.is_available() and platform.device_count() == 1
    assert torch.ones(2).to(platform.current_device()).device == torch.device("cpu")
    assert platform.communication_backend_name() == "gloo" and platform.ray_resource_name() == "CPU"
    assert platform.get_device_capability() == (None, None)
    assert platform.ray_noset_envvars() == [] and not platform.is_ipc_supported() and platform.cudart() is None


@pytest.mark.parametrize("seed", ["manual_seed", "manual_seed_all"])
def test_seeding_seeds_torch(seed):
    getattr(CpuPlatform(), seed)(5)
    drawn = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(drawn, torch.rand(3))


def test_verls_device_helpers_answer_for_the_cpu(no_platform):
    use_cpu_platform()
    assert isinstance(platform_manager.get_platform(), CpuPlatform)
    assert (device.get_device_name(), device.get_torch_device()) == ("cpu", torch.cpu)
    assert device.get_nccl_backend() == "gloo"
    assert device.get_device_id() == "cpu" and device.is_device_available()


def test_the_cuda_fallback_is_replaced_and_the_cpu_platform_kept(no_platform):
    platform_manager.set_platform(types.SimpleNamespace(device_name="cuda"))
    use_cpu_platform()
    first = platform_manager.get_platform()
    use_cpu_platform()
    assert isinstance(first, CpuPlatform) and platform_manager.get_platform() is first
