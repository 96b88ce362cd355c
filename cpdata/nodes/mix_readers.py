"""The parts of :class:`cpdata.nodes.mix.Mix`: its checks, its weighted draws and one reader per source.

Draws come in blocks of :data:`BLOCK`, block ``b`` of epoch ``e`` from ``default_rng([seed, e, b, TAG])``,
so any draw is a pure function of ``(seed, epoch, j)`` and a resume needs only ``j``. A reader
(:class:`MixSource`) walks one source pass after pass: a sequence by index (another rank's items not
read), a stream read and dropped, a node resumed from its own state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from cpdata.nodes.source_kinds import SourceReader
from cpdata.sources.open import as_source
from cpdata.sources.protocol import declared_labels
from cpdata.worker.targets import check_labels_alignment

__all__ = ["BLOCK", "Draws", "MixSource", "check_weights", "declared_alignment", "document_tokens"]

BLOCK = 4096
"""Draws generated at once (one ``rng.random(BLOCK)`` call)."""
_TAG = 0x313C  # separates the mix's random stream from the shuffles'


def check_weights(sources: Mapping[str, Any], weights: Mapping[str, Any]) -> dict[str, float]:
    """``weights`` as floats in sorted name order; ``TypeError``/``ValueError`` naming the key or value and the fix."""
    if not isinstance(sources, Mapping) or not sources:
        raise TypeError(f"sources must be a non-empty dict name -> source, got {type(sources).__name__} {sources!r}"[:300])
    if not isinstance(weights, Mapping):
        raise TypeError(f"weights must be a dict name -> weight with the keys of sources, got {type(weights).__name__}")
    for name in sources:
        if not isinstance(name, str) or not name:
            raise TypeError(f"mix source names must be non-empty strings, got {name!r}")
    missing, extra = sorted(set(sources) - set(weights)), sorted(set(weights) - set(sources), key=str)
    if missing or extra:
        raise ValueError(
            f"weights must have exactly the keys of sources {sorted(sources)}: missing {missing}, unknown {extra}; "
            "give every source one weight"
        )
    out = {}
    for name in sorted(sources):
        w = weights[name]
        if isinstance(w, bool) or not isinstance(w, (int, float, np.integer, np.floating)):
            raise TypeError(f"weights[{name!r}] must be a number, got {type(w).__name__} {w!r}")
        if not math.isfinite(w) or w <= 0:
            raise ValueError(
                f"weights[{name!r}]={w!r} must be finite and > 0 (weights are relative: {{'a': 3, 'b': 1}} draws "
                "a three times as often as b); leave a source out of the mix rather than giving it weight 0"
            )
        out[name] = float(w)
    return out


def declared_alignment(readers: Mapping[str, MixSource]) -> str | None:
    """The labels_alignment every source declares, or None when some declare none; conflicting ones are refused."""
    declared = {n: check_labels_alignment(declared_labels(r.source)) for n, r in readers.items()}
    values = set(declared.values())
    if len(values - {None}) > 1:
        raise ValueError(
            f"mix sources declare different labels_alignment values {declared}; one pipeline reads every label "
            "under one convention: convert one source's labels (shift them) before mixing"
        )
    return values.pop() if len(values) == 1 else None


class Draws:
    """Source index of draw ``j`` of an epoch, over float64 ``[k]`` ``weights`` (module docstring)."""

    def __init__(self, weights: np.ndarray, seed: int) -> None:
        cum = np.cumsum(np.asarray(weights, dtype=np.float64))
        self._cum, self._seed = cum / cum[-1], int(seed)
        self._block: tuple[int, int, np.ndarray] | None = None  # (epoch, block, choices)
        self._prefix: tuple[int, np.ndarray] = (-1, np.zeros((1, cum.shape[0]), dtype=np.int64))
        self._ranks: dict[tuple[int, int], np.ndarray] = {}  # (epoch, block): [2, BLOCK] source, count in it

    def block(self, epoch: int, b: int) -> np.ndarray:
        """int64 ``[BLOCK]``: the sources of draws ``b * BLOCK`` to ``(b + 1) * BLOCK - 1`` of ``epoch``."""
        u = np.random.default_rng([self._seed, epoch, b, _TAG]).random(BLOCK)
        return np.minimum(np.searchsorted(self._cum, u, side="right"), self._cum.shape[0] - 1)

    def __call__(self, epoch: int, j: int) -> int:
        b = j // BLOCK
        if self._block is None or self._block[:2] != (epoch, b):
            self._block = (epoch, b, self.block(epoch, b))
        return int(self._block[2][j % BLOCK])

    def locate_many(self, epoch: int, js: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(k int64 [n], c int64 [n])``: draw ``js[i]`` picks source ``k[i]``, whose ``c[i]``-th draw it is
        (0-based, over passes). Keeps each source's draw counts at every block start of ``epoch`` and the
        last few blocks' per-draw counts, so a batch's documents cost a few numpy calls."""
        js = np.asarray(js, dtype=np.int64)
        if not js.size:
            return js.copy(), js.copy()
        blocks, within = np.divmod(js, BLOCK)
        if self._prefix[0] != epoch:
            self._prefix, self._ranks = (epoch, self._prefix[1][:1] * 0), {}
        prefix, n_sources = self._prefix[1], self._cum.shape[0]
        top = int(blocks.max()) + 1
        if prefix.shape[0] <= top:
            more = [np.bincount(self.block(epoch, b), minlength=n_sources) for b in range(prefix.shape[0] - 1, top)]
            prefix = np.concatenate([prefix, prefix[-1] + np.cumsum(more, axis=0)])
            self._prefix = (epoch, prefix)
        first, last = int(blocks.min()), top - 1
        if first == last:  # a batch's documents, drawn in one block: one gather
            kc = self._block_ranks(epoch, first)[:, within]
            return kc[0], prefix[first, kc[0]] + kc[1]
        k, c = np.empty_like(js), np.empty_like(js)
        for b in np.unique(blocks).tolist():
            here = blocks == b
            kc = self._block_ranks(epoch, b)[:, within[here]]
            k[here] = kc[0]
            c[here] = prefix[b, kc[0]] + kc[1]
        return k, c

    def _block_ranks(self, epoch: int, b: int) -> np.ndarray:
        """int64 ``[2, BLOCK]``: block ``b``'s sources, and each draw's count in its source within the block."""
        cached = self._ranks.get((epoch, b))
        if cached is None:
            choices, ranks = self.block(epoch, b), np.empty(BLOCK, dtype=np.int64)
            for source in range(self._cum.shape[0]):
                at = np.flatnonzero(choices == source)
                ranks[at] = np.arange(at.shape[0])
            if len(self._ranks) >= 8:
                self._ranks.pop(next(iter(self._ranks)))
            cached = self._ranks[(epoch, b)] = np.stack([choices, ranks])
        return cached


