"""Shared fixtures and helpers.

Nothing here imports `longstraw` at module level, so the reference tests
(`tests/contract/test_reference.py`) run without the backend installed.
"""

from __future__ import annotations

import contextlib
import gc
import re

import pytest
import torch

from helpers.tiny_models import make_group, make_model


@pytest.fixture(autouse=True)
def _reset_dynamo():
    """Compile caches must not leak between tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After each test's teardown, collect its garbage and freeze what is
    left: a worker runs hundreds of Dynamo traces, and without this every
    later collection of the oldest generation walks every object earlier
    tests left alive (modules, caches), which made a test three times
    slower late in a CI run than alone. Frozen objects are still freed
    by reference counting; only cycles among them wait for the process's end."""
    yield
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    """`slow` tests run only when a marker expression is given (`-m slow`);
    `gpu` tests only where CUDA is (`-m gpu` on the GPU machine)."""
    no_gpu = pytest.mark.skip(reason="needs CUDA: run with -m gpu on a GPU machine")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
    if config.getoption("-m"):
        return
    skip = pytest.mark.skip(reason="slow sweep: run with -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def _exception_chain(exc: BaseException):
    seen = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        # Dynamo's BackendCompilerFailed also keeps the original as .inner_exception
        todo += [e.__cause__, e.__context__, getattr(e, "inner_exception", None)]


class LongStrawErrorInfo:
    """Filled in when the `raises_longstraw` block exits: `.value` is the
    matching LongStrawError, `.outer` the exception the block raised."""

    value: BaseException | None = None
    outer: BaseException | None = None


@contextlib.contextmanager
def raises_longstraw(match: str):
    """Expect a `longstraw.LongStrawError` whose message matches `match`
    (re.search), raised directly or anywhere in the __cause__/__context__
    chain (Dynamo wraps errors raised at compile time in
    BackendCompilerFailed). Yields a LongStrawErrorInfo."""
    import longstraw

    info = LongStrawErrorInfo()
    try:
        yield info
    except Exception as exc:  # noqa: BLE001 - we inspect the chain below
        chain = list(_exception_chain(exc))
        ours = [e for e in chain if isinstance(e, longstraw.LongStrawError)]
        if not ours:
            raise AssertionError(
                f"expected a LongStrawError matching {match!r}; got {type(exc).__name__}: {exc}"
            ) from exc
        hits = [e for e in ours if re.search(match, str(e))]
        if not hits:
            raise AssertionError(
                f"LongStrawError does not match {match!r}: " + " | ".join(str(e) for e in ours)
            ) from exc
        info.value, info.outer = hits[0], exc
    else:
        pytest.fail(f"expected a LongStrawError matching {match!r}, nothing was raised")


@pytest.fixture
def model_factory():
    """make_model(kind, seed=0, vocab_size=VOCAB) -> a tiny float64 model;
    kinds in tiny_models.KINDS (plain variants, qwen3, llama, llama_tied)."""
    return make_model


@pytest.fixture
def group_factory():
    """make_group(G, P, R, vocab=VOCAB, pad=False, seed=0) -> (prompt [P],
    responses [G, R], advantages [G] float64, mask [G, R] float64)."""
    return make_group
