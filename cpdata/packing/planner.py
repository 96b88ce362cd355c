"""The packing core shared by :func:`plan_lengths` (a whole dataset from its lengths) and the ``Pack`` node.

A :class:`StreamPlanner` takes the stream one window of documents at a time (:func:`window_ends`),
cuts it into pieces, numbers them with increasing keys and hands them to the algorithm's packer, which
returns the packs it finished (:class:`~cpdata.packing.records.PackKeys`). Same lengths in the same
windows, same packs: so :func:`plan_lengths` and the online node agree pack for pack. The state is the
next key, the counters and the packer's open bins (int64 CSR), which grow to at most 8 bins
(``first_fit``) or the largest window's slot tokens (``bfd``)."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from cpdata.layout.maps import node_size_of
from cpdata.layout.runs import _frozen
from cpdata.packing.decreasing import BestFitDecreasing, FirstFitDecreasing, WorldPacker
from cpdata.packing.greedy import FirstFit, NextFit
from cpdata.packing.pieces import COUNT_FIELDS, Pieces, check_lengths, cut_documents
from cpdata.packing.records import DEFAULT_ALGORITHM, PackingConfig, PackingResult, PackingStats, PackKeys
from cpdata.packing.world_steps import WorldStepPacker

__all__ = ["BinPacker", "StreamPlanner", "carry_and_wait", "make_packer", "plan_lengths", "window_ends"]

_PACK_FIELDS = ("tokens", "slot_tokens", "packs")


class BinPacker(Protocol):
    """What a packing algorithm implements (keys arrive in increasing order)."""

    def place(self, keys: np.ndarray, slots: np.ndarray) -> PackKeys:
        """Add one window of pieces (at least one); return the packs now finished (keys in arrival order)."""

    def finish(self) -> PackKeys:
        """End of stream: return every open bin as a pack."""

    def carry_columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Open bins in CSR form (the state), in bin order: int64 offsets ``[bins + 1]``, keys and slots."""

    def load_carry(self, bins: list[tuple[list[int], list[int]]]) -> None: ...


def make_packer(config: PackingConfig) -> BinPacker:
    """The packer for ``config.algorithm`` (``concat`` is next-fit over pack-sized cuts); a world layout's
    ``bfd``/``ffd`` is :class:`~cpdata.packing.decreasing.WorldPacker`."""
    node_size = node_size_of(config.layout, config.cp_size)
    if config.world_step > 1:  # (resolve() checked the layout and algorithm)
        return WorldStepPacker(config.capacity, config.cp_size, node_size, config.world_step)
    if node_size is not None and config.algorithm in ("bfd", "ffd"):
        return WorldPacker(config.capacity, config.cp_size, node_size, carry=config.algorithm == "bfd")
    factories = {"bfd": BestFitDecreasing, "ffd": FirstFitDecreasing, "first_fit": FirstFit,
                 "next_fit": NextFit, "concat": NextFit}
    return factories[config.algorithm](config.capacity)  # unchecked by resolve(): KeyError, not next-fit


def window_ends(lengths: np.ndarray, config: PackingConfig) -> list[int]:
    """Exclusive end of every window over a stream of document lengths.

    A window closes at the first document at which it holds ``config.window`` documents and
    ``config.window_tokens`` tokens (each document counted up to the capacity, at least 1), or at the end
    of the stream. The :class:`~cpdata.nodes.pack.Pack` node applies the same rule one document at a time."""
    n = int(lengths.shape[0])
    if config.window is None:
        return [n] if n else []
    cum = np.concatenate([[0], np.cumsum(np.clip(lengths, 1, config.capacity))])
    ends, lo = [], 0
    while lo < n:
        hi = min(lo + config.window, n)
        if cum[hi] - cum[lo] < config.window_tokens:
            hi = min(int(np.searchsorted(cum, cum[lo] + config.window_tokens)), n)
        ends.append(hi)
        lo = hi
    return ends


