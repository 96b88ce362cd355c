"""Run a function on N gloo ranks forked from this process, or N spawned ranks of any backend.

Each rank joins a fresh group on a free localhost port with one intra-op thread, calls ``fn(rank, world_size,
*args)``, sends the pickled result back and ends with ``barrier`` -> ``destroy_process_group`` ->
``os._exit``.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "run_on_ranks"]


def free_port() -> int:
    """A localhost TCP port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, world_size: int, port: int, results, timeout: float, fn, args, backend: str = "gloo"
               ) -> None:  # fmt: skip
    code = 0
    try:
        torch.set_num_threads(1)
        if backend == "nccl":  # one GPU per rank, set before the group binds it
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=timeout))
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
        dist.barrier()  # without it gloo ranks abort intermittently at exit
        dist.destroy_process_group()
    except BaseException:  # every failure goes back to the parent
        code = 1
        results.put((rank, False, traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()
        os._exit(code)  # forked children must not run the parent's atexit handlers


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300, backend: str = "gloo",
                 start_method: str = "fork") -> list[Any]:  # fmt: skip
    """``[fn(r, world_size, *args) for r in ranks]``, each on its own rank; results must pickle.

    Forked ranks take closures; a process that touched CUDA must spawn (``fn`` and ``args`` then pickle;
    ``backend="nccl"``: one GPU per rank). ``RuntimeError`` with the failing ranks' tracebacks when a rank
    raises, exits non-zero or does not report within ``timeout`` seconds.
    """
    ctx = mp.get_context(start_method)
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, results, timeout, fn, args, backend),
                         daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    reports: dict[int, tuple[bool, Any]] = {}
    try:
        while len(reports) < world_size and (remaining := deadline - time.monotonic()) > 0:
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                if not any(p.is_alive() for p in procs) and results.empty():
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
    failed_ranks = [f"rank {r} raised:\n{payload}" for r, (ok, payload) in sorted(reports.items()) if not ok]
    missing = sorted(set(range(world_size)) - set(reports))
    codes = [p.exitcode for p in procs]
    if failed_ranks or missing or any(codes):
        raise RuntimeError(
            f"gloo ranks failed (exit codes {codes}; ranks {missing} did not report within timeout={timeout}s)\n"
            + "\n".join(failed_ranks)
        )
    return [pickle.loads(reports[r][1]) for r in range(world_size)]
