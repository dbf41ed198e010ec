"""Passes from outside the package (`longstraw.pass_registry`): a pass
defined here reaches the backend through each route (options, `register_pass`,
an installed package's entry point) with eager parity; two passes claiming
one node is an error naming both, unless one declares it overrides the other;
without the pass the operator is refused; a pass is disabled by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import longstraw
from longstraw import pass_registry
from longstraw.passes.causal_conv import CausalConvPass, causal_conv1d_reference
from longstraw.runtime.carry import recompute_grads

from conftest import raises_longstraw
from helpers.compare import assert_close, assert_grads_close
from helpers.harness import compile_loss, compiled_loss_and_grads
from helpers.losses import grpo_tail
from helpers.reference import eager_loss_and_grads
from helpers.tiny_models import make_group


@torch.library.custom_op("lstest::shift_mix", mutates_args=())
def shift_mix(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A causal depthwise mix over the last K positions, an operator the backend does not know."""
    return causal_conv1d_reference(x, weight, None, None, None)[0]


@shift_mix.register_fake
def _(x, weight):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad_out):
    fn = lambda x, w: causal_conv1d_reference(x, w, None, None, None)[:1]  # noqa: E731
    return tuple(recompute_grads(fn, ctx.saved_tensors, [grad_out], ctx.needs_input_grad))


shift_mix.register_autograd(_backward, setup_context=_setup)


class ShiftMixPass(CausalConvPass):
    """The causal convolution's pass, claiming `lstest::shift_mix` (no bias, no activation)."""

    name = "shift_mix"
    op = torch.ops.lstest.shift_mix.default

    def step_inputs(self, node: torch.fx.Node):
        return (*node.args[:2], None), {"activation": None}


class ShiftMixModel(nn.Module):
    def __init__(self, vocab: int = 64, channels: int = 16, width: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, channels, dtype=torch.float64)
        self.mix = nn.Parameter(torch.randn(channels, width, dtype=torch.float64) / width)
        self.head = nn.Linear(channels, vocab, dtype=torch.float64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids).transpose(1, 2)  # [B, C, L]
        return self.head(torch.tanh(shift_mix(x, self.mix)).transpose(1, 2))


def shift_mix_loss(model, prompt, responses, advantages, mask):
    ids = torch.cat([prompt.expand(responses.shape[0], -1), responses], dim=1)
    return grpo_tail(model(ids)[:, prompt.shape[0] - 1 : -1], responses, advantages, mask)


@pytest.fixture
def registry(monkeypatch):
    """An empty registry and entry-point cache, restored after the test."""
    monkeypatch.setattr(pass_registry, "_REGISTERED", [])
    pass_registry.installed_passes.cache_clear()
    yield
    pass_registry.installed_passes.cache_clear()


def _parity(backend) -> None:
    model, group = ShiftMixModel(), make_group(3, 11, 5, pad=True)
    want_loss, want = eager_loss_and_grads(shift_mix_loss, model, *group)
    got_loss, got = compiled_loss_and_grads(compile_loss(shift_mix_loss, backend), model, *group)
    assert_close(got_loss, want_loss, 1e-10)
    assert_grads_close(got, want, 1e-10)


def test_unknown_operator_is_refused_without_its_pass(registry):
    with raises_longstraw(r"`lstest::shift_mix`.* touches the sequence axis and has no dimension rule.*longstraw.register_pass"):
        compile_loss(shift_mix_loss, longstraw.Backend())(ShiftMixModel(), *make_group(2, 9, 3))


def test_pass_through_options(registry):
    _parity({"passes": [ShiftMixPass], "prefix_chunk_size": 4, "verify_state": True})


def test_pass_through_register_pass(registry):
    instance = longstraw.register_pass(ShiftMixPass())
    assert longstraw.register_pass(instance) is instance  # once, however often registered
    backend = longstraw.Backend(prefix_chunk_size=4, verify_state=True)
    assert [p for p in backend.passes if isinstance(p, ShiftMixPass)] == [instance]
    _parity(backend)


def _install(tmp_path, monkeypatch, entry: str) -> None:
    """A distribution on sys.path declaring `entry` in the `longstraw.passes` group."""
    info = tmp_path / "lstest_passes-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lstest-passes\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[longstraw.passes]\n{entry}\n")
    monkeypatch.syspath_prepend(str(tmp_path))


def test_pass_through_an_entry_point(registry, tmp_path, monkeypatch):
    _install(tmp_path, monkeypatch, f"shift_mix = {__name__}:ShiftMixPass")
    assert [type(p) for p in pass_registry.installed_passes()] == [ShiftMixPass]
    _parity(longstraw.Backend(prefix_chunk_size=4, verify_state=True))


def test_an_entry_point_that_is_not_a_pass_is_named(registry, tmp_path, monkeypatch):
    _install(tmp_path, monkeypatch, f"broken = {__name__}:shift_mix_loss")
    with pytest.raises(longstraw.LongStrawError, match="entry point broken .* expected an ArchitecturePass"):
        longstraw.Backend()


@pytest.mark.parametrize("on_unsupported", ["error", "eager"])
def test_two_passes_claiming_one_node_is_an_error_naming_both(registry, on_unsupported):
    """A configuration error: raised even where unsupported graphs run unchanged."""
    backend = longstraw.Backend(passes=[ShiftMixPass(), ShiftMixPass()], on_unsupported=on_unsupported)
    with raises_longstraw(r"claimed by 2 architecture passes, .*ShiftMixPass \('shift_mix'\) and .*ShiftMixPass"):
        compile_loss(shift_mix_loss, backend)(ShiftMixModel(), *make_group(2, 9, 3))


class NarrowShiftMixPass(ShiftMixPass):
    """Claims what `ShiftMixPass` claims and declares it takes precedence."""

    name = "narrow_shift_mix"
    overrides = ("shift_mix",)


def test_a_pass_that_overrides_another_takes_the_node(registry):
    backend = longstraw.Backend(passes=[ShiftMixPass(), NarrowShiftMixPass()], prefix_chunk_size=4)
    _parity(backend)
    assert {p.name for p in backend.plans[-1].partition.claims.values()} == {"narrow_shift_mix"}


def test_a_pass_is_disabled_by_name(registry):
    backend = longstraw.Backend(options={"passes": [NarrowShiftMixPass], "disable_passes": ["narrow_shift_mix"]})
    assert "narrow_shift_mix" not in {p.name for p in backend.passes} and "causal_attention" in {p.name for p in backend.passes}
    with raises_longstraw(r"`lstest::shift_mix`.* has no dimension rule"):
        compile_loss(shift_mix_loss, backend)(ShiftMixModel(), *make_group(2, 9, 3))
    with pytest.raises(longstraw.LongStrawError, match=r"disable_passes names no pass \['shiftmix'\]: .*'causal_attention'"):
        longstraw.Backend(disable_passes=["shiftmix"])
    with pytest.raises(longstraw.LongStrawError, match="disable_passes must be a list of pass names"):
        longstraw.Options(disable_passes="causal_attention")


def test_passes_option_is_validated():
    with pytest.raises(longstraw.LongStrawError, match="expected an ArchitecturePass"):
        longstraw.Options(passes=[object()])
    with pytest.raises(longstraw.LongStrawError, match="passes must be a list or tuple"):
        longstraw.Options(passes=ShiftMixPass())
