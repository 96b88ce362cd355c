"""Worker processes die with a parent killed by SIGKILL, even while stuck in a slow read.

Each case runs a real parent process (``python parent.py MODE MARKERS``)
whose workers get stuck reading a document (they sleep forever, as on dead
storage), write a marker file with their pid, and wait. The test SIGKILLs the
parent and asserts every worker is gone within :data:`BOUND_S`. Without
:func:`cpdata.nodes.worker_process.exit_with_parent` they would live on (torch's own check
runs only between reads, every 5 s).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
BOUND_S = 2.0
"""How long a worker may outlive its killed parent (docs/usage.md: "within 2 s")."""

SCRIPT = r'''
import multiprocessing as mp, os, sys, threading, time
import numpy as np

MODE, MARKERS = sys.argv[1], sys.argv[2]


def stuck():
    open(os.path.join(MARKERS, str(os.getpid())), "w").close()
    while True:
        time.sleep(0.5)


class SlowStorage:
    """Documents 0..2 read fine; document 3 never returns (dead storage)."""

    def __len__(self):
        return 100

    def __getitem__(self, i):
        if i >= 3:
            stuck()
        return {"input_ids": np.arange(1, 20)}


def child(deathsig, watchdog):
    from cpdata.nodes.worker_process import exit_with_parent
    exit_with_parent(deathsig=deathsig, watchdog=watchdog)
    stuck()


def loader(ctx):
    from torchdata.stateful_dataloader import StatefulDataLoader
    from cpdata.nodes.dataset import CPDataset
    from cpdata.nodes.options import StreamPlan
    ds = CPDataset(SlowStorage(), capacity=32, cp_size=1, cp_rank=0, layout="identity",
                   plan=StreamPlan(overflow="split"))
    return StatefulDataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=ctx)


if __name__ == "__main__":
    if MODE in ("fork", "spawn"):
        it = iter(loader(MODE))
        print("ready", flush=True)
        next(it)
    elif MODE == "thread":
        # Workers forked from a thread that then ends: the parent-death signal (tied to that thread) must not
        # be armed, or they would die with the thread; the watchdog still ties them to the process.
        holder = []
        t = threading.Thread(target=lambda: holder.append(iter(loader("fork"))))
        t.start()
        t.join()
        print("ready", flush=True)
        time.sleep(3600)
    else:
        deathsig, watchdog = {"deathsig": (True, False), "watchdog": (False, True)}[MODE]
        for _ in range(2):
            mp.get_context("fork").Process(target=child, args=(deathsig, watchdog)).start()
        print("ready", flush=True)
        time.sleep(3600)
'''


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("mode", ["fork", pytest.param("spawn", marks=pytest.mark.slow), "thread", "deathsig",
                                  "watchdog"])  # fmt: skip
def test_workers_exit_promptly_when_the_parent_is_killed(tmp_path, mode):
    markers = tmp_path / "stuck"
    markers.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    script = tmp_path / "parent.py"  # a file, so spawned workers can import SlowStorage from it
    script.write_text(SCRIPT)
    parent = subprocess.Popen([sys.executable, str(script), mode, str(markers)], env=env, cwd=tmp_path,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert parent.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 60
        while len(os.listdir(markers)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        workers = sorted(int(p) for p in os.listdir(markers))
        assert len(workers) == 2, "both workers are stuck in the slow read"
        assert all(psutil.Process(w).ppid() == parent.pid for w in workers)
        if mode == "thread":
            time.sleep(0.5)
            assert all(_alive(w) for w in workers), "the forking thread ended: its workers must live on"
        parent.send_signal(signal.SIGKILL)
        parent.wait(30)
        killed = time.monotonic()
        while any(_alive(w) for w in workers) and time.monotonic() - killed < 30:
            time.sleep(0.01)
        outlived = time.monotonic() - killed
    finally:
        if parent.poll() is None:
            parent.kill()
        for w in [int(p) for p in os.listdir(markers)]:
            if _alive(w):
                os.kill(w, signal.SIGKILL)
    print(f"[orphans] {mode}: workers gone {outlived:.3f}s after the parent was killed")
    assert outlived < BOUND_S, f"workers outlived their killed parent by {outlived:.1f}s"