def document_tokens(item: Any) -> int:
    """Tokens of a source item (``len(input_ids)``), 0 for anything malformed (``Documents`` refuses it later)."""
    ids = item.get("input_ids") if isinstance(item, Mapping) else None
    try:
        return int(len(ids)) if ids is not None else 0
    except TypeError:
        return 0


class MixSource(SourceReader):
    """One named source of a mix, read in its own order, restarted for every pass; an empty sequence is refused."""

    POSITION_KEY = "position"
    PASSES_KEY = "passes"
    SOURCE_KEY = "source"
    SIZE_KEY = "size"

    def __init__(self, name: str, source: Any) -> None:
        try:
            super().__init__(as_source(source), f"of mix source {name!r}")
        except TypeError as exc:
            raise TypeError(f"mix source {name!r}: {exc}") from None
        self.name = name
        if self.kind == "sequence" and len(self.source) == 0:
            raise ValueError(f"mix source {name!r} is empty (0 documents); leave it out of the mix")
        self.position = 0
        self.passes = 0
        self.size: int | None = len(self.source) if self.kind == "sequence" else None  # None: a stream not run out

    def restart(self, state: Mapping[str, Any] | None = None) -> None:
        """Start pass 0 (``state=None``) or continue where ``state`` (from :meth:`state`) left off."""
        self.position = 0 if state is None else int(state[self.POSITION_KEY])
        self.passes = 0 if state is None else int(state[self.PASSES_KEY])
        if state is not None and state.get(self.SIZE_KEY) is not None:
            self.size = int(state[self.SIZE_KEY])
        self.open(self.position, None if state is None else state.get(self.SOURCE_KEY))

    def new_pass(self) -> None:
        """The source ran out: start reading it again from its beginning."""
        if self.size is None:
            self.size = self.position
        self.passes += 1
        self.position = 0
        self.open()

    def take(self, read: bool) -> tuple[int, Any]:
        """``(index in this pass, item)``; ``item`` is None for an unread sequence item. StopIteration at the end."""
        index = self.position
        if self.kind == "sequence" and not read:
            if index >= len(self.source):
                raise StopIteration
            item = None
        else:
            item = self.next(index)
        self.position = index + 1
        return index, item

    def state(self) -> dict[str, Any]:
        out: dict[str, Any] = {self.POSITION_KEY: self.position, self.PASSES_KEY: self.passes}
        if self.kind == "node":
            out[self.SOURCE_KEY] = self.node_state()
        if self.kind != "sequence" and self.size is not None:
            out[self.SIZE_KEY] = self.size  # a stream's documents per pass, known once it ran out
        return out
