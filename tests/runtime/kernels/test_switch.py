"""The on/off switch of an optional kernel family (`longstraw/runtime/kernels/switch.py`):
a family is off while any `off()` around the call is open, takes tensors without
values while any `simulating()` is, and either comes back when its block exits, raising or not."""

from __future__ import annotations

import pytest

from longstraw.runtime.kernels.switch import KernelSwitch


def test_a_new_switch_is_on_and_simulates_nothing():
    switch = KernelSwitch("family")
    assert switch.family == "family" and switch.on and not switch.fakes


def test_the_family_is_off_while_any_off_block_is_open():
    switch = KernelSwitch("family")
    with switch.off():
        assert not switch.on
        with switch.off():
            assert not switch.on
        assert not switch.on
    assert switch.on


def test_simulations_nest_and_leave_the_switch_on():
    switch = KernelSwitch("family")
    with switch.simulating():
        with switch.simulating():
            assert switch.fakes and switch.on
        assert switch.fakes
    assert not switch.fakes


def test_a_raising_block_restores_the_switch():
    switch = KernelSwitch("family")
    with pytest.raises(RuntimeError, match="inside"):
        with switch.off(), switch.simulating():
            raise RuntimeError("inside")
    assert switch.on and not switch.fakes


def test_two_switches_are_independent():
    first, second = KernelSwitch("first"), KernelSwitch("second")
    with first.off(), second.simulating():
        assert not first.on and not first.fakes
        assert second.on and second.fakes


def test_the_repr_names_the_family_and_its_state():
    switch = KernelSwitch("fla gated_delta")
    assert repr(switch) == "KernelSwitch('fla gated_delta', on=True)"
    with switch.off():
        assert repr(switch) == "KernelSwitch('fla gated_delta', on=False)"