class StreamPlanner:
    """Windows of document lengths in, packs (lists of piece keys) out."""

    def __init__(self, config: PackingConfig) -> None:
        self.config = config
        self._packer = make_packer(config)
        self._counts = dict.fromkeys(COUNT_FIELDS + _PACK_FIELDS, 0)
        self._next_key = 0

    def add_window(
        self, lengths: np.ndarray, source_index: np.ndarray, first_target: np.ndarray | None = None
    ) -> tuple[Pieces, np.ndarray, PackKeys]:
        """Cut and place one window: int64 ``[k]`` ``lengths``, ``source_index`` (for errors) and
        ``first_target`` (:func:`~cpdata.packing.pieces.cut_documents`).

        Returns ``(pieces, keys, packs)``: the pieces, their int64 keys ``[p]``, the packs now finished."""
        fill = self._packer.fill if isinstance(self._packer, NextFit) else 0
        pieces, counts = cut_documents(
            lengths, self.config, source_index=source_index, fill=fill, first_target=first_target
        )
        for name, value in counts.items():
            self._counts[name] += value
        keys = np.arange(self._next_key, self._next_key + len(pieces), dtype=np.int64)
        self._next_key += len(pieces)
        packs = self._packer.place(keys, pieces.slot) if len(pieces) else PackKeys.concat([])
        return pieces, keys, packs

    def finish(self) -> PackKeys:
        """End of stream: the remaining packs."""
        return self._packer.finish()

    def account(self, *, packs: int, tokens: int, slot_tokens: int) -> None:
        """Count packs as emitted."""
        self._counts["packs"] += packs
        self._counts["tokens"] += tokens
        self._counts["slot_tokens"] += slot_tokens

    @property
    def packs(self) -> int:
        """Packs counted as emitted so far."""
        return self._counts["packs"]

    def stats(self) -> PackingStats:
        return PackingStats.from_counts(capacity=self.config.capacity, **self._counts)

    def stats_fields(self) -> dict[str, Any]:
        """:meth:`stats` as a fresh dict in field order."""
        return PackingStats.fields_from_counts(capacity=self.config.capacity, **self._counts)

    def state(self) -> dict[str, Any]:
        offsets, keys, slots = self._packer.carry_columns()
        state = {
            "next_key": self._next_key,
            "counts": dict(self._counts),
            "carry_offsets": offsets,
            "carry_keys": keys,
            "carry_slots": slots,
        }
        if isinstance(self._packer, WorldStepPacker):  # its open step's placements (a resume restores them)
            state["carry_owners"] = self._packer.carry_owners()
        return state

    def load_state(self, state: dict[str, Any]) -> None:
        self._next_key = int(state["next_key"])
        self._counts = dict.fromkeys(COUNT_FIELDS + _PACK_FIELDS, 0)
        self._counts.update({k: int(v) for k, v in state["counts"].items()})
        # (tensors in a node's state, arrays in earlier ones)
        off, keys, slots = (np.asarray(state[f"carry_{k}"]).tolist() for k in ("offsets", "keys", "slots"))
        self._packer = make_packer(self.config)
        bins = [(keys[a:b], slots[a:b]) for a, b in zip(off[:-1], off[1:], strict=True)]
        if isinstance(self._packer, WorldStepPacker):
            self._packer.load_carry(bins, np.asarray(state.get("carry_owners", np.zeros((0, 3))), dtype=np.int64))
        else:
            self._packer.load_carry(bins)


