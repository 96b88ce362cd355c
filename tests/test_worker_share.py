"""Splitting work between dataloader workers has one home: :class:`cpdata.nodes.served.WorkerShare`.

Its rule is checked for any worker count and run length against the brute-force deal (runs of ``run`` items
dealt round-robin), and a scan of cpdata's source fails if another module computes a worker's share itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from cpdata.nodes.served import WorkerShare

ROOT = Path(__file__).resolve().parents[1] / "cpdata"


@given(st.integers(1, 6), st.integers(1, 5), st.integers(0, 80), st.data())
def test_worker_shares_partition_the_items_as_round_robin_runs(num_workers, run, total, data):
    worker = data.draw(st.integers(0, num_workers - 1))
    share = WorkerShare(worker_id=worker, num_workers=num_workers, run=run)
    expected = [i for i in range(total) if (i // run) % num_workers == worker]  # brute force
    assert [i for i in range(total) if share.owns(i)] == expected
    assert share.count(total) == len(expected)
    walked, item = [], share.first
    while item < total:
        walked.append(item)
        item = share.after(item)
    assert walked == expected
    owners = [sum(WorkerShare(worker_id=w, num_workers=num_workers, run=run).owns(i) for w in range(num_workers))
              for i in range(total)]  # fmt: skip
    assert all(n == 1 for n in owners), "every item belongs to exactly one worker"


def _share_arithmetic(tree: ast.AST) -> list[int]:
    """Lines computing ``x % <workers>`` or ``x % <stride>`` (a worker's share of items)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
            right = node.right
            name = right.attr if isinstance(right, ast.Attribute) else getattr(right, "id", "")
            if "worker" in name or "stride" in name:
                lines.append(node.lineno)
    return lines


def test_no_module_but_served_computes_a_workers_share():
    found = {str(p.relative_to(ROOT.parent)): _share_arithmetic(ast.parse(p.read_text()))
             for p in sorted(ROOT.rglob("*.py"))}  # fmt: skip
    found = {path: lines for path, lines in found.items() if lines}
    assert set(found) == {"cpdata/nodes/served.py"}, found
