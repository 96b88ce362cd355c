"""Section ``integrity``: what a token store's chunk checksums cost a reading pass.

A store of 20M tokens (4M with ``--quick``; documents of 64..4,096 tokens) is written tokens only (``tokens``)
and with an int8 ``loss_mask`` on every other document (``tokens+loss_mask``), then read document by document
with the page cache warm, for ``ROUNDS`` rounds (medians): ``plain_s``, a reader without checks on a freshly
unpickled store; ``first_s``, the store's reader on a fresh store (hashes every chunk on first touch);
``warm_s`` / ``checked_s``, second passes of each. ``overhead_pct`` / ``steady_pct``: the median over rounds
of ``100 * (first / plain - 1)`` / ``(checked / warm - 1)``, each pair run back to back in alternating order.
Times are process CPU time (every thread). ``verify_gb_s``: ``verify_content`` (what ``precompute`` does).
"""

from __future__ import annotations

import pickle
import statistics
import tempfile
import time
import types
from pathlib import Path

import numpy as np

__all__ = ["COLUMNS", "run"]

COLUMNS: tuple[str, ...] = ("store", "tokens", "chunks", "plain_s", "first_s", "warm_s", "checked_s", "overhead_pct",
                            "steady_pct")
TABLE: tuple[str, ...] = (*COLUMNS, "verify_gb_s")
TITLE = "token store reading pass, chunk checks on first read vs none (page cache warm)"
ROUNDS = 41


def _documents(tokens: int, mask: bool):
    rng = np.random.default_rng(0)
    left, i = tokens, 0
    while left > 0:
        n = min(left, int(rng.integers(64, 4097)))
        doc = {"input_ids": rng.integers(0, 50_000, n, dtype=np.int64)}
        if mask and i % 2:
            doc["loss_mask"] = np.ones(n, dtype=np.int8)
        yield doc
        left, i = left - n, i + 1


def _plain_read(store, i: int) -> dict[str, np.ndarray]:
    """Document ``i`` as the store's reader served it before chunk checks (the reference)."""
    start, stop = int(store._offsets[i]), int(store._offsets[i + 1])
    out = {"input_ids": store._tokens[start:stop].astype(np.int64)}
    for key, (values, present, _) in store._checked_extras.items():
        if present[i]:
            out[key] = np.array(values[start:stop])
    return out


def _pass(store) -> float:
    """Process CPU seconds of one reading pass over ``store``."""
    start = time.process_time()
    for i in range(len(store)):
        store[i]
    return time.process_time() - start


def _row(tokens: int, mask: bool, tmp: Path) -> dict:
    from cpdata.sources.tokenstore import write_token_store

    store = write_token_store(_documents(tokens, mask), tmp / f"store{int(mask)}", vocab_size=50_000)
    blob = pickle.dumps(store)
    _pass(store)  # the page cache warm
    plain, first, warm, checked = [], [], [], []
    for r in range(ROUNDS):  # a fresh unpickled store each (a new worker: new mappings, nothing checked)
        reference = pickle.loads(blob)
        reference._read = types.MethodType(_plain_read, reference)
        fresh = pickle.loads(blob)
        for times, pair in ((plain, first), (warm, checked)):  # first passes, then second passes
            order = ((times, reference), (pair, fresh))  # back to back, in turn first (load drifts alike)
            for out, reader in order[::-1] if r % 2 else order:
                out.append(_pass(reader))
    verify = pickle.loads(blob)
    start = time.process_time()
    verify.verify_content()
    verify_s = time.process_time() - start
    nbytes = sum(e["bytes"] for e in store.manifest["files"].values())
    p, f, w, c = (statistics.median(x) for x in (plain, first, warm, checked))
    over = statistics.median(b / a - 1 for a, b in zip(plain, first, strict=True))
    steady = statistics.median(b / a - 1 for a, b in zip(warm, checked, strict=True))
    return {
        "store": "tokens+loss_mask" if mask else "tokens", "tokens": tokens,
        "chunks": sum(len(e["chunks"]) for e in store.manifest["files"].values()),
        "plain_s": round(p, 4), "first_s": round(f, 4), "warm_s": round(w, 4), "checked_s": round(c, 4),
        "overhead_pct": round(100 * over, 2), "steady_pct": round(100 * steady, 2),
        "verify_gb_s": round(nbytes / verify_s / 1e9, 2),
    }  # fmt: skip


def run(*, quick: bool = False) -> list[dict]:
    tokens = 4_000_000 if quick else 20_000_000
    with tempfile.TemporaryDirectory() as tmp:
        return [_row(tokens, mask, Path(tmp)) for mask in (False, True)]
