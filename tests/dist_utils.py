"""Run a function on N real gloo ranks (CPU, fork-started) inside a test.

A thin wrapper over :func:`cpdata.bench.ranks.run_on_ranks` (fresh gloo group
on a free port per call; every rank ends with barrier, destroy_process_group,
os._exit; bounded wait, stragglers killed) that turns a rank's failure into an
``AssertionError`` carrying its traceback, so a hung collective is a failed
test, not a hung suite. Fork costs ~1 s for a 2-rank group here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cpdata.bench.ranks import free_port, run_on_ranks

__all__ = ["free_port", "run_ranks"]


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; results by rank."""
    try:
        return run_on_ranks(fn, world_size, *args, timeout=timeout)
    except RuntimeError as e:
        raise AssertionError(str(e)) from None
