"""keep_heap: a worker's freed heap is reused instead of faulted in again, in CPDataLoader workers by default."""

from __future__ import annotations

import json
import os
import pickle
import resource
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from torch.utils.data import IterableDataset

from cpdata.nodes.dataloader import CPDataLoader
from cpdata.nodes.worker_process import _glibc_mallopt, keep_heap, keeping_heap


def _huge_pages_always() -> bool:
    """Whether the kernel backs the heap with 2 MB pages on its own (then a fault maps 512 pages and the
    fault counts below mean something else)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled", encoding="ascii") as f:
            return "[always]" in f.read()
    except OSError:
        return False


glibc = pytest.mark.skipif(_glibc_mallopt() is None, reason="malloc thresholds are glibc's")
counted_faults = pytest.mark.skipif(_huge_pages_always(), reason="transparent huge pages 'always': faults map 2 MB")


def _churn(rounds: int) -> float:
    """Minor page faults per round of a batch-like pattern: three 600 KB blocks written, then freed (the
    heap grows by 1.8 MB, more than glibc's adaptive trim threshold, and shrinks again)."""

    def once() -> None:
        blocks = [np.ones(600_000 // 8) for _ in range(3)]
        del blocks

    for _ in range(3):  # the first rounds move glibc's adaptive thresholds
        once()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(rounds):
        once()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / rounds


def _in_fresh_process(code: str) -> str:
    """stdout of ``code`` run by a new interpreter (this one's malloc settings stay out of it: the tests
    that call :func:`keep_heap` here change them for the rest of the session)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                         cwd=root, check=True)  # fmt: skip
    return out.stdout.strip()


@glibc
@counted_faults
def test_keep_heap_stops_the_heap_from_being_trimmed_and_faulted_in_again():
    without = float(_in_fresh_process("from tests.test_heap import _churn; print(_churn(40))"))
    kept = float(
        _in_fresh_process(
            "from cpdata.nodes.worker_process import keep_heap; from tests.test_heap import _churn; "
            "assert keep_heap(); print(_churn(40))"
        )
    )
    assert without > 100  # 1.8 MB given back and faulted in again every round (~440 pages)
    assert kept < 5, (without, kept)


def test_keep_heap_takes_a_worker_id_and_says_whether_it_applied():
    assert keep_heap(3) is (_glibc_mallopt() is not None)


_CALLED: list[int] = []


def _record(worker_id: int) -> None:
    _CALLED.append(worker_id)


def test_keeping_heap_calls_the_given_worker_init_fn_and_pickles_with_it():
    init = pickle.loads(pickle.dumps(keeping_heap(_record)))  # a spawn worker gets it pickled
    _CALLED.clear()
    init(2)
    assert _CALLED == [2]
    keeping_heap(None)(0)  # no function given: only the heap


class _WorkerFaults(IterableDataset):
    """Yields, from the worker, the faults per round of :func:`_churn` and the ids the init function saw."""

    def __iter__(self):
        yield {"faults": _churn(40), "init_calls": list(_CALLED)}


def _worker_faults(keep: bool) -> dict:
    loader = CPDataLoader(_WorkerFaults(), num_workers=1, multiprocessing_context="fork", keep_heap=keep,
                          worker_init_fn=_record)  # fmt: skip
    (item,) = list(loader)
    return item


@glibc
@counted_faults
def test_cpdataloader_workers_keep_their_heap_unless_told_not_to():
    got = json.loads(
        _in_fresh_process("""
        import json
        from tests.test_heap import _worker_faults
        print(json.dumps({str(keep): _worker_faults(keep) for keep in (True, False)}))
    """)
    )
    for item in got.values():
        assert item["init_calls"] == [0]  # the caller's worker_init_fn still runs (after keep_heap)
    assert got["True"]["faults"] < 5, got
    assert got["False"]["faults"] > 100, got  # forked from a process with glibc's defaults


def test_cpdataloader_refuses_a_keep_heap_that_is_not_a_bool():
    with pytest.raises(TypeError, match=r"keep_heap must be True or False, got str 'yes'"):
        CPDataLoader(_WorkerFaults(), keep_heap="yes")