def carry_and_wait(lengths: np.ndarray, config: PackingConfig) -> tuple[int, int]:
    """The most pieces held open between windows and the longest wait of a piece (windows from its own to
    its pack's; pieces still open at the end of the stream leave after the last window) over int64 ``[n]``
    ``lengths``: what the ``packing`` section of ``cpdata bench`` reports as ``carry`` and ``wait``."""
    planner = StreamPlanner(config)
    arrival: list[np.ndarray] = []
    carry = wait = lo = w = 0
    for w, hi in enumerate(window_ends(lengths, config)):
        _, keys, packs = planner.add_window(lengths[lo:hi], np.arange(lo, hi))
        lo = hi
        arrival.append(np.full(keys.shape[0], w))
        born = np.concatenate(arrival)
        carry = max(carry, len(planner.state()["carry_keys"]))
        wait = max([wait, *(w - int(born[min(p)]) for p in packs)])
    return carry, max([wait, *(w - int(born[min(p)]) for p in planner.finish())])


def _integer_lengths(lengths: object) -> np.ndarray:
    """``lengths`` as int64 ``[n]``, refused unless 1-D, of an integer dtype and >= 0 (never cast nor flattened)."""
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"lengths must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"lengths must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and arr.min() < 0:
        bad = int(np.argmin(arr))
        raise ValueError(f"lengths must be >= 0, got lengths[{bad}]={int(arr[bad])}")
    return arr


def plan_lengths(
    lengths: np.ndarray,
    *,
    capacity: int,
    layout: str,
    cp_size: int,
    algorithm: str = DEFAULT_ALGORITHM,
    overflow: str | None = None,
    seed: int = 0,
    window: int | None = None,
    first_target: np.ndarray | None = None,
) -> PackingResult:
    """Plan the packs of a whole dataset from its document lengths, one window at a time as the
    :class:`~cpdata.nodes.pack.Pack` node does: same documents, same packs.

    Args:
        lengths: int ``[n]`` real tokens per document, in stream order.
        capacity, layout, cp_size, algorithm, overflow, window: as
            :meth:`~cpdata.packing.records.PackingConfig.resolve` takes them; ``seed`` is recorded only.
        first_target: int ``[n]`` each document's first trained target, -1 if none (left out, counted
            ``untrained``); ``None``: every document is trained.

    Returns:
        :class:`~cpdata.packing.PackingResult` (``doc_index`` into ``lengths``); O(n) time, O(window) memory.
    """
    config = PackingConfig.resolve(
        capacity=capacity, layout=layout, cp_size=cp_size, algorithm=algorithm,
        overflow=overflow, seed=seed, window=window,
    )
    lengths = _integer_lengths(lengths)
    check_lengths(lengths, config)  # every overlong document at once, before planning
    if first_target is not None:
        first_target = np.asarray(first_target, dtype=np.int64)
        if first_target.shape != lengths.shape:
            raise ValueError(f"first_target has shape {first_target.shape}, lengths {lengths.shape}; pass one per document")
    planner = StreamPlanner(config)
    columns: list[tuple[np.ndarray, ...]] = [(np.zeros(0, np.int64),) * 4]
    parts: list[PackKeys] = []
    lo = 0
    for hi in window_ends(lengths, config):
        targets = None if first_target is None else first_target[lo:hi]
        pieces, _, done = planner.add_window(lengths[lo:hi], np.arange(lo, hi, dtype=np.int64), targets)
        columns.append((pieces.doc + lo, pieces.start, pieces.length, pieces.slot))
        parts.append(done)
        lo = hi
    parts.append(planner.finish())

    packs = PackKeys.concat(parts)
    offsets = np.concatenate([[0], np.cumsum(packs.sizes)]).astype(np.int64)
    table = [np.concatenate(c) for c in zip(*columns, strict=True)]
    assert packs.keys.shape[0] == table[0].shape[0], "every piece must land in exactly one pack"
    doc_index, doc_start, doc_len, slot_len = (col[packs.keys] for col in table)
    _frozen(offsets, doc_index, doc_start, doc_len, slot_len)
    planner.account(packs=len(packs), tokens=int(doc_len.sum()), slot_tokens=int(slot_len.sum()))
    return PackingResult(pack_offsets=offsets, doc_index=doc_index, doc_start=doc_start, doc_len=doc_len,
                         slot_len=slot_len, stats=planner.stats(), config=config)
