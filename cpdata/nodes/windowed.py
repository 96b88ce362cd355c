"""``WindowedPacks``: a global schedule for streams, planned window by window.

For a source without lengths (JSONL lines, a streaming HF dataset) every rank reads the stream in windows
of ``W`` documents, plans each with :func:`~cpdata.schedule.plan_schedule` (a pure function of the
window's lengths: identical on every rank and worker, no collective) and emits only its own packs::

    stream ─► window k (W documents) ─► plan_schedule(lengths, epoch=k) ─► this rank's packs ─► PackPlan

Each window's last step follows ``tail``, so every DP rank gets the same number of steps per window.
Trade-off: every rank, CP rank and worker reads the whole stream and plans every window; a window holds
``W`` documents in memory and pads its own last step (smaller ``W``: more padding, less memory;
docs/scheduling.md). Only this worker's documents are validated and kept. Pack ids number all DP ranks'
packs through the epoch's windows (the window is ``plan.extras["window"]``).

State: ``ServedPacks``'s, its ``block`` ``{"window", "pack_base", "lengths"}`` (the epoch's packs before
the window, the window's lengths' sha256). A restore skips the stream's rows up to the window unparsed
(a ``BaseNode`` source is refused), re-plans that window and checks its lengths.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import numpy as np

from cpdata.errors import check_int, is_int
from cpdata.nodes.scheduled_rows import RankRows, rank_rows, schedule_settings
from cpdata.nodes.served import PackRows, PlanRows, ServedPacks
from cpdata.nodes.source_kinds import SourceReader
from cpdata.nodes.validate import document_ids, to_document
from cpdata.schedule import CostModel, plan_schedule
from cpdata.sources.fingerprint import lengths_sha256
from cpdata.worker.targets import LabelsAlignment

__all__ = ["WindowRows", "WindowedPacks"]


class WindowRows(PlanRows):
    """The :class:`~cpdata.nodes.served.PlanRows` of :class:`WindowedPacks`: one block per window."""

    identity = None  # a stream states no identity up front: each window's lengths are checked instead

    def __init__(self, reader: SourceReader, window: int, plan_kw: dict[str, Any], config: dict[str, Any], *,
                 dp_rank: int, vocab_size: int | None, labels_alignment: LabelsAlignment | None) -> None:  # fmt: skip
        self.reader, self.source, self.window, self.plan_kw, self.dp_rank = reader, reader.source, window, plan_kw, dp_rank
        self.vocab_size, self.labels_alignment = vocab_size, labels_alignment
        self.micro_batches, self.capacity, self.config = int(plan_kw["micro_batches"]), int(plan_kw["capacity"]), config
        self.documents_read = self.documents_kept = 0
        self.counts = {"windows": 0, "steps": 0, "empty_packs": 0, "tail_dropped_tokens": 0, "tokens": 0}
        self._window = self._pack_base = self._window_packs = 0
        self._rows: RankRows | None = None
        self._items: list[Any] = []
        self._docs: dict[int, Mapping[str, np.ndarray]] = {}
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
        self._rows, self._items, self._docs, self._lengths = None, [], {}, None
        self._window = self._pack_base = 0
        self._expect = None
        if block is None:
            return 0
        values = [block.get(k) for k in ("window", "pack_base")]
        if not all(is_int(v) and v >= 0 for v in values):
            raise ValueError(f"WindowedPacks state has block={dict(block)}; expected window and pack_base ints >= 0")
        self._window, self._pack_base, self._expect = int(values[0]), int(values[1]), block.get("lengths")
        skip = self._window * self.window
        for done in range(skip):  # replay: rows skipped, not parsed
            try:
                self.reader.next(done)
            except StopIteration:
                if done <= skip - self.window:  # the previous window was not read to its end: another stream
                    raise ValueError(f"the saved state is at window {self._window} ({skip} rows of "
                                     f"{self.window}) but the stream ends after {done}; restore onto the same "
                                     "stream") from None  # fmt: skip
                break
            self.documents_read += 1
        self._window -= 1  # load() reads it again
        return self._window + 1

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
        self._window_packs = st.steps * self.plan_kw["dp_size"] * self.micro_batches
        self._window, self._rows, self._items, self._docs = block, rank_rows(sched, self.dp_rank), items, {}
        self._lengths, self._expect = identity, None
        return int(self._rows["offsets"].shape[0]) - 1

    def position(self) -> dict[str, Any]:
        return {"window": self._window, "pack_base": self._pack_base,
                "lengths": self._lengths if self._rows is not None else None}  # fmt: skip

    def pack(self, epoch: int, item: int) -> PackRows:
        s = self._rows
        assert s is not None
        step, micro_batch = divmod(item, self.micro_batches)
        pack = (step * self.plan_kw["dp_size"] + self.dp_rank) * self.micro_batches + micro_batch  # the window's
        return PackRows(columns=s, rows=slice(int(s["offsets"][item]), int(s["offsets"][item + 1])),
                        index=self._pack_base + pack, first_document=-self._window * self.window,
                        extras={"step": step, "micro_batch": micro_batch, "epoch": epoch, "window": self._window})

    def document(self, index: int) -> Mapping[str, np.ndarray]:
        arrays = self._docs.get(index)
        if arrays is None:
            base = self._window * self.window
            arrays = to_document(self._items[index], base + index, self.vocab_size, self.labels_alignment).arrays
            self._docs[index], self.documents_kept = arrays, self.documents_kept + 1
        return arrays


class WindowedPacks(ServedPacks):
    """This DP rank's packs of a re-iterable ``source`` planned in windows of ``window`` documents; the other
    arguments as for :class:`~cpdata.nodes.scheduled.ScheduledPacks`."""

    rows: WindowRows

    def __init__(
        self, source: Any, *, window: int, capacity: int, layout: str, cp_size: int, dp_rank: int = 0,
        dp_size: int = 1, micro_batches: int = 1, schedule: str = "balanced", cost: CostModel | None = None,
        max_delay: int = 0, algorithm: str = "bfd", overflow: str | None = None, seed: int = 0,
        tail: str = "pad", num_epochs: int | None = None, vocab_size: int | None = None,
        worker: tuple[int, int] = (0, 1), labels_alignment: LabelsAlignment | None = None,
    ) -> None:  # fmt: skip
        check_int("schedule_window", window, min=1, fix=" (documents per planned window)")
        reader = SourceReader(source)
        if reader.kind == "node":
            raise TypeError("schedule_window= replays the stream on resume and needs a re-iterable source, not a "
                            "torchdata BaseNode; pass the iterable itself")  # fmt: skip
        plan_kw, config = schedule_settings(
            schedule, capacity=capacity, layout=layout, cp_size=cp_size, dp_rank=dp_rank, dp_size=dp_size,
            micro_batches=micro_batches, cost=cost, max_delay=max_delay, algorithm=algorithm, overflow=overflow,
            seed=seed, tail=tail, labels_alignment=labels_alignment, fallback=False,
        )  # fmt: skip
        rows = WindowRows(reader, int(window), plan_kw, {**config, "window": int(window)}, dp_rank=int(dp_rank),
                          vocab_size=vocab_size, labels_alignment=config["labels_alignment"])  # fmt: skip
        super().__init__(rows, num_epochs=num_epochs, worker=worker)

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
        """Rows validated and kept (the documents of this worker's packs only)."""
        return self.rows.documents_kept
