"""Run benchmark sections, print their tables, collect one JSON-ready results dict.

A section module has ``COLUMNS`` (keys every row carries), ``TABLE`` (the columns printed) and ``run(*, quick)
-> list[dict]``; rows are checked for those keys and finite numbers. With ``runs > 1`` each section runs that
many times and its rows are the row-wise medians (:func:`median_rows`), so one burst on a shared machine does
not decide a target.
"""

from __future__ import annotations

import importlib
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from cpdata.bench.corpus import Corpus
from cpdata.bench.table import format_table
from cpdata.bench.targets import evaluate_targets
from cpdata.bench.timing import describe_machine
from cpdata.errors import check_int, is_int
from cpdata.layout.world_cost import WorldCost
from cpdata.nodes.worker_process import keep_heap
from cpdata.packing import DEFAULT_ALGORITHM

__all__ = ["SECTIONS", "check_corpus", "check_rows", "median_rows", "parse_sections", "run_bench", "write_json"]

SECTIONS: dict[str, str] = {
    "step_shard": "cpdata.bench.step_shard",
    "worker": "cpdata.bench.worker_throughput",
    "handoff": "cpdata.bench.handoff",
    "packing": "cpdata.bench.packing_quality",
    "balance": "cpdata.bench.balance",
    "gather": "cpdata.bench.gather_collectives",
    "long_document": "cpdata.bench.long_document",
    "schedule": "cpdata.bench.schedule_balance",
    "attention": "cpdata.bench.attention",
    "world": "cpdata.bench.world",
    "integrity": "cpdata.bench.integrity",
}
"""Section name -> module, in run order."""

RESULTS_VERSION = 1


def parse_sections(text: str | None) -> list[str]:
    """``"a,b"`` -> ``["a", "b"]`` in run order; None or empty = every section."""
    if not text:
        return list(SECTIONS)
    wanted = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in SECTIONS]
    if unknown:
        raise ValueError(f"unknown bench sections {unknown}; choose from {list(SECTIONS)} (comma-separated)")
    return [s for s in SECTIONS if s in wanted]


def check_corpus(sections: Sequence[str] | None, corpus: Corpus | None) -> None:
    """A corpus is measured by the ``world`` section alone: ``ValueError`` where it would run without it."""
    if corpus is not None and sections is not None and "world" not in sections:
        raise ValueError(f"a corpus ({corpus.source}) is measured by the world section alone, and the sections to "
                         f"run are {list(sections)}; add world (--sections world)")  # fmt: skip


def check_rows(section: str, rows: Sequence[dict], required: Sequence[str]) -> None:
    """Every row has the required keys and only finite numbers."""
    assert rows, f"section {section!r} produced no rows"
    for row in rows:
        missing = [k for k in required if k not in row]
        assert not missing, f"section {section!r}: row {row} lacks {missing}"
        bad = [k for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)]
        assert not bad, f"section {section!r}: non-finite {bad} in row {row}"


def median_rows(section: str, runs: Sequence[Sequence[dict]]) -> list[dict]:
    """Row ``i`` is the median of every run's row ``i``: floats the median, ints the lower median, anything
    else must be equal in every run. Derived columns are medians too (a ratio column is the median of the
    ratios)."""
    first = runs[0]
    assert all(len(rows) == len(first) for rows in runs), f"section {section!r}: runs differ in their rows"
    merged = []
    for i, row in enumerate(first):
        out = {}
        for key, value in row.items():
            values = [rows[i][key] for rows in runs]
            if isinstance(value, float):
                out[key] = statistics.median(values)
            elif is_int(value):
                out[key] = statistics.median_low(values)
            else:
                assert all(v == value for v in values), f"section {section!r}, row {i}: {key} differs: {values}"
                out[key] = value
        merged.append(out)
    return merged


def run_bench(sections: Sequence[str] | None = None, *, quick: bool = False, runs: int = 1,
              cost: WorldCost | None = None, seed: int = 1, corpus: Corpus | None = None,
              log: Callable[[str], None] = print) -> dict[str, Any]:  # fmt: skip
    """Run ``sections`` (default: all), each ``runs`` times, and return the results dict (tables go to
    ``log``). ``cost``: a calibration (:meth:`~cpdata.layout.world_cost.WorldCost.from_json`), passed to the
    sections whose ``OPTIONS`` name it (``world``); None: the published defaults. ``seed``: the lengths the
    ``world`` section draws (its ``OPTIONS``; the others keep their own). ``corpus``: a user's document lengths
    (:func:`~cpdata.bench.corpus.read_corpus`) the ``world`` section measures instead of its distributions.

    The process first keeps its freed heap (:func:`cpdata.keep_heap`), as ``CPDataLoader``'s
    workers do, for every section; ``machine["keep_heap"]`` says whether it applied (glibc only).
    """
    check_int("runs", runs, min=1, fix="; use 1 for a single run, 3 for medians of three")
    check_int("seed", seed, min=0)
    check_corpus(sections, corpus)
    options: dict[str, Any] = {"seed": seed, **({} if cost is None else {"cost": cost}),
                               **({} if corpus is None else {"corpus": corpus})}  # fmt: skip
    machine = {**describe_machine(), "keep_heap": keep_heap()}
    results: dict[str, Any] = {
        "version": RESULTS_VERSION,
        "quick": quick,
        "runs": runs,
        "machine": machine,
        "default_algorithm": DEFAULT_ALGORITHM,
        "calibration": None if cost is None else cost.source,
        "seed": seed,
        "corpus": None if corpus is None else corpus.describe(),
        "sections": list(sections or SECTIONS),
        "seconds": {},
        "methods": {},
    }
    log(f"cpdata bench ({'quick' if quick else 'full'}) on {machine['cpu_model']}, {machine['cores']} cores, "
        f"torch {machine['torch_version']}, device {machine['device']} ({machine['device_name']})")
    for name in results["sections"]:
        module = importlib.import_module(SECTIONS[name])
        t0 = time.perf_counter()
        passes = []
        for _ in range(runs):
            given = {k: v for k, v in options.items() if k in getattr(module, "OPTIONS", ())}
            passes.append(module.run(quick=quick, **given))
            check_rows(name, passes[-1], module.COLUMNS)
        rows = passes[0] if runs == 1 else median_rows(name, passes)  # (medians of checked rows: checked)
        results["seconds"][name] = round(time.perf_counter() - t0, 2)
        results[name] = rows
        results["methods"][name] = " ".join((module.__doc__ or "").split())
        log(f"\n== {name}: {getattr(module, 'TITLE', name)} [device: {machine['device']}]")
        log(format_table(rows, getattr(module, "TABLE", module.COLUMNS)))
        log(f"({results['seconds'][name]} s)")
    results["targets"] = evaluate_targets(results)
    log("\n== targets")
    log(format_table(results["targets"], ("target", "rule", "measured", "met")))
    return results


def write_json(results: dict[str, Any], path: str | Path) -> None:
    """Write ``results`` as JSON (no NaN or infinity allowed)."""
    Path(path).write_text(json.dumps(results, indent=1, allow_nan=False) + "\n", encoding="utf-8")
