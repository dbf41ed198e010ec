"""The axes both peers plots share: a quantity against the prompt length, log-log."""

from __future__ import annotations

from typing import Any


def against_prompt_length(axes_and_labels: tuple[tuple[Any, str], ...]) -> None:
    """Each matplotlib axis: log-log over P (base 2), its y label, a grid and a legend."""
    for ax, label in axes_and_labels:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens P (longer prompt)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
