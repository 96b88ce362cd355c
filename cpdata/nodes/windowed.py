"""``WindowedPacks``: this DP rank's packs of a stream without lengths, planned in windows (docs/scheduling.md).

``WindowedPacks`` plans a stream in windows of ``W`` documents, each window's last step following ``tail``, so every
DP rank gets the same steps. Trade-off: every rank and worker reads the whole stream; a window pads its own last
step. Pack ids number all DP ranks' packs through the epoch's windows. Its ``block`` state is ``{"window",
"pack_base", "lengths"}``: a restore skips the rows before the window unparsed (a ``BaseNode`` source is refused),
re-plans it and checks its lengths. A source that states every length is planned whole instead
(:mod:`cpdata.nodes.scheduled`); both share the plan's settings and a rank's packs (:class:`RankPlanRows`).

Serving, workers, epochs and the state are :class:`~cpdata.nodes.served.ServedPacks`'s; a state from other
data or settings is refused.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from cpdata.errors import check_int
from cpdata.nodes.scheduled import RankPlanRows, RankRows, rank_rows
from cpdata.nodes.served import PackRows, ServedPacks
from cpdata.nodes.source_kinds import SourceReader
from cpdata.nodes.validate import document_ids, to_document
from cpdata.schedule import plan_schedule
from cpdata.sources.fingerprint import lengths_sha256

if TYPE_CHECKING:
    from cpdata.nodes.loader import GraphOptions

__all__ = ["WindowRows", "WindowedPacks"]


class WindowRows(RankPlanRows):
    """The rows of :class:`WindowedPacks`: one block per window."""

    identity = None  # a stream states no identity up front: each window's lengths are checked instead

    def __init__(self, reader: SourceReader, options: GraphOptions) -> None:
        self.window = int(options.plan.window)
        super().__init__(reader.source, options, {"window": self.window}, fallback=False)
        self.reader = reader
        self.documents_read = self.documents_kept = 0
        self.counts = {"windows": 0, "steps": 0, "empty_packs": 0, "tail_dropped_tokens": 0, "tokens": 0}
        self._window = self._pack_base = self._window_packs = 0
        self._rows: RankRows | None = None
        self._items: list[Any] = []
        self._lengths: str | None = None  # the current window's lengths' identity
        self._expect: str | None = None  # a restored window's

    def __copy__(self) -> WindowRows:
        """Another worker's rows: the same stream and plan settings, nothing read or counted yet."""
        other = WindowRows.__new__(WindowRows)
        other.__dict__.update(self.__dict__, reader=copy.copy(self.reader), counts=dict.fromkeys(self.counts, 0),
                              documents_read=0, documents_kept=0)  # fmt: skip
        return other

    def start(self, epoch: int, block: Mapping[str, Any] | None) -> int:
        self.reader.open()
        self._rows, self._items, self._lengths = None, [], None
        saved = {"window": 0, "pack_base": 0} if block is None else block
        self._window, self._pack_base = (check_int(f"WindowedPacks state's block[{k!r}]", saved.get(k), min=0)
                                         for k in ("window", "pack_base"))  # fmt: skip
        self._expect = None if block is None else block.get("lengths")
        for done in range(self._window * self.window):  # replay: rows skipped, not parsed
            try:
                self.reader.next(done)
            except StopIteration:
                raise self._ended(done) from None
            self.documents_read += 1
        return self._window  # load() reads it again

    def _ended(self, rows: int) -> ValueError:
        """The refusal of a restore onto a stream that ends after ``rows`` rows, before the saved window."""
        return ValueError(f"the saved state is at window {self._window} ({self._window * self.window} rows of "
                          f"{self.window}) but the stream ends after {rows} rows; restore onto the same stream")

    def packs(self, epoch: int) -> None:
        return None  # a stream's packs are known as its windows are read

    def load(self, epoch: int, block: int) -> int | None:
        """Read and plan window ``block`` (the one after the current); None when the stream has ended."""
        base, items, lengths = block * self.window, [], []
        for _ in range(self.window):
            try:
                item = self.reader.next(base + len(items))
            except StopIteration:
                break
            lengths.append(int(document_ids(item, base + len(items)).shape[0]))
            items.append(item)
        self.documents_read += len(items)
        if not items and self._expect is not None:  # a restored window the stream no longer reaches
            raise self._ended(base)
        if not items:
            return None
        arr = np.asarray(lengths, dtype=np.int64)
        identity = lengths_sha256(arr)
        if self._expect is not None and self._expect != identity:
            raise ValueError(f"window {block} of the stream has other document lengths than when the state "
                             "was saved; restore onto the same stream, in the same order")  # fmt: skip
        try:
            sched = plan_schedule(arr, **self.plan_kw, epoch=block)
        except ValueError as exc:  # the planner numbers documents within the window
            raise ValueError(f"window {block} of the stream (documents {base} to {base + len(items) - 1}; "
                             f"add {base} to the document numbers that follow): {exc}") from exc  # fmt: skip
        if self._rows is not None:
            self._pack_base += self._window_packs
        st = sched.stats
        for key, value in (("windows", 1), ("steps", st.steps), ("empty_packs", st.empty_packs),
                           ("tail_dropped_tokens", st.tail_dropped_tokens), ("tokens", st.tokens)):  # fmt: skip
            self.counts[key] += value
        self._window_packs = st.packs  # every rank's, the tail applied
        self._window, self._rows, self._items = block, rank_rows(sched, self.dp_rank), items
        self._lengths, self._expect = identity, None
        return int(self._rows["offsets"].shape[0]) - 1

    def position(self) -> dict[str, Any]:
        return {"window": self._window, "pack_base": self._pack_base,
                "lengths": self._lengths if self._rows is not None else self._expect}  # fmt: skip

    def pack(self, epoch: int, item: int) -> PackRows:
        assert self._rows is not None
        return self.rank_pack(self._rows, item, self._pack_base, -self._window * self.window, epoch=epoch,
                              window=self._window)  # fmt: skip

    def document(self, index: int) -> Mapping[str, np.ndarray]:
        self.documents_kept += 1  # once per run of packs (ServedPacks keeps a split document across its pieces)
        base = self._window * self.window
        return to_document(self._items[index], base + index, self.vocab_size, self.labels_alignment).arrays


class WindowedPacks(ServedPacks):
    """This DP rank's packs of a re-iterable ``source`` planned in windows of ``options.plan.window``
    documents (the arguments as for :class:`~cpdata.nodes.scheduled.ScheduledPacks`)."""

    rows: WindowRows

    def __init__(self, source: Any, options: GraphOptions, *, worker: tuple[int, int] = (0, 1)) -> None:
        reader = SourceReader(source)
        if reader.kind == "node":
            raise TypeError("SchedulePlan.window replays the stream on resume and needs a re-iterable source, not a "
                            "torchdata BaseNode; pass the iterable itself")  # fmt: skip
        super().__init__(WindowRows(reader, options), num_epochs=options.data.epochs, worker=worker)

    @property
    def counts(self) -> dict[str, int]:
        """Per planned window, summed (the whole window, all ranks: identical on every rank and worker)."""
        return self.rows.counts

    @property
    def documents_read(self) -> int:
        """Rows read from the stream (every row of every window, replay included)."""
        return self.rows.documents_read

    @property
    def documents_kept(self) -> int:
        """Rows validated (the documents of this worker's packs only; a split document once per run of packs)."""
        return self.rows.documents_kept
