"""Records of the packing planners: the configuration, the stats, the offline result, finished packs."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np

from cpdata.errors import check_choice, check_int
from cpdata.layout.maps import alignment, node_size_of

__all__ = ["ALGORITHMS", "DEFAULT_ALGORITHM", "DEFAULT_WINDOW", "OVERFLOW_POLICIES", "WINDOW_PACKS",
           "PackKeys", "PackingConfig", "PackingResult", "PackingStats"]  # fmt: skip

ALGORITHMS: tuple[str, ...] = ("bfd", "concat", "ffd", "first_fit", "next_fit")
DEFAULT_ALGORITHM = "bfd"
"""The packer every entry point defaults to: least padding from a mixed order (docs/packing-and-mixing.md)."""
OVERFLOW_POLICIES: tuple[str, ...] = ("drop", "error", "split", "truncate")
DEFAULT_WINDOW = 1024
"""Documents per ``bfd`` window, at least: 0.000-0.042 pp above the lower bound (the ``packing`` section
of ``cpdata bench``); 512 costs ~0.02 pp more, 2048 saves ~0.01 pp (the carry, and the ``Pack`` state, grow
with the window)."""
WINDOW_PACKS = 4
"""A window also holds at least this many packs of tokens (each document counted up to the capacity,
at least 1), so short documents at a long capacity are not packed from less than a pack at a time."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PackingConfig:
    """A validated packer configuration (build it with :meth:`resolve`)."""

    capacity: int
    """Tokens per pack, a multiple of the layout's pack multiple."""
    layout: str
    cp_size: int
    algorithm: str
    overflow: str
    """What happens to a document whose aligned length exceeds ``capacity``."""
    window: int | None
    """Documents per planning window, at least (see :attr:`window_tokens`); ``None`` = the whole stream."""
    doc_multiple: int
    """Every document slot is rounded up to this multiple (``alignment(layout, cp)[0]``)."""
    seed: int = 0
    """Recorded for reproducibility; the built-in algorithms draw no random numbers."""
    world_step: int = 1
    """Micro-batches a ``world`` layout's packer deals together (:mod:`cpdata.packing.world_steps`); 1: each
    pack by itself."""

    @classmethod
    def resolve(
        cls,
        *,
        capacity: int,
        layout: str,
        cp_size: int,
        algorithm: str = DEFAULT_ALGORITHM,
        overflow: str | None = None,
        seed: int = 0,
        window: int | None = None,
        world_step: int = 1,
    ) -> PackingConfig:
        """Validate the arguments; ``overflow=None``: ``"split"`` for concat, else ``"error"``;
        ``window=None``: :data:`DEFAULT_WINDOW`, or the whole stream for ``ffd``."""
        doc_multiple, pack_multiple = alignment(layout, cp_size)
        check_choice("packing algorithm", algorithm, ALGORITHMS)
        capacity = check_int("capacity", capacity, min=1)
        if capacity % pack_multiple:
            below = capacity - capacity % pack_multiple
            nearest = [c for c in (below, below + pack_multiple) if c > 0]
            raise ValueError(
                f"capacity={capacity} is not a multiple of {pack_multiple}, which layout {layout!r} with "
                f"cp_size={cp_size} needs; use capacity {' or '.join(map(str, nearest))}"
            )
        if overflow is None:
            overflow = "split" if algorithm == "concat" else "error"
        check_choice("overflow policy", overflow, OVERFLOW_POLICIES)
        world_step = check_int("world_step", world_step, min=1, fix=" (micro-batches dealt together)")
        if world_step > 1 and (node_size_of(layout, cp_size) is None or algorithm not in ("bfd", "ffd")):
            raise ValueError(f"world_step={world_step} deals micro-batches of a 'world' layout together with its "
                             f"packer ('bfd' or 'ffd'), got layout {layout!r} and algorithm {algorithm!r}; pass "
                             "world_step=1, or layout=layout_spec('world', node_size=...)")  # fmt: skip
        if window is None:
            window = None if algorithm == "ffd" else DEFAULT_WINDOW
        else:
            window = check_int("window", window, min=1)
        return cls(
            capacity=capacity,
            layout=layout,
            cp_size=int(cp_size),
            algorithm=algorithm,
            overflow=overflow,
            window=window,
            doc_multiple=doc_multiple,
            seed=check_int("seed", seed, min=0) if seed is not None else 0,
            world_step=world_step,
        )

    @property
    def window_tokens(self) -> int:
        """Least tokens per window (``WINDOW_PACKS * capacity``); 0 with ``window=None``."""
        return 0 if self.window is None else WINDOW_PACKS * self.capacity

    def identity(self) -> dict[str, object]:
        """The fields a saved state must match to be restored under this configuration."""
        identity = {name: getattr(self, name) for name in _IDENTITY_FIELDS}  # (atoms: no asdict deep copy)
        if self.world_step != 1:  # (states saved before world steps existed match world_step=1)
            identity["world_step"] = self.world_step
        return identity


