"""``Pack``: documents in, :class:`~cpdata.worker.plan.PackPlan` out (stateful, exact resume).

The node reads a window of documents at a time (the rule of :func:`~cpdata.packing.planner.window_ends`),
plans it with the :class:`~cpdata.packing.StreamPlanner` of the offline
:func:`~cpdata.packing.plan_lengths` (same lengths, same packs), cuts the documents into pieces and emits
the finished packs one by one.

State: a snapshot taken before the last window was read (the source's state, the planner's, the carried
pieces) plus the packs emitted since; a restore rewinds the source, re-plans that window and skips what
was emitted, bit-identical to an uninterrupted run. Every ``state_dict()`` gets its own copy
(:mod:`cpdata.nodes.state_copy`). Size: the carried pieces, up to the largest window's slot tokens for
``bfd`` (~12 MB on chat data at window 1024); over a sequence (``source.seekable``) only six int64 per
piece, the tokens fetched again on restore. ``ffd`` with ``window=None`` reads the whole source first.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from cpdata.nodes.live_pieces import (
    CARRY_COLUMNS,
    FIELDS,
    LivePieces,
    carried_room,
    carry_state,
    piece_sources,
    window_buffer,
    window_rows,
)
from cpdata.nodes.source import Documents
from cpdata.nodes.source_kinds import name_mixed_overlong
from cpdata.nodes.state_copy import fresh_state, portable_state, stats_dict
from cpdata.nodes.state_version import VersionedState
from cpdata.nodes.window import DocumentWindow, WindowFill
from cpdata.packing import PackingConfig, PackingStats, StreamPlanner
from cpdata.packing.pieces import OverlongDocumentError, check_lengths
from cpdata.packing.records import DEFAULT_ALGORITHM, PackKeys
from cpdata.sources.protocol import stated_lengths
from cpdata.worker.keys import IGNORE_INDEX, INPUT_IDS
from cpdata.worker.plan import Document, PackPlan, PieceColumns
from cpdata.worker.targets import piece_arrays
from cpdata.worker.token_buffer import BufferPool, TokenBuffer

__all__ = ["Pack"]

def _read_window(
    source: BaseNode, limit: int | None, floor: int, capacity: int, room: int
) -> tuple[DocumentWindow, bool]:
    """One window of documents and whether the source ended: ``Documents.next_window``, else ``next()``
    one document at a time."""
    if isinstance(source, Documents):
        return source.next_window(limit, floor, capacity, room)
    fill = WindowFill(limit, floor, capacity)
    while fill.wants():
        try:
            doc = next(source)
        except StopIteration:
            return DocumentWindow.of(fill.items), True
        if not isinstance(doc, Document):
            raise TypeError(
                f"Pack expects cpdata.worker.plan.Document items, got {type(doc).__name__}; "
                "wrap the source in cpdata.nodes.source.Documents(...)"
            )
        fill.add(doc, doc.index, doc.arrays[INPUT_IDS])
    return DocumentWindow.of(fill.items), False


# A finished pack: piece table [n, 4], sources [n], offsets [n], slot lengths [n], real and slot tokens, and the
# window's token buffer with each piece's index in it [n] (None when a piece is not in it).
_Finished = tuple[np.ndarray, tuple, np.ndarray, np.ndarray, int, int, TokenBuffer | None, np.ndarray | None,
                  np.ndarray | None]


def _finished(rows: np.ndarray, sources: tuple, sizes: np.ndarray, buffer: TokenBuffer,
              owners: np.ndarray | None = None) -> list[_Finished]:  # fmt: skip
    """Every pack a window finished, from their :class:`LivePieces` rows ``[p, 8]`` (``sizes`` ``[packs]``
    pieces each) and their owners (int64 ``[p, 2]``, a world step's; None: the layout deals each pack): numpy
    for the whole window, then one slice per pack and column (made read-only once)."""
    table = np.ascontiguousarray(rows[:, 1:5])
    offsets, slots, at = rows[:, 6].copy(), rows[:, 5].copy(), rows[:, 7].copy()
    table.flags.writeable = offsets.flags.writeable = False
    bounds = np.zeros(sizes.shape[0] + 1, dtype=np.int64)
    np.cumsum(sizes, out=bounds[1:])
    sums = np.zeros((rows.shape[0] + 1, 3), dtype=np.int64)  # running (real, slot) tokens, pieces out of the buffer
    np.cumsum(rows[:, [3, 5]], axis=0, out=sums[1:, :2])
    np.cumsum(at < 0, out=sums[1:, 2])
    tokens, slot_tokens, outside = (sums[bounds[1:]] - sums[bounds[:-1]]).T.tolist()
    b = bounds.tolist()
    if owners is not None:
        owners = owners.copy()
        owners.flags.writeable = False
    return [(table[lo:hi], sources[lo:hi], offsets[lo:hi], slots[lo:hi], n, slot_n,
             *((buffer, at[lo:hi]) if hi > lo and not out else (None, None)), None if owners is None else owners[lo:hi])
            for lo, hi, n, slot_n, out in zip(b[:-1], b[1:], tokens, slot_tokens, outside, strict=True)]  # fmt: skip


@dataclasses.dataclass(frozen=True, slots=True)
class _Snapshot:
    source: dict[str, Any]
    planner: dict[str, Any]
    carried: tuple[np.ndarray, Sequence[Any]]  # LivePieces.live() when the snapshot was taken


class Pack(VersionedState, BaseNode[PackPlan]):
    """Pack the :class:`~cpdata.worker.plan.Document` s of ``source_node`` into plans of ``capacity`` tokens
    (the other arguments as for :func:`~cpdata.packing.plan_lengths`). ``stats``: a
    :class:`~cpdata.packing.PackingStats` snapshot, in the state too; a state saved under another
    configuration is refused with ``ValueError``."""

    VERSION = 2  # 2: windows of at least WINDOW_PACKS packs of tokens, carried bins kept whole
    PLANNER_KEY = "planner"
    CARRY_KEY = "carry"
    EMITTED_KEY = "emitted"
    STATS_KEY = "stats"

    def __init__(
        self,
        source_node: BaseNode[Document],
        *,
        capacity: int,
        layout: str,
        cp_size: int,
        algorithm: str = DEFAULT_ALGORITHM,
        overflow: str | None = None,
        seed: int = 0,
        window: int | None = None,
        world_step: int = 1,
    ) -> None:
        super().__init__()
        if not isinstance(source_node, BaseNode):
            raise TypeError(
                f"source_node must be a torchdata BaseNode of Documents, got {type(source_node).__name__}; "
                "wrap your data in cpdata.nodes.source.Documents(...)"
            )
        self.config = PackingConfig.resolve(
            capacity=capacity, layout=layout, cp_size=cp_size, algorithm=algorithm,
            overflow=overflow, seed=seed, window=window, world_step=world_step,
        )
        self.source = source_node
        self._seekable = isinstance(source_node, Documents) and source_node.seekable
        known = stated_lengths(source_node.source) if self._seekable else None
        if known is not None:
            check_lengths(known, self.config)  # overflow="error": every overlong document, before training starts
        self._queue: deque[_Finished] = deque()  # every finished pack, not yet emitted
        self._snapshot: _Snapshot | None = None
        self._pool = BufferPool()  # token buffers of windows read from sources that do not make them
        self._clear()

    def _clear(self) -> None:
        self._planner = StreamPlanner(self.config)
        self._queue.clear()
        self._live = LivePieces()
        self._exhausted = False
        self._emitted = 0
        self._carry_records: dict[str, Any] | None = None
        self._snapshot_now = False  # the snapshot is of the state now: reset() took it, no window read since

    @property
    def stats(self) -> PackingStats:
        return dataclasses.replace(self._planner.stats(), **self._stats_fields())

    def _stats_fields(self) -> dict[str, Any]:
        """The fields of :attr:`stats` that come from the source."""
        documents = self.source if isinstance(self.source, Documents) else None
        return {"epoch": documents.epoch if documents else 0, "sources": documents.source_counts if documents else None}

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._clear()
        if initial_state is None:
            self.source.reset(None)
            self._snapshot, self._snapshot_now = self._take_snapshot(), True
            return
        self._check(initial_state)
        self.source.reset(initial_state[self.SOURCE_KEY])
        self._planner.load_state(initial_state[self.PLANNER_KEY])
        self._restore_carry(initial_state[self.CARRY_KEY])
        self._snapshot = self._take_snapshot(source_state=initial_state[self.SOURCE_KEY])
        emitted = int(initial_state[self.EMITTED_KEY])
        if emitted:
            self._refill(take_snapshot=False)
            for _ in range(emitted):
                self._emit(self._queue.popleft())
            saved = initial_state.get(self.STATS_KEY)
            if saved is not None and saved != dataclasses.asdict(self.stats):
                raise ValueError(
                    "replaying the saved window did not reproduce the saved packer stats "
                    f"({saved} != {dataclasses.asdict(self.stats)}); the source changed since the state was saved"
                )

    def _check(self, state: dict[str, Any]) -> None:
        self.check_saved(state)
        saved_config = state[self.CONFIG_KEY]
        for name, mine in self.config.identity().items():
            if saved_config.get(name) != mine:
                raise ValueError(
                    f"cannot restore a Pack state saved with {name}={saved_config.get(name)!r} into a Pack with "
                    f"{name}={mine!r}; build the node with the configuration the state was saved with"
                )

    def _restore_carry(self, carry: dict[str, Any]) -> None:
        columns = {name: np.asarray(carry[name]).tolist() for name in CARRY_COLUMNS}
        stored = carry["arrays"]
        if stored is None and not self._seekable:
            raise ValueError(
                "the Pack state holds references to source documents, but this source cannot fetch them "
                "by index; restore onto a Documents node over the same sequence"
            )
        if stored is not None:
            sources = piece_sources(stored, columns["length"])
        else:
            fetched: dict[int, Document] = {}
            sources = []
            for index, start, length, next_label in zip(columns["index"], columns["start"], columns["length"],
                                                        columns["next_label"], strict=True):  # fmt: skip
                doc = fetched.get(index)
                if doc is None:
                    doc = fetched[index] = self.source.fetch(index)
                if start + length > doc.length:
                    raise ValueError(
                        f"the Pack state carries tokens {start}..{start + length} of document {index}, which now "
                        f"has {doc.length}; the source changed since the state was saved"
                    )
                sources.append(piece_arrays(doc.arrays, start, length, next_label != IGNORE_INDEX))
        rows = np.zeros((len(sources), len(FIELDS)), dtype=np.int64)  # offset 0: the arrays are the pieces'
        rows[:, 7] = -1  # in no window's token buffer
        for i, name in enumerate(CARRY_COLUMNS):
            rows[:, i] = columns[name]
        self._live.add(rows, sources)

    def _take_snapshot(self, source_state: dict[str, Any] | None = None) -> _Snapshot:
        carried = self._live.live()
        source = self.source.state_dict() if source_state is None else source_state
        return _Snapshot(source=fresh_state(source), planner=self._planner.state(), carried=carried)

    def _refill(self, take_snapshot: bool = True) -> None:
        if take_snapshot and not self._snapshot_now:  # (not taken twice: the first window after a reset)
            self._snapshot = self._take_snapshot()
            self._carry_records = None
            self._emitted = 0
        self._snapshot_now = False
        config = self.config
        room = carried_room(self._live.live()[0])  # the carried pieces may join this window's buffer
        window, self._exhausted = _read_window(self.source, config.window, config.window_tokens, config.capacity,
                                               room)  # fmt: skip
        try:
            pieces, keys, packs = self._planner.add_window(window.lengths, window.indices, window.firsts)
        except OverlongDocumentError as exc:
            name_mixed_overlong(exc, self.source)
            raise
        self._live.add(*window_rows(window.arrays, window.lengths, window.indices, window.firsts, pieces, keys))
        if self._exhausted:
            packs = PackKeys.concat([packs, self._planner.finish()])
        rows, sources = self._live.take(packs.keys)
        buffer = window_buffer(window, rows, sources, self._pool)
        self._queue.extend(_finished(rows, sources, packs.sizes, buffer, packs.owners))

    def _emit(self, pack: _Finished) -> PackPlan:
        table, sources, offsets, slots, tokens, slot_tokens, buffer, at, owners = pack
        pieces = PieceColumns(table, sources, offsets, buffer, at)
        plan = PackPlan(pieces=pieces, slot_lens=slots, capacity=self.config.capacity, index=self._planner.packs,
                        owners=owners)  # fmt: skip
        self._planner.account(packs=1, tokens=tokens, slot_tokens=slot_tokens)
        self._emitted += 1
        return plan

    def next(self) -> PackPlan:
        while not self._queue:
            if self._exhausted:
                raise StopIteration
            self._refill()
        return self._emit(self._queue.popleft())

    def get_state(self) -> dict[str, Any]:
        snap = self._snapshot
        assert snap is not None, "reset() runs before get_state()"
        if self._carry_records is None:  # serialised once per window; arrays are read-only
            self._carry_records = carry_state(snap.carried, not self._seekable)
        return {
            **self.state_header(self.config.identity()),
            self.SOURCE_KEY: fresh_state(snap.source),  # the snapshot is the node's: every caller gets a copy
            self.PLANNER_KEY: portable_state(snap.planner),  # (its arrays and the carry's as tensors)
            self.CARRY_KEY: portable_state(self._carry_records),
            self.EMITTED_KEY: self._emitted,
            self.STATS_KEY: stats_dict(self._planner.stats_fields(), **self._stats_fields()),
        }
