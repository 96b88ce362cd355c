"""Run a function on N real gloo ranks (CPU, fork-started) and collect its results.

``run_ranks(fn, world_size, *args)`` forks ``world_size`` processes, each of
which joins a fresh gloo process group on a free localhost port, calls
``fn(rank, world_size, *args)`` and sends the return value back (pickled) through
a queue. Every rank ends with ``barrier`` → ``destroy_process_group`` →
``os._exit`` (without the barrier gloo can abort at exit; without ``os._exit``
forked children run the parent's atexit handlers). The parent waits a bounded
time, kills stragglers, and fails on any exception, non-zero exit code or
missing result, so a hung collective becomes a test failure, not a hung suite.

Fork is ~1 s for a 2-rank group here; spawn pays a torch import per rank.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "run_ranks"]


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, world_size: int, port: int, results, timeout: float, fn, args) -> None:
    import torch

    torch.set_num_threads(1)
    code = 0
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        value = fn(rank, world_size, *args)
        results.put((rank, True, pickle.dumps(value)))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # report everything, including assertion failures, to the parent
        code = 1
        results.put((rank, False, traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()
        os._exit(code)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.

    ``fn`` may be any callable (closures work: the ranks are forked). Its return
    value must pickle. Raises ``AssertionError`` with the failing rank's
    traceback when a rank raises, exits non-zero, or does not report within
    ``timeout`` seconds (stragglers are killed).
    """
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world_size, port, results, timeout, fn, args), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    reports: dict[int, tuple[bool, Any]] = {}
    try:
        while len(reports) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
                continue
            reports[rank] = (ok, payload)
        failed = any(not ok for ok, _ in reports.values())  # peers of a failed rank may sit in a barrier
        for p in procs:
            p.join(timeout=2.0 if failed else max(deadline - time.monotonic(), 1.0))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    failures = [f"rank {r} raised:\n{payload}" for r, (ok, payload) in sorted(reports.items()) if not ok]
    if failures:
        raise AssertionError("\n".join(failures))
    missing = sorted(set(range(world_size)) - set(reports))
    assert not missing, f"ranks {missing} did not report within timeout={timeout}s (hung collective?)"
    codes = {r: p.exitcode for r, p in enumerate(procs)}
    assert all(c == 0 for c in codes.values()), f"non-zero exit codes by rank: {codes}"
    return [pickle.loads(reports[r][1]) for r in range(world_size)]
