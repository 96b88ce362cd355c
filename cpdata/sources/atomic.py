"""Write a directory atomically, and recover from a writer killed at any point.

``with atomic_directory(target) as tmp:`` yields a hidden sibling that takes ``target``'s name only once the
body returns. Hidden names carry the writer's pid and host: ``.NAME.tmp-PID-HOST-X`` (being written),
``.NAME.new-...`` (complete), ``.NAME.old-...`` (the previous ``NAME`` during the swap). The swap is
``tmp -> new``, ``NAME -> old``, ``new -> NAME``, delete ``old``, one ``rename`` each; :func:`recover_directory`
finishes or undoes what a dead writer of this host left (live writers and other hosts are left alone).
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["atomic_directory", "check_writable", "interrupted_write", "recover_directory"]

_STALL_ENV = "CPDATA_ATOMIC_STALL"
"""Test hook: name of a step (``writing``, ``written``, ``new``, ``old``, ``swapped``) where the writer stops
(prints ``stalled at STEP`` to stderr and sleeps), so a test can kill it exactly there."""
_KINDS = ("tmp", "new", "old")


def stall(step: str) -> None:
    """Sleep at ``step`` when the test hook asks for it (see ``_STALL_ENV``); a no-op otherwise."""
    if os.environ.get(_STALL_ENV) == step:
        print(f"stalled at {step}", file=sys.stderr, flush=True)
        time.sleep(3600)


def _host() -> str:
    return socket.gethostname().replace("/", "_") or "localhost"


def _prefix(target: Path, kind: str) -> str:
    return f".{target.name}.{kind}-{os.getpid()}-{_host()}-"


def _siblings(target: Path) -> list[tuple[str, int, str, Path]]:
    """``(kind, pid, host, path)`` of every hidden sibling written for ``target``."""
    out = []
    for kind in _KINDS:  # (a missing parent globs to nothing)
        lead = f".{target.name}.{kind}-"
        for path in target.parent.glob(f"{glob.escape(lead)}*"):
            pid, _, rest = path.name[len(lead) :].partition("-")
            host = rest.rpartition("-")[0]
            if pid.isdigit() and host:
                out.append((kind, int(pid), host, path))
    return sorted(out, key=lambda e: (e[1], e[0], e[3].name))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, another user's
        return True
    return True


def recover_directory(target: str | os.PathLike[str]) -> list[str]:
    """Finish or undo what dead writers of ``target`` left behind; returns what was done, one line each."""
    target = Path(target)
    done: list[str] = []
    by_writer: dict[tuple[int, str], dict[str, list[Path]]] = {}
    for kind, pid, host, path in _siblings(target):
        if host == _host() and pid != os.getpid() and not _alive(pid):  # a dead writer of this host
            by_writer.setdefault((pid, host), {k: [] for k in _KINDS})[kind].append(path)
    for (pid, _), found in sorted(by_writer.items()):
        for tmp in found["tmp"]:
            shutil.rmtree(tmp, ignore_errors=True)
            done.append(f"removed {tmp.name}, left incomplete by writer pid {pid}")
        news, olds = found["new"], found["old"]
        if news:
            if target.exists():
                if not olds:  # a fresh hidden name to move it aside to
                    olds = [Path(tempfile.mkdtemp(prefix=_prefix(target, "old"), dir=target.parent))]
                    os.rmdir(olds[0])
                os.replace(target, olds[0])
            os.replace(news[0], target)
            done.append(f"completed the replacement of {target.name} by writer pid {pid} (from {news[0].name})")
            for extra in news[1:]:
                shutil.rmtree(extra, ignore_errors=True)
        elif olds and not target.exists():
            os.replace(olds[0], target)
            done.append(f"restored the previous {target.name} from {olds[0].name} (writer pid {pid} died mid-swap)")
            olds = olds[1:]
        for old in olds:
            shutil.rmtree(old, ignore_errors=True)
            done.append(f"removed {old.name}, the replaced {target.name} of writer pid {pid}")
    return done


def interrupted_write(target: str | os.PathLike[str]) -> str | None:
    """A sentence naming the hidden halves of an interrupted swap of ``target``, or None if there are none."""
    target = Path(target)
    halves = [p.name for kind, _, _, p in _siblings(target) if kind in ("new", "old")]
    if not halves:
        return None
    return (
        f"an interrupted write of {target} left {', '.join(halves)} beside it; re-run the command that writes it "
        "(it restores or completes the swap first)"
    )


def check_writable(target: str | os.PathLike[str], *, overwrite: bool) -> list[str]:
    """Recover dead writers' leftovers, then refuse an existing ``target`` unless ``overwrite``; returns what the
    recovery did. Checked before long work, and again when writing."""
    done = recover_directory(target)
    if Path(target).exists() and not overwrite:
        raise ValueError(f"output directory {str(target)!r} already exists; pass overwrite=True (--force) or pick another")
    return done


@contextlib.contextmanager
def atomic_directory(target: str | os.PathLike[str], *, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty hidden directory that replaces ``target`` (mode 0o755) when the block exits normally.

    Recovers dead writers' leftovers first and refuses an existing ``target`` unless ``overwrite``. On any
    exception the new directory is removed and the old ``target`` stays; only SIGKILL leaves halves behind,
    for the next writer to recover."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    check_writable(target, overwrite=overwrite)
    tmp = Path(tempfile.mkdtemp(prefix=_prefix(target, "tmp"), dir=target.parent))
    new = tmp.with_name(tmp.name.replace(".tmp-", ".new-", 1))
    old: Path | None = None
    try:
        yield tmp
        stall("written")
        os.chmod(tmp, 0o755)
        os.replace(tmp, new)
        stall("new")
        if target.exists():
            old = new.with_name(new.name.replace(".new-", ".old-", 1))
            os.replace(target, old)
            stall("old")
        os.replace(new, target)
        stall("swapped")
    except BaseException:  # Ctrl-C / SystemExit too: this writer is alive, so no later writer would recover it
        if old is not None and not target.exists():  # not published: the old directory goes back to its name
            os.replace(old, target)
            old = None
        shutil.rmtree(tmp, ignore_errors=True)  # the new directory away, under either name (once published:
        shutil.rmtree(new, ignore_errors=True)  # neither name is left)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
