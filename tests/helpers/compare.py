"""Relative-error comparisons of losses and gradient dicts."""

from __future__ import annotations

import torch

TINY = 1e-30


def rel_err(a: torch.Tensor, b: torch.Tensor, tiny: float = TINY) -> float:
    """||a - b|| / max(||b||, tiny), in float64."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(tiny)).item()


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str = "value"):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = rel_err(got, want)
    detail = f" (got {got.item():.17g}, want {want.item():.17g})" if got.numel() == 1 else ""
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}{detail}"


def assert_grads_close(got: dict, want: dict, tol: float, floor: float = 1e-6):
    """Same trainable parameters, the same None-ness, and per-parameter
    relative error <= tol. Reports every offending parameter at once.

    `tiny` in the relative error is `floor` times the largest gradient norm:
    a gradient that is zero in exact arithmetic (e.g. q/k when every query
    sees one key) is round-off in eager (~1e-17) and may be exactly 0
    compiled; relative to itself that is a 100% error, relative to the
    model's gradient scale it is 1e-11.
    """
    assert got.keys() == want.keys(), f"parameter sets differ: {sorted(got.keys() ^ want.keys())}"
    norms = [w.detach().double().norm().item() for w in want.values() if w is not None]
    tiny = max([TINY] + [floor * n for n in norms])
    bad = []
    for name in want:
        g, w = got[name], want[name]
        if w is None or g is None:
            if (w is None) != (g is None):
                bad.append(f"{name}: got {'None' if g is None else 'a grad'}, want {'None' if w is None else 'a grad'}")
            continue
        if g.shape != w.shape:
            bad.append(f"{name}: shape {tuple(g.shape)} != {tuple(w.shape)}")
            continue
        err = rel_err(g, w, tiny)
        if not err <= tol:  # also catches NaN
            bad.append(f"{name}: relative error {err:.3e}")
    assert not bad, f"gradients differ (tol {tol:.1e}):\n  " + "\n  ".join(bad)


def grads_equal(a: dict, b: dict) -> bool:
    """Bitwise equality, None included (for 'untouched' checks)."""
    if a.keys() != b.keys():
        return False
    for n in a:
        if (a[n] is None) != (b[n] is None):
            return False
        if a[n] is not None and not torch.equal(a[n], b[n]):
            return False
    return True
