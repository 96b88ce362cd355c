"""``WindowedPacks``: a global schedule for streams, planned window by window.

For a source without lengths (an iterable: JSONL lines, a streaming HF
dataset) :class:`~cpdata.nodes.scheduled.ScheduledPacks` cannot plan the
epoch up front. Here every rank reads the stream in windows of ``W``
documents, plans each window with :func:`~cpdata.schedule.plan_schedule`
(a pure function of the window's lengths: identical on every DP rank, CP rank
and dataloader worker, no collective) and emits only its own
(step, micro-batch) packs of the window's steps::

    stream ─► window k (W documents) ─► plan_schedule(lengths, epoch=k) ─► this rank's packs ─► PackPlan

Each window's last step follows ``tail`` (``"pad"``: empty packs that the loss
ignores, counted in ``empty_packs``; ``"drop"``: the step left out, its tokens
counted in ``tail_dropped_tokens``), so every DP rank gets exactly the same
number of steps per window and hence per epoch. Lengths come from the rows
themselves (``len(input_ids)``) once read: every rank reads every row of the
stream anyway, so a ``length`` field would save nothing; only this worker's own
documents are validated and kept (``to_document``), the others are dropped
after their ids' structure is checked.

Costs and trade-offs: every rank, CP rank and worker reads the whole stream
(each document ``dp × cp × num_workers`` times; the fallback reads it
``cp × num_workers`` times) and plans every window (~3-5 us per document);
a window holds at most ``W`` documents in memory; each window pads its own
last step (smaller ``W``: more padding, less memory; see docs/scheduling.md).
``shuffle`` is refused (shuffle the stream upstream, or give lengths for
:class:`~cpdata.nodes.scheduled.ScheduledPacks`).

Workers: the rank's packs form one sequence over windows and epochs (pack
``j`` of a window is micro-batch ``j % micro_batches`` of its step
``j // micro_batches``); worker ``w`` of ``N`` serves items ``w, w + N, ...``
of it, so the loader's round-robin gives the order of ``num_workers=0``.

Pack ids: a plan's ``index`` (``batch.info["pack_indices"]``) numbers the
packs of all DP ranks through the epoch's windows, the way a schedule of the
whole epoch numbers its packs: window ``k``'s packs follow every pack of the
windows before it, so no two packs of an epoch share an id (the window number
is in ``plan.extras["window"]``).

State: ``{"version", "config", "epoch", "first_epoch", "window", "item",
"pack_base", "window_sha256"}`` (``pack_base``: the epoch's packs before the
window; a state saved without it numbers from the window it resumes in). A restore replays the stream up to the window's start
(``window × W`` rows skipped, not parsed; a ``BaseNode`` source is refused),
re-plans that window and checks its lengths against ``window_sha256``.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Iterator
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from cpdata.nodes.scheduled_rows import RankRows, check_dp_share, rank_rows
from cpdata.nodes.source import source_kind
from cpdata.nodes.state_version import check_saved_config, check_state_version
from cpdata.nodes.validate import document_ids, to_document
from cpdata.schedule import CostModel, plan_schedule
from cpdata.worker.keys import IGNORE_INDEX, INPUT_IDS
from cpdata.worker.plan import DocPiece, PackPlan
from cpdata.worker.targets import LabelsAlignment, check_labels_alignment, piece_arrays

__all__ = ["WindowedPacks"]


def _sha(lengths: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(lengths, dtype="<i8").tobytes()).hexdigest()


class WindowedPacks(BaseNode[PackPlan]):
    """This DP rank's packs of a stream planned in windows of ``window`` documents (module docstring).

    Args:
        source: a re-iterable of document dicts (``iter(source)`` starts it again: a list, a
            streaming dataset, a class whose ``__iter__`` opens the file).
        window: documents per planned window (``W >= 1``).
        capacity, layout, cp_size, dp_rank, dp_size, micro_batches, schedule, cost, max_delay,
            algorithm, overflow, seed, tail, num_epochs, vocab_size, worker, labels_alignment:
            as for :class:`~cpdata.nodes.scheduled.ScheduledPacks`.
    """

    VERSION = 1
    KEYS = ("epoch", "first_epoch", "window", "item")

    def __init__(
        self, source: Any, *, window: int, capacity: int, layout: str, cp_size: int, dp_rank: int = 0,
        dp_size: int = 1, micro_batches: int = 1, schedule: str = "balanced", cost: CostModel | None = None,
        max_delay: int = 0, algorithm: str = "bfd", overflow: str | None = None, seed: int = 0,
        tail: str = "pad", num_epochs: int | None = None, vocab_size: int | None = None,
        worker: tuple[int, int] = (0, 1), labels_alignment: LabelsAlignment | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        if schedule not in ("balanced", "in_order"):
            raise ValueError(f"unknown schedule {schedule!r}; choose 'balanced' or 'in_order'")
        if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
            raise ValueError(f"schedule_window must be an int >= 1 (documents per planned window), got {window!r}")
        if source_kind(source) == "node":
            raise TypeError("schedule_window= replays the stream on resume and needs a re-iterable source, not a "
                            "torchdata BaseNode; pass the iterable itself")  # fmt: skip
        check_dp_share(dp_rank, dp_size, num_epochs)
        if not 0 <= worker[0] < worker[1]:
            raise ValueError(f"need 0 <= worker_id < num_workers, got worker={worker}")
        if schedule == "balanced" and cost is None:
            cost = CostModel()
        self.labels_alignment = check_labels_alignment(labels_alignment)
        self.source, self.window, self.vocab_size, self.num_epochs = source, int(window), vocab_size, num_epochs
        self.dp_rank, self.worker = int(dp_rank), (int(worker[0]), int(worker[1]))
        self.plan_kw: dict[str, Any] = dict(
            capacity=capacity, layout=layout, cp_size=cp_size, dp_size=int(dp_size), micro_batches=micro_batches,
            cost=cost if schedule == "balanced" else None, max_delay=max_delay, algorithm=algorithm,
            overflow=overflow, seed=seed, tail=tail,
        )  # fmt: skip
        probe = plan_schedule(np.zeros(0, dtype=np.int64), **self.plan_kw)  # validates every argument now
        self.micro_batches = probe.micro_batches
        self._config = {
            "schedule": schedule, "window": self.window, "capacity": int(capacity), "layout": layout,
            "cp_size": int(cp_size), "dp": [self.dp_rank, int(dp_size)], "micro_batches": int(micro_batches),
            "max_delay": int(max_delay), "algorithm": algorithm, "overflow": probe.config.overflow, "seed": int(seed),
            "num_epochs": num_epochs, "tail": tail, "worker": list(self.worker),
            "cost": None if cost is None or schedule != "balanced" else [float(cost.a), float(cost.b)],
            "labels_alignment": self.labels_alignment,
        }  # fmt: skip
        self._epoch = self._first_epoch = self._window = 0
        self._pack_base = self._window_packs = 0  # the epoch's packs (all DP ranks) before / in this window
        self._item, self._started = self.worker[0], False
        self._clear()
        self.documents_read = self.documents_kept = 0
        """Rows read from the stream (every row of every window, replay included); rows validated and kept
        (the documents of this worker's packs only)."""
        self.counts = {"windows": 0, "steps": 0, "empty_packs": 0, "tail_dropped_tokens": 0, "tokens": 0}
        """Per planned window, summed (the whole window, all ranks: identical on every rank and worker)."""

    @classmethod
    def for_graph(cls, source: Any, schedule_window: int, *, window: int | None, lengths: Any, shuffle: bool,
                  schedule: str | None, **kwargs: Any) -> WindowedPacks:  # fmt: skip
        """``build_loader(schedule_window=...)``: refuse the arguments a windowed plan does not take, naming the fix."""
        if schedule is None:
            raise ValueError("schedule_window= plans a stream window by window: pass schedule='balanced' "
                             "(or 'in_order') with it, or leave it out")  # fmt: skip
        if window is not None or lengths is not None or shuffle:
            raise ValueError(
                "schedule_window= plans each window of the stream from the lengths it reads, in stream order: "
                "leave out window= and lengths= (or use schedule= without schedule_window), and shuffle the "
                "stream upstream instead of shuffle=True"
            )
        return cls(source, window=schedule_window, schedule=schedule, **kwargs)

    def _clear(self) -> None:
        self._it: Iterator[Any] | None = None
        self._rows: RankRows | None = None
        self._docs: dict[int, dict[str, np.ndarray]] = {}
        self._window_sha: str | None = None
        self._expect_sha: str | None = None

    def with_worker(self, worker: tuple[int, int]) -> WindowedPacks:
        """The same rank's packs for dataloader worker ``worker = (worker_id, num_workers)``."""
        if not 0 <= worker[0] < worker[1]:
            raise ValueError(f"need 0 <= worker_id < num_workers, got worker={worker}")
        other = copy.copy(self)
        BaseNode.__init__(other)
        other.worker = (int(worker[0]), int(worker[1]))
        other._config = {**self._config, "worker": list(other.worker)}
        other._item, other.documents_read, other.documents_kept = other.worker[0], 0, 0
        other.counts = dict.fromkeys(self.counts, 0)
        other._clear()
        return other

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_it": None}  # a live iterator does not pickle; reset() opens the stream

    @property
    def epoch(self) -> int:
        """The epoch being served (0-based; counts on across ``iter()`` calls and restores)."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Make the next fresh ``reset()`` start epoch ``epoch`` (as ``DistributedSampler.set_epoch``)."""
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        self._epoch, self._started = int(epoch) - 1, epoch > 0

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._clear()
        if initial_state is None:
            self._epoch = self._epoch + 1 if self._started else 0
            self._first_epoch, self._window, self._item, self._started = self._epoch, 0, self.worker[0], True
            self._pack_base = 0
            self._it = iter(self.source)
            return
        check_state_version("WindowedPacks", initial_state, "version", self.VERSION)
        check_saved_config("WindowedPacks", initial_state["config"], self._config)
        values = [initial_state.get(k) for k in self.KEYS]
        if any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0 for v in values) or (
                values[1] > values[0]):  # fmt: skip
            raise ValueError(f"WindowedPacks state has {dict(zip(self.KEYS, values, strict=True))}; expected ints >= 0 "
                             "with first_epoch <= epoch")  # fmt: skip
        self._epoch, self._first_epoch, self._window, self._item = (int(v) for v in values)
        base = initial_state.get("pack_base", 0)
        if isinstance(base, bool) or not isinstance(base, (int, np.integer)) or base < 0:
            raise ValueError(f"WindowedPacks state has pack_base={base!r}; expected an int >= 0")
        self._pack_base = int(base)
        self._started, self._expect_sha = True, initial_state.get("window_sha256")
        self._it = iter(self.source)
        skip = self._window * self.window
        for done in range(skip):  # replay: rows skipped, not parsed
            try:
                next(self._it)
            except StopIteration:
                if done <= skip - self.window:  # the previous window was not read to its end: another stream
                    raise ValueError(f"the saved state is at window {self._window} ({skip} rows of "
                                     f"{self.window}) but the stream ends after {done}; restore onto the same "
                                     "stream") from None  # fmt: skip
                break
            self.documents_read += 1

    def _load_window(self) -> bool:
        """Read, plan and keep the current window; ``False`` when the stream has ended (epoch end)."""
        assert self._it is not None
        base, items, lengths = self._window * self.window, [], []
        for _ in range(self.window):
            try:
                item = next(self._it)
            except StopIteration:
                break
            lengths.append(int(document_ids(item, base + len(items)).shape[0]))
            items.append(item)
        self.documents_read += len(items)
        if not items:
            return False
        arr = np.asarray(lengths, dtype=np.int64)
        self._window_sha = _sha(arr)
        if self._expect_sha is not None and self._expect_sha != self._window_sha:
            raise ValueError(f"window {self._window} of the stream has other document lengths than when the state "
                             "was saved; restore onto the same stream, in the same order")  # fmt: skip
        self._expect_sha = None
        try:
            sched = plan_schedule(arr, **self.plan_kw, epoch=self._window)
        except ValueError as exc:  # the planner numbers documents within the window
            raise ValueError(f"window {self._window} of the stream (documents {base} to {base + len(items) - 1}; "
                             f"add {base} to the document numbers that follow): {exc}") from exc  # fmt: skip
        st = sched.stats
        self._window_packs = st.steps * self.plan_kw["dp_size"] * self.micro_batches
        for key, value in (("windows", 1), ("steps", st.steps), ("empty_packs", st.empty_packs),
                           ("tail_dropped_tokens", st.tail_dropped_tokens), ("tokens", st.tokens)):  # fmt: skip
            self.counts[key] += value
        rows = rank_rows(sched, self.dp_rank)
        own = range(self._item, int(rows.offsets.shape[0]) - 1, self.worker[1])
        keep = {int(d) for j in own for d in rows.doc_index[rows.offsets[j] : rows.offsets[j + 1]]}
        self._docs = {d: to_document(items[d], base + d, self.vocab_size, self.labels_alignment).arrays
                      for d in sorted(keep)}  # fmt: skip
        self._rows, self.documents_kept = rows, self.documents_kept + len(keep)
        return True

    def _plan(self, item: int) -> PackPlan:
        s, base = self._rows, self._window * self.window
        assert s is not None
        rows = slice(int(s.offsets[item]), int(s.offsets[item + 1]))
        pieces = []
        for j in range(rows.start, rows.stop):
            doc, start, length = int(s.doc_index[j]), int(s.doc_start[j]), int(s.doc_len[j])
            arrays, continues = self._docs[doc], bool(s.continues[j])
            next_label = int(arrays[INPUT_IDS][start + length]) if continues else IGNORE_INDEX
            pieces.append(DocPiece(index=base + doc, start=start, arrays=piece_arrays(arrays, start, length, continues),
                                   next_label=next_label))  # fmt: skip
        step, micro_batch = divmod(item, self.micro_batches)
        pack = (step * self.plan_kw["dp_size"] + self.dp_rank) * self.micro_batches + micro_batch  # the window's
        pack += self._pack_base
        return PackPlan(pieces=tuple(pieces), slot_lens=np.array(s.slot_len[rows], dtype=np.int64),
                        capacity=self._config["capacity"], index=pack,
                        extras={"step": step, "micro_batch": micro_batch, "epoch": self._epoch,
                                "window": self._window})  # fmt: skip

    def next(self) -> PackPlan:
        if self._it is None:
            raise RuntimeError("WindowedPacks.next() before reset()")
        while True:
            if self._rows is None and not self._load_window():
                if self._epoch + 1 - self._first_epoch >= (self.num_epochs or 1):
                    raise StopIteration
                self._epoch, self._window, self._it, self._pack_base = self._epoch + 1, 0, iter(self.source), 0
                continue
            assert self._rows is not None
            total = int(self._rows.offsets.shape[0]) - 1
            if self._item < total:
                break
            self._item, self._window, self._rows, self._docs = self._item - total, self._window + 1, None, {}
            self._pack_base += self._window_packs
        plan = self._plan(self._item)
        self._item += self.worker[1]
        return plan

    def get_state(self) -> dict[str, Any]:
        return {"version": self.VERSION, "config": dict(self._config), "epoch": self._epoch,
                "first_epoch": self._first_epoch, "window": self._window, "item": self._item,
                "pack_base": self._pack_base,
                "window_sha256": self._window_sha if self._rows is not None else None}  # fmt: skip
