"""``cpdata precompute`` killed (SIGKILL) at every step of writing: never a partial plan under the target's name.

A real subprocess stops at a named step (the ``CPDATA_ATOMIC_STALL`` hook in
:mod:`cpdata.sources.atomic`) and is killed there. The target must then be
the complete old plan, the complete new plan, or absent with a reader error
naming the interrupted write; the next run restores or completes the swap,
removes the dead writer's leftovers and succeeds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from cpdata.cli import main as cli_main
from cpdata.offline import read_store
from cpdata.sources import atomic_directory
from cpdata.sources.atomic import recover_directory

ROOT = Path(__file__).resolve().parents[1]


def _data(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"input_ids": rng.integers(0, 100, int(n)).tolist()}) + "\n"
                            for n in rng.integers(1, 200, 50)))  # fmt: skip
    return path


def _args(data: Path, out: Path, capacity: int) -> list[str]:
    return ["precompute", str(data), "--capacity", str(capacity), "--cp-size", "2", "--layout", "thd",
            "--overflow", "split", "--out", str(out), "--force", "--quiet"]  # fmt: skip


def _killed_at(step: str, args: list[str]) -> None:
    """Run ``cpdata`` with ``args`` in a subprocess, SIGKILL it once it stalls at ``step``."""
    env = {**os.environ, "CPDATA_ATOMIC_STALL": step, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "cpdata.cli", *args], env=env, stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True)  # fmt: skip
    try:
        line = proc.stderr.readline()
        assert line.strip() == f"stalled at {step}", line
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL


def _hidden(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".plan."))


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """The data and the digests of the old (capacity 256) and the new (capacity 512) plan."""
    tmp = tmp_path_factory.mktemp("ref")
    data = _data(tmp)
    digests = {}
    for name, capacity in (("old", 256), ("new", 512)):
        assert cli_main(_args(data, tmp / name, capacity)) == 0
        digests[name] = read_store(tmp / name).digest
    return data, digests


# Where the writer is killed -> what the target holds before the next run.
STEPS = {"writing": "old", "written": "old", "new": "old", "old": "absent", "swapped": "new"}


@pytest.mark.parametrize("step", list(STEPS))
def test_force_killed_at_any_step_leaves_old_new_or_a_clear_message_and_a_rerun_succeeds(tmp_path, plans, step):
    source, digests = plans
    data = tmp_path / "data.jsonl"
    data.write_bytes(source.read_bytes())
    plan = tmp_path / "plan"
    assert cli_main(_args(data, plan, 256)) == 0
    assert read_store(plan).digest == digests["old"]

    _killed_at(step, _args(data, plan, 512))
    assert _hidden(tmp_path), "the killed writer left its hidden directory (else the kill point was not reached)"
    if STEPS[step] == "absent":
        assert not plan.exists()
        with pytest.raises(ValueError, match=r"no precomputed plan at .*interrupted write.*\.plan\.(new|old)-.*re-run"):
            read_store(plan)
    else:
        assert read_store(plan).digest == digests[STEPS[step]]  # complete and verified

    assert cli_main(_args(data, plan, 512)) == 0  # the next run recovers, then writes
    assert read_store(plan).digest == digests["new"]
    assert _hidden(tmp_path) == [], "every leftover of the dead writer is gone"


def test_recovery_alone_completes_or_restores_the_swap(tmp_path, plans):
    """Without writing again: a complete ``.new`` replaces the target; a lone ``.old`` comes back."""
    source, digests = plans
    data = tmp_path / "data.jsonl"
    data.write_bytes(source.read_bytes())
    plan = tmp_path / "plan"
    assert cli_main(_args(data, plan, 256)) == 0

    _killed_at("old", _args(data, plan, 512))  # target absent, .new complete, .old holds the old plan
    done = recover_directory(plan)
    assert any("completed the replacement" in line for line in done), done
    assert read_store(plan).digest == digests["new"] and _hidden(tmp_path) == []

    _killed_at("writing", _args(data, plan, 256))  # incomplete .tmp only
    assert [name.split("-")[0] for name in _hidden(tmp_path)] == [".plan.tmp"]
    os.rename(plan, tmp_path / "moved")  # nothing at the target now; an incomplete tmp is never published
    recover_directory(plan)
    assert not plan.exists() and _hidden(tmp_path) == []


def test_only_dead_writers_leftovers_are_removed(tmp_path):
    target = tmp_path / "store"
    host = __import__("socket").gethostname()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    mine = tmp_path / f".store.tmp-{os.getpid()}-{host}-abcd1234"  # a live writer: this process
    gone = tmp_path / f".store.tmp-{dead.pid}-{host}-abcd1234"
    remote = tmp_path / f".store.tmp-{dead.pid}-another-host.example-abcd1234"  # its pid cannot be checked here
    for path in (mine, gone, remote):
        path.mkdir()
        (path / "part.npy").write_bytes(b"x")
    with atomic_directory(target) as tmp:
        (tmp / "file").write_text("complete")
    assert (target / "file").read_text() == "complete"
    assert mine.is_dir() and remote.is_dir() and not gone.exists()


def test_atomic_directory_publishes_only_on_success(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(RuntimeError, match="boom"), atomic_directory(target) as tmp:
        (tmp / "half").write_text("x")
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
    with atomic_directory(target) as tmp:
        (tmp / "a").write_text("1")
    with pytest.raises(ValueError, match="already exists; pass overwrite=True"), atomic_directory(target):
        pass
    with atomic_directory(target, overwrite=True) as tmp:
        (tmp / "b").write_text("2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and os.listdir(target) == ["b"]
    assert oct(target.stat().st_mode & 0o777) == "0o755"


def test_a_stalled_writer_is_really_waiting(tmp_path):
    """The hook stops the writer; without the kill it would not finish quickly (guards the kill tests)."""
    data = _data(tmp_path)
    env = {**os.environ, "CPDATA_ATOMIC_STALL": "new", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "cpdata.cli", *_args(data, tmp_path / "plan", 256)], env=env,
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)  # fmt: skip
    try:
        assert proc.stderr.readline().strip() == "stalled at new"
        time.sleep(0.3)
        assert proc.poll() is None and not (tmp_path / "plan").exists()
    finally:
        proc.kill()
        proc.wait(30)
