"""A stand-in for `ray` where it is not installed (the GPU machine lacks it,
and its wheel is larger than what can be carried there).

verl imports `ray` when it is imported (`verl.protocol`), but its FSDP
engine, which `verl_bench.py` drives in one process, never calls it. The
stand-in is a package whose every attribute is an inert class; it is put in
place only when the real `ray` cannot be found, and says so."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types


class _InertRay(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name == "ray" or name.startswith("ray."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []

        def attribute(name: str) -> type:
            if name.startswith("__"):
                raise AttributeError(name)
            return type(name, (), {})

        module.__getattr__ = attribute
        return module

    def exec_module(self, module) -> None:
        pass


def stand_in_for_ray() -> None:
    """Install the stand-in if `ray` is not installed."""
    if importlib.util.find_spec("ray") is None:
        print("verl_bench: ray is not installed; an inert stand-in lets verl import (its engine never calls ray)",
              flush=True)
        sys.meta_path.append(_InertRay())