_IDENTITY_FIELDS = tuple(f.name for f in dataclasses.fields(PackingConfig)
                         if f.name not in ("doc_multiple", "seed", "world_step"))  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class PackingStats:
    """Counters of one packing run (a snapshot).

    Documents are counted when read, tokens and packs when a pack is emitted. Once every pack is out, real
    tokens in packs + ``truncated_tokens`` + ``dropped_tokens`` + ``untrained_tokens`` = tokens read."""

    capacity: int
    documents: int = 0
    """Documents read, including skipped (empty) and dropped ones."""
    tokens: int = 0
    """Real tokens in the emitted packs."""
    slot_tokens: int = 0
    """Real tokens plus per-document alignment padding of the emitted slots."""
    packs: int = 0
    padding_pct: float = 0.0
    """``100 * (1 - tokens / (packs * capacity))``."""
    lower_bound_pct: float = 0.0
    """Padding of a perfect packing of the same slots: ``ceil(slot_tokens / capacity)`` packs."""
    skipped: int = 0
    """Empty documents."""
    truncated: int = 0
    dropped: int = 0
    split: int = 0
    """Documents cut into more than one piece."""
    truncated_tokens: int = 0
    dropped_tokens: int = 0
    untrained: int = 0
    """Documents whose labels or mask leave no target to train: left out."""
    untrained_tokens: int = 0
    epoch: int = 0
    """The source's epoch being read; 0 offline."""
    sources: dict[str, dict[str, int]] | None = None
    """A :func:`cpdata.mix` source's ``{name: {"documents", "tokens"}}`` drawn this epoch by this DP
    rank; None for other sources."""

    @classmethod
    def from_counts(cls, *, capacity: int, **counts: int) -> PackingStats:
        return cls(**cls.fields_from_counts(capacity=capacity, **counts))

    @staticmethod
    def fields_from_counts(*, capacity: int, **counts: int) -> dict[str, Any]:
        """What :meth:`from_counts` builds, as a fresh dict in field order (a ``Pack`` state holds it)."""
        tokens, packs = counts.get("tokens", 0), counts.get("packs", 0)
        lower = -(-counts.get("slot_tokens", 0) // capacity)
        fields = _STATS_DEFAULTS.copy()
        fields.update(
            capacity=capacity,
            padding_pct=100.0 * (1.0 - tokens / (packs * capacity)) if packs else 0.0,
            lower_bound_pct=100.0 * (1.0 - tokens / (lower * capacity)) if lower else 0.0,
        )
        fields.update(counts)
        return fields

    @property
    def excess_pct(self) -> float:
        """Padding above the lower bound, in percentage points."""
        return self.padding_pct - self.lower_bound_pct


_STATS_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(PackingStats)}


@dataclass(frozen=True, kw_only=True, slots=True)
class PackingResult:
    """A whole-dataset packing plan in CSR form (read-only arrays).

    Pack ``p`` holds pieces ``pack_offsets[p]:pack_offsets[p+1]`` in slot order; piece ``i`` is tokens
    ``doc_start[i] : doc_start[i] + doc_len[i]`` of document ``doc_index[i]`` in a slot of ``slot_len[i]``."""

    pack_offsets: np.ndarray
    """int64 ``[n_packs + 1]``."""
    doc_index: np.ndarray
    """int64 ``[n_pieces]``: the document's position in the input lengths."""
    doc_start: np.ndarray
    """int64 ``[n_pieces]``."""
    doc_len: np.ndarray
    """int64 ``[n_pieces]``."""
    slot_len: np.ndarray
    """int64 ``[n_pieces]``."""
    stats: PackingStats
    config: PackingConfig

    @property
    def n_packs(self) -> int:
        return int(self.pack_offsets.shape[0] - 1)

    def pack(self, p: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(doc_index, doc_start, doc_len, slot_len)`` of pack ``p``."""
        lo, hi = int(self.pack_offsets[p]), int(self.pack_offsets[p + 1])
        return self.doc_index[lo:hi], self.doc_start[lo:hi], self.doc_len[lo:hi], self.slot_len[lo:hi]


@dataclass(frozen=True, kw_only=True, slots=True)
class PackKeys:
    """Packs a packer finished, as piece keys in CSR form: pack ``p`` is ``keys[o[p]:o[p + 1]]``, ``o``
    the running sum of ``sizes``; iterating yields each pack as a list of keys."""

    keys: np.ndarray
    """int64 ``[pieces]``, pack after pack."""
    sizes: np.ndarray
    """int64 ``[packs]``: pieces per pack."""
    owners: np.ndarray | None = None
    """int64 ``[pieces, 2]``: each piece's first rank and ranks in a world step
    (:class:`~cpdata.packing.world_steps.WorldStepPacker`; negative: counted down,
    :func:`~cpdata.layout.world_owners.owner_ranks`); None: the layout deals each pack."""

    @classmethod
    def from_lists(cls, packs: Sequence[Sequence[int]]) -> PackKeys:
        sizes = np.fromiter(map(len, packs), dtype=np.int64, count=len(packs))
        keys = np.fromiter(chain.from_iterable(packs), dtype=np.int64, count=int(sizes.sum()))
        return cls(keys=keys, sizes=sizes)

    @classmethod
    def concat(cls, parts: Sequence[PackKeys]) -> PackKeys:
        if not parts:
            return cls(keys=np.zeros(0, np.int64), sizes=np.zeros(0, np.int64))
        parts = [p for p in parts if len(p)] or parts[:1]  # (no packs: nothing owned or not, e.g. no step closed)
        owned = [p.owners is not None for p in parts]
        if any(owned) and not all(owned):
            raise ValueError("PackKeys.concat: packs with owners and packs without cannot make one stream of packs")
        owners = np.concatenate([p.owners for p in parts]) if all(owned) else None
        return cls(keys=np.concatenate([p.keys for p in parts]), sizes=np.concatenate([p.sizes for p in parts]),
                   owners=owners)  # fmt: skip

    def __len__(self) -> int:
        return int(self.sizes.shape[0])

    def __iter__(self) -> Iterator[list[int]]:
        flat, bounds = self.keys.tolist(), np.concatenate([[0], np.cumsum(self.sizes)]).tolist()
        return (flat[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True))
