"""Ctrl-C (``KeyboardInterrupt``) or ``SystemExit`` inside an atomic write leaves no hidden folder beside the target.

SIGKILL leftovers are the next writer's to recover (tests/test_precompute_crash.py);
an interrupt the writer sees itself is cleaned up before it propagates: the
target is the complete old directory or the complete new one, and nothing
else is left in its parent.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import cpdata.sources.atomic as atomic
from cpdata.sources import atomic_directory

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("written", "new", "old", "swapped")


def _write(target: Path, text: str, **kw) -> None:
    with atomic_directory(target, **kw) as tmp:
        (tmp / "file").write_text(text)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_in_the_body_removes_the_temp_folder(tmp_path, exc):
    target = tmp_path / "out"
    with pytest.raises(exc), atomic_directory(target) as tmp:
        (tmp / "half").write_text("x")
        raise exc()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize("step", STEPS)
def test_an_interrupt_during_the_swap_leaves_old_or_new_and_nothing_hidden(tmp_path, monkeypatch, exc, step):
    target = tmp_path / "out"
    _write(target, "old")

    def interrupted(at: str) -> None:
        if at == step:
            raise exc()

    monkeypatch.setattr(atomic, "stall", interrupted)
    with pytest.raises(exc):
        _write(target, "new", overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["out"], step  # no .out.tmp/.new/.old sibling
    assert (target / "file").read_text() == ("new" if step == "swapped" else "old"), step
    monkeypatch.undo()
    _write(target, "again", overwrite=True)  # and the next write goes through
    assert (target / "file").read_text() == "again"


def test_a_real_ctrl_c_while_writing_a_store_leaves_nothing_hidden(tmp_path):
    src = tmp_path / "d.jsonl"
    src.write_text("".join(json.dumps({"input_ids": [1, 2, i]}) + "\n" for i in range(50)))
    env = {**os.environ, "CPDATA_ATOMIC_STALL": "new", "PYTHONPATH": str(ROOT)}
    # (a shell's background job, as `cmd &` in a script, inherits SIGINT ignored, and Python keeps it so: the
    # child gets Ctrl-C's default disposition, as in a terminal, whatever launched the tests)
    proc = subprocess.Popen([sys.executable, "-m", "cpdata.cli", "pack-store", str(src), "--out",
                             str(tmp_path / "store"), "--quiet"], env=env, stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    try:
        assert proc.stderr.readline().strip() == "stalled at new"  # complete, about to be published
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert proc.returncode != 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl"]  # not published, nothing hidden left
