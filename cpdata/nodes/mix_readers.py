"""The parts of :class:`cpdata.nodes.mix.Mix`: its checks, its weighted draws and one reader per source.

Draws come in blocks of :data:`BLOCK`, block ``b`` of epoch ``e`` from ``default_rng([seed, e, b, TAG])``,
so any draw is a pure function of ``(seed, epoch, j)`` and a resume needs only ``j``. A reader
(:class:`MixSource`) walks one source pass after pass: a sequence by index (another rank's items not
read), a stream read and dropped, a node resumed from its own state.

By tokens (``cpdata.mix(..., by="tokens")``), every draw reads from the source furthest behind its token
share: the smallest ``tokens_k / w_k``, ties broken by a seeded order drawn again each epoch
(:class:`TokenClock`). Source ``k``'s document ``c`` occupies ``[before_c / w_k, (before_c + len_c) / w_k)``
on that clock and the mix yields documents in the order their intervals start, so after any draw every
source is within one document of ``w_k * total`` tokens, exactly, at every prefix (Megatron
``BlendedDataset``'s rule over variable-length documents). Every rank needs the length of every draw: a
sequence's stated ``lengths``, else the item's ``input_ids``. :func:`token_draw_order` lists an epoch
vectorized, tested equal to the node's stream.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from cpdata.errors import check_number
from cpdata.nodes.source_kinds import SourceReader
from cpdata.sources.open import as_source
from cpdata.sources.protocol import carried_targets, declared_labels
from cpdata.worker.targets import agreed_alignment

__all__ = ["BLOCK", "BY", "Draws", "MixSource", "TokenClock", "check_weights", "document_tokens", "mix_alignment",
           "tie_ranks", "token_draw_order"]  # fmt: skip

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
    fix = (" (weights are relative: {'a': 3, 'b': 1} draws a three times as often as b); leave a source out of "
           "the mix rather than giving it weight 0")
    return {name: check_number(f"weights[{name!r}]", weights[name], fix=fix) for name in sorted(sources)}


def mix_alignment(readers: Mapping[str, MixSource]) -> str | None:
    """The labels_alignment the sources declare (:func:`cpdata.worker.targets.agreed_alignment`); a source
    known to carry no labels or masks takes the others', any other undeclared source is refused beside declared
    ones."""
    named = []
    for name, reader in readers.items():
        carried = carried_targets(reader.source)  # None: only reading would tell, so it may carry labels
        may_carry = carried is None or bool(carried)
        named.append((f"mix source {name!r}", declared_labels(reader.source), may_carry))
    return agreed_alignment("mix", named, "convert one source's labels (shift them by one token) or declare "
                            "them (a token store written with write_token_store(..., labels_alignment=...)) "
                            "before mixing")  # fmt: skip


class Draws:
    """Source index of draw ``j`` of an epoch, over float64 ``[k]`` ``weights`` (module docstring)."""

    def __init__(self, weights: np.ndarray, seed: int) -> None:
        cum = np.cumsum(np.asarray(weights, dtype=np.float64))
        self._cum, self._seed = cum / cum[-1], int(seed)
        self._prefix: tuple[int, np.ndarray] = (-1, np.zeros((1, cum.shape[0]), dtype=np.int64))
        self._ranks: dict[tuple[int, int], np.ndarray] = {}  # (epoch, block): [2, BLOCK] source, count in it

    def block(self, epoch: int, b: int) -> np.ndarray:
        """int64 ``[BLOCK]``: the sources of draws ``b * BLOCK`` to ``(b + 1) * BLOCK - 1`` of ``epoch``."""
        u = np.random.default_rng([self._seed, epoch, b, _TAG]).random(BLOCK)
        return np.minimum(np.searchsorted(self._cum, u, side="right"), self._cum.shape[0] - 1)

    def __call__(self, epoch: int, j: int) -> int:
        return int(self.block_ranks(epoch, j // BLOCK)[0, j % BLOCK])

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
            kc = self.block_ranks(epoch, first)[:, within]
            return kc[0], prefix[first, kc[0]] + kc[1]
        k, c = np.empty_like(js), np.empty_like(js)
        for b in np.unique(blocks).tolist():
            here = blocks == b
            kc = self.block_ranks(epoch, b)[:, within[here]]
            k[here] = kc[0]
            c[here] = prefix[b, kc[0]] + kc[1]
        return k, c

    def block_ranks(self, epoch: int, b: int) -> np.ndarray:
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


BY: tuple[str, ...] = ("documents", "tokens")
_TIE_TAG = 0x70C5  # separates the tie order's random stream from the document draws'


def tie_ranks(seed: int, epoch: int, k: int) -> np.ndarray:
    """int64 ``[k]``: source ``s`` wins a tie against ``t`` in ``epoch`` when ``ranks[s] < ranks[t]``."""
    order = np.random.default_rng([seed, epoch, _TIE_TAG]).permutation(k)
    ranks = np.empty(k, dtype=np.int64)
    ranks[order] = np.arange(k)
    return ranks


class TokenClock:
    """The source of the next token-weighted draw over float64 ``[k]`` ``weights`` (module docstring)."""

    def __init__(self, weights: np.ndarray, seed: int) -> None:
        w = np.asarray(weights, dtype=np.float64)
        self.weights = w / w.sum()
        self._w = self.weights.tolist()
        self._seed = int(seed)
        self.tokens = [0] * w.shape[0]  # each source's this epoch, over every DP rank
        self._ranks: list[int] = []

    def start(self, epoch: int, tokens: Sequence[int] | None = None) -> None:
        """Begin ``epoch`` at zero tokens, or at ``tokens`` (a restored state)."""
        self.tokens = [0] * len(self._w) if tokens is None else [int(t) for t in tokens]
        self._ranks = tie_ranks(self._seed, epoch, len(self._w)).tolist()

    def pick(self) -> int:
        """The source furthest behind its share (smallest ``tokens / weight``; ties by this epoch's ranks)."""
        return min(range(len(self._w)), key=lambda s: (self.tokens[s] / self._w[s], self._ranks[s]))


def token_draw_order(weights: np.ndarray, ranks: np.ndarray, lengths: Sequence[np.ndarray],
                     stop: str) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """``(source_id int32 [n], index int64 [n])`` of one epoch of a token-weighted mix, vectorized.

    Source ``k``'s draw ``c`` (0-based, over passes) has the key ``(p * T_k + before_k[r]) / w_k`` with
    ``p, r = divmod(c, N_k)``; the node yields draws in ``(key, ranks[k], c)`` order (each source's keys
    never decrease, so the greedy pick is this merge). ``weights``: normalized; ``ranks``: :func:`tie_ranks`.
    """
    totals = [int(x.sum()) for x in lengths]
    run_out = sorted((totals[k] / weights[k], int(ranks[k]), k) for k in range(len(lengths)))
    end_key, end_rank, end = run_out[0] if stop == "first_exhausted" else run_out[-1]
    keys, rank_col, c_col, ids, index = [], [], [], [], []
    for k, arr in enumerate(lengths):
        n = arr.shape[0]
        before = np.concatenate([[0], np.cumsum(arr)[:-1]]).astype(np.int64)
        passes = 1 if stop == "first_exhausted" else int(end_key * weights[k] // totals[k]) + 2
        c = np.arange(passes * n, dtype=np.int64)
        key = (c // n * totals[k] + before[c % n]) / weights[k]
        keep = (key < end_key) | ((key == end_key) & ((ranks[k] < end_rank) | ((k == end) & (c < n))))
        keys.append(key[keep])
        c_col.append(c[keep])
        rank_col.append(np.full(int(keep.sum()), ranks[k], dtype=np.int64))
        ids.append(np.full(int(keep.sum()), k, dtype=np.int32))
        index.append(c[keep] % n)
    order = np.lexsort((np.concatenate(c_col), np.concatenate(rank_col), np.concatenate(keys)))
    return np.concatenate(ids)[order], np.concatenate(index)[order].astype(np.int64)
