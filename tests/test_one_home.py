"""One home per concept: one rows -> PackPlan loop, one epoch counter, one way to set a graph's epoch.

The AST checks read every module of ``cpdata/``; the runtime checks build each
node with epochs and look at what it keeps. Either fails when a second home of
a concept comes back (a node emitting plans from rows itself, a node counting
its own epoch, a caller listing node classes to set epochs).
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
from torchdata.nodes import BaseNode

from cpdata import mix, open_dataset, precompute
from cpdata.nodes.dataloader import CPDataLoader
from cpdata.nodes.dataset import CPDataset
from cpdata.nodes.epochs import EpochClock, EpochNode, graph_nodes, set_graph_epoch
from cpdata.nodes.loader import build_node
from cpdata.nodes.scheduled import ScheduledPacks
from cpdata.nodes.source import Documents
from cpdata.nodes.windowed import WindowedPacks
from cpdata.offline.reader import PrecomputedPacks
from tests.flat_options import graph_options, records

ROOT = Path(__file__).resolve().parents[1] / "cpdata"
CFG = {"capacity": 128, "cp_size": 2, "layout": "thd"}


def _functions_calling(name: str) -> set[tuple[str, str]]:
    """``(module path, enclosing function)`` of every call of ``name(...)`` in ``cpdata/``."""
    found = set()
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for func in ast.walk(tree):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(func):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name:
                    found.add((str(path.relative_to(ROOT)), func.name))
    return found


def test_one_rows_to_packplan_loop():
    # Plans are made in two places: the live packer's emission and the one loop over plan rows.
    assert _functions_calling("PackPlan") == {("nodes/pack.py", "_emit"), ("nodes/served.py", "emit_plan")}
    # A piece is made from plan rows in that loop only (the other site makes pieces from columns on access).
    assert _functions_calling("DocPiece") == {("nodes/served.py", "emit_plan"), ("worker/plan.py", "__getitem__")}


def _epoch_arithmetic() -> list[str]:
    """``file:line`` of every assignment outside epochs.py that moves an epoch on: a target naming an epoch
    given ``+=``, or a value that adds to an epoch (``self._epoch + 1``, also inside a tuple or a conditional)."""
    hits = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.name == "epochs.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.AugAssign):
                targets, counted = [node.target], True
            elif isinstance(node, ast.Assign):
                targets = node.targets
                counted = any(isinstance(v, ast.BinOp) and isinstance(v.op, ast.Add) and "epoch" in ast.unparse(v)
                              for v in ast.walk(node.value))  # fmt: skip
            else:
                continue
            if counted and any("epoch" in ast.unparse(t).lower() for t in targets):
                hits.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return hits


def test_no_epoch_is_counted_outside_the_epoch_clock():
    assert _epoch_arithmetic() == []


def _sources(tmp_path: Path) -> tuple:
    rng = np.random.default_rng(0)
    paths = []
    for name in ("web", "chat"):
        path = tmp_path / f"{name}.jsonl"
        rows = [{"input_ids": rng.integers(1, 500, size=int(rng.integers(4, 90))).tolist()} for _ in range(40)]
        path.write_text("".join(f'{{"input_ids": {r["input_ids"]}}}\n' for r in rows))
        paths.append(path)
    return tuple(paths)


def _epoch_fields(obj: object) -> set[str]:
    return {k for k in vars(obj) if "epoch" in k.lower()}


def test_every_stateful_node_keeps_its_epoch_in_one_clock_and_the_walk_reaches_it(tmp_path):
    web, chat = _sources(tmp_path)
    mixed = mix({"web": open_dataset(web), "chat": open_dataset(chat)}, {"web": 0.5, "chat": 0.5}, seed=1)
    docs = open_dataset(web)
    precompute(docs, tmp_path / "plan", **CFG)
    graphs = {
        "live": build_node(mixed, **records(cp_rank=0, prefetch=0, pin_memory=False, **CFG)),
        "scheduled": build_node(docs, **records(cp_rank=0, prefetch=0, pin_memory=False, schedule="balanced", **CFG)),
        "windowed": build_node(list(docs), **records(cp_rank=0, prefetch=0, pin_memory=False, schedule="balanced",
                                                   schedule_window=16, **CFG)),  # fmt: skip
        "precomputed": PrecomputedPacks(tmp_path / "plan", docs),
    }
    kinds = {name: [type(n) for n in graph_nodes(g) if isinstance(n, EpochNode)] for name, g in graphs.items()}
    assert kinds == {"live": [Documents, type(mixed)], "scheduled": [ScheduledPacks], "windowed": [WindowedPacks],
                     "precomputed": [PrecomputedPacks]}  # fmt: skip
    for name, graph in graphs.items():
        assert set_graph_epoch(graph, 3) == len(kinds[name])
        nodes = [n for n in graph_nodes(graph) if isinstance(n, EpochNode)]
        for node in nodes:  # the one clock, nothing else named for epochs but the setting of how many
            assert _epoch_fields(node) <= {"epoch_clock", "num_epochs"}, (name, _epoch_fields(node))
            assert isinstance(node.epoch_clock, EpochClock)
        for node in graph_nodes(graph):  # no other stage keeps an epoch
            assert isinstance(node, EpochNode) or not _epoch_fields(node), (name, type(node).__name__)
        if name != "precomputed":  # a one-epoch plan holds no epoch 3; the others start it
            graph.reset()
            assert [n.epoch for n in nodes] == [3] * len(nodes), name
    loader = CPDataLoader(CPDataset(docs, cp_rank=0, **CFG), num_workers=0)
    assert _epoch_fields(loader) == {"epoch_clock", "_resume_epoch"}  # its count, and a loaded state's until iter()
    assert isinstance(loader.epoch_clock, EpochClock)


def test_the_epoch_clock():
    clock = EpochClock()
    assert [clock.start(), clock.start()] == [0, 1]
    clock.set(5)
    assert clock.start() == 5 and clock.first == 5
    assert clock.advance(2) and clock.epoch == 6 and not clock.advance(2)
    clock.set(9)
    assert clock.restore(2, 1) == 2 and clock.start() == 3  # a restore drops the pending set_epoch
    for bad in (-1, True, 1.0):
        try:
            clock.set(bad)  # type: ignore[arg-type]
        except ValueError as exc:
            assert repr(bad) in str(exc)
        else:
            raise AssertionError(f"set({bad!r}) was accepted")
    assert not isinstance(EpochClock(), BaseNode)


def test_states_of_the_nodes_before_the_one_serving_node_are_refused_by_version(tmp_path):
    docs = open_dataset(_sources(tmp_path)[0])
    precompute(docs, tmp_path / "plan", **CFG)
    nodes = {
        "ScheduledPacks": (ScheduledPacks(docs, graph_options(schedule="balanced", **CFG)),
                           {"version": 2, "config": {}, "lengths_sha256": "0" * 64, "epoch": 0, "first_epoch": 0,
                            "item": 1}),
        "WindowedPacks": (WindowedPacks(list(docs), graph_options(schedule="balanced", schedule_window=4, **CFG)),
                          {"version": 1, "config": {}, "epoch": 0, "first_epoch": 0, "window": 0, "item": 1}),
        "PrecomputedPacks": (PrecomputedPacks(tmp_path / "plan", docs),
                             {"version": 2, "manifest_sha256": "0" * 64, "dp": [0, 1], "epoch": 0, "pack_index": 1}),
    }  # fmt: skip
    for name, (node, old) in nodes.items():
        node.reset()
        assert next(node).real_tokens > 0  # the node serves; only the old state is refused
        try:
            node.reset(old)
        except ValueError as exc:
            assert f"{name} state has version {old['version']}, this code reads version 3" in str(exc)
        else:
            raise AssertionError(f"{name} restored a state of the old format")
