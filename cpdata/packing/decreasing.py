"""Decreasing-order packers: streaming best-fit-decreasing (``bfd``) and first-fit-decreasing (``ffd``).

``bfd`` (the default) keeps open bins across windows: per window, pieces of the full capacity leave at
once, the others go best-fit, longest first, into the open bins or new ones (bisect on sorted ``room <<
shift | bin`` codes), avoiding gaps that no piece of the window fills; the emptiest bins stay open while
they hold at most a window's slot tokens and nothing older than :data:`MAX_WAIT` windows, and each
emitted bin is first topped up by trades with them (:mod:`cpdata.packing.filling`); the final carry is
re-packed when that saves bins. Trade-off: carried bins change only by trades (half the best-fit work),
free on shuffled data, 8 pp on a length-sorted stream; 0.000-0.042 pp above ``ceil(slot tokens /
capacity)`` on realistic distributions (steps and figures: docs/packing-and-mixing.md).

``ffd`` is first-fit-decreasing over each window (a max segment tree over bin room), the whole stream
with ``window=None``. Ties break by arrival order; no random numbers.

Under a ``world`` layout both pack with :class:`WorldPacker`: first-fit-decreasing over each window into world
micro-batches of ``W`` per-rank bins (:class:`~cpdata.layout.world_plan.WorldBins`) of ``L = S / W`` tokens, a
piece whole on one rank (at most ``L`` tokens) or on ``ceil(s / L)`` consecutive ranks of one node, so the
deal replays the bins from the slot lengths and cuts no document to fill a rank (the price: packs not filled
to the last token). ``bfd`` carries the :data:`CARRY` emptiest packs with a quarter rank of room to the next
window unless they hold a piece :data:`MAX_AGE` windows old. Cost: a loop over the open packs per piece, a
heap over the ranks per short piece, a scan of rank windows per long one (figures: docs/benchmarks.md)."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

import numpy as np

from cpdata.layout.runs import first_of_runs, segments
from cpdata.layout.world_plan import WorldBins
from cpdata.packing.filling import exact_fill, stable_order, top_up
from cpdata.packing.greedy import OpenBins
from cpdata.packing.records import PackKeys

__all__ = ["CARRY", "MAX_AGE", "MAX_WAIT", "BestFitDecreasing", "FirstFitDecreasing", "WorldPacker",
           "best_fit_decreasing", "decreasing", "packs_by_bin"]  # fmt: skip

MAX_WAIT = 32
"""Windows a carried bin may stay open (a window counted as the larger of the current window's and the
carry's pieces); without it a slightly emptier bin can stay open for the whole stream."""

CARRY = 2
"""Packs kept open between windows (``bfd``), the emptiest with room for a short piece."""

MAX_AGE = 16
"""A carried pack holding a piece older than this many windows' pieces (counted in keys) is emitted."""


def decreasing(keys: np.ndarray, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Keys and slots sorted by slot descending, ties by key ascending."""
    if keys.shape[0] < 2 or bool((keys[1:] > keys[:-1]).all()):
        order = stable_order(slots.max(initial=0) - slots)  # descending, ties in key order
    else:
        order = np.lexsort((keys, -slots))
    return keys[order], slots[order]


def _by_bin_then_key(bin_of: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """``np.lexsort((keys, bin_of))`` as one stable sort of ``bin * span + key`` when that fits an int64."""
    if keys.shape[0] < 2:
        return np.arange(keys.shape[0])
    low = int(keys.min())
    span = int(keys.max()) - low + 1
    if (int(bin_of.max()) + 1) * span >= 1 << 63:
        return np.lexsort((keys, bin_of))
    return np.argsort(bin_of * span + (keys - low), kind="stable")


def packs_by_bin(keys: np.ndarray, bin_of: np.ndarray) -> PackKeys:
    """Pieces grouped by bin: keys ascending inside a pack, packs by their smallest key."""
    order = _by_bin_then_key(bin_of, keys)
    k, b = keys[order], bin_of[order]
    starts = np.flatnonzero(first_of_runs(b))
    sizes = np.diff(np.append(starts, k.shape[0]))
    by_first = np.argsort(k[starts])
    starts, sizes = starts[by_first], sizes[by_first]
    flat = segments(starts, sizes)
    return PackKeys(keys=k[flat], sizes=sizes)


def best_fit_decreasing(
    slots: np.ndarray, capacity: int, rooms: np.ndarray | None = None, *, avoid: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Best-fit of pieces, longest first, into open bins (int64 ``[m]`` ``rooms``, bins ``0..m-1``, or
    None) and then new ones; ``slots``: int64 ``[n]``, non-increasing, each ``<= capacity``; ``avoid``:
    steer a piece that would leave a gap below the smallest piece to a bin where it does not.

    Returns ``(bin_of, open_room, open_bin)``: int64 ``[n]`` bin of every piece (new bins numbered from
    ``m``), and the room and number of every bin with room left, fullest first."""
    n, m = int(slots.shape[0]), 0 if rooms is None else int(rooms.shape[0])
    rooms = np.zeros(0, dtype=np.int64) if rooms is None else rooms
    shift = max(n + m, 1).bit_length()  # as small as the bin numbers allow: faster int compares
    mask = (1 << shift) - 1
    # Pieces longer than half a bin and than every open room each open their own bin, in bulk.
    n_bulk = int(np.count_nonzero((2 * slots > capacity) & (slots > rooms.max(initial=0))))
    room = np.concatenate([rooms, capacity - slots[:n_bulk]])
    free = np.sort(((room << shift) | np.arange(m + n_bulk, dtype=np.int64))[room > 0]).tolist()
    sentinel = (capacity << shift) | mask  # a fresh bin: sorts after every real one
    free.append(sentinel)
    one, cap_sh, n_bins = 1 << shift, capacity << shift, m + n_bulk
    find, insert = bisect_left, free.insert
    placed: list[int] = []  # the code of every piece's bin (its number in the low bits)
    append = placed.append
    # A room below the smallest piece takes nothing more: its bin leaves ``free`` (shorter searches).
    dead = int(slots[-1]) << shift if n else 0
    dead2 = 2 * dead
    low = one if avoid else dead  # rooms in [low, dead) are the gaps ``avoid`` steers clear of (none without it)
    closed: list[int] = []
    close = closed.append
    for sh in (slots[n_bulk:] << shift).tolist():
        j = find(free, sh)  # least room >= slot
        code = free[j]
        new = code - sh  # same bin, room - slot
        if low <= new < dead and code >= dead2:
            j = find(free, sh + dead, j, len(free) - 1)  # at worst the sentinel: a new bin
            code = free[j]
            new = code - sh
        if code == sentinel:
            new = (cap_sh - sh) | n_bins
            append(new)
            n_bins += 1
            if new >= dead:
                insert(find(free, new), new)
            elif new >= one:
                close(new)
            continue
        append(code)
        if new < dead:
            del free[j]
            if new >= one:
                close(new)
        elif j == 0 or free[j - 1] < new:  # the smaller room keeps its place (most pieces): no list move
            free[j] = new
        else:
            del free[j]
            insert(find(free, new, 0, j), new)
    free.pop()
    codes = np.sort(np.asarray(free + closed, dtype=np.int64))
    bin_of = np.concatenate([np.arange(m, m + n_bulk, dtype=np.int64), np.asarray(placed, dtype=np.int64) & mask])
    return bin_of, codes >> shift, codes & mask


class BestFitDecreasing:
    """Streaming best-fit-decreasing with carried bins; see the module docstring."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.load_carry([])

    def place(self, keys: np.ndarray, slots: np.ndarray) -> PackKeys:
        cap, m = self.capacity, int(self._bins.max(initial=-1)) + 1
        # Carried bins holding a piece older than MAX_WAIT windows leave now; a window counts as the
        # larger of this window's and the carry's pieces (a short last window is not a short window).
        oldest = keys[0] - MAX_WAIT * max(keys.shape[0], self._keys.shape[0])
        stale = self._keys[np.searchsorted(self._bins, np.arange(m))] < oldest
        full = slots == cap
        singles = keys[full]
        keys, slots = decreasing(keys[~full], slots[~full])
        rooms = cap - np.bincount(self._bins, weights=self._slots, minlength=m).astype(np.int64)
        bin_new, open_room, open_bin = best_fit_decreasing(slots, cap, rooms, avoid=True)
        ks, ss = np.concatenate([self._keys, keys]), np.concatenate([self._slots, slots])
        bin_of = np.concatenate([self._bins, bin_new])
        # Carry the emptiest bins while they hold at most the budget.
        budget = max(int(slots.sum()), int(self._slots.sum()))
        n_kept = int(np.searchsorted(np.cumsum(cap - open_room[::-1]), budget, side="right"))
        kept = np.zeros(int(bin_of.max(initial=-1)) + 1, dtype=bool)
        kept[open_bin[open_room.shape[0] - n_kept :]] = True
        kept[:m] &= ~stale
        emit = ~kept[open_bin]
        if emit.any() and kept.any():
            top_up(ss, bin_of, open_bin[emit], open_room[emit], kept, locked=ks < oldest)
        carried = kept[bin_of]
        # Carried pieces by (bin, key), bins renumbered 0.. in order: what load_carry rebuilds from them.
        n_bins = kept.shape[0]
        bins = np.unique(bin_of[carried], return_inverse=True)[1].astype(np.int64)
        carried_keys = ks[carried]
        order = _by_bin_then_key(bins, carried_keys)
        self._keys, self._slots, self._bins = carried_keys[order], ss[carried][order], bins[order]
        out_b = np.concatenate([bin_of[~carried], np.arange(n_bins, n_bins + singles.shape[0], dtype=np.int64)])
        return packs_by_bin(np.concatenate([ks[~carried], singles]), out_b)

    def finish(self) -> PackKeys:
        """Emit the carried bins, re-packed first if that needs fewer bins."""
        keys, slots, bin_of = self._keys, self._slots, self._bins
        self.load_carry([])
        cap, n_bins = self.capacity, int(bin_of.max(initial=-1)) + 1  # (no bins: nothing to re-pack)
        bound = -(-int(slots.sum()) // cap)
        if n_bins > bound:
            ks, ss = decreasing(keys, slots)
            for fill in (lambda s, c: best_fit_decreasing(s, c)[0], exact_fill):
                if n_bins == bound:  # no packing takes fewer bins: the slower exact fill need not run
                    break
                other = fill(ss, cap)
                if int(other.max()) + 1 < n_bins:
                    keys, bin_of, n_bins = ks, other, int(other.max()) + 1
        return packs_by_bin(keys, bin_of)

    def carry_columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Open bins in CSR form, in bin order (keys ascending): int64 offsets ``[bins + 1]``, keys, slots."""
        b = self._bins
        offsets = np.append(np.flatnonzero(first_of_runs(b)), b.size)
        return offsets.astype(np.int64), self._keys.copy(), self._slots.copy()

    def load_carry(self, bins: Sequence[tuple[Sequence[int], Sequence[int]]]) -> None:
        keys = np.asarray([k for b, _ in bins for k in b], dtype=np.int64)
        slots = np.asarray([s for _, b in bins for s in b], dtype=np.int64)
        bin_of = np.repeat(np.arange(len(bins), dtype=np.int64), [len(b) for b, _ in bins])
        order = np.lexsort((keys, bin_of))
        self._keys, self._slots, self._bins = keys[order], slots[order], bin_of[order]


class FirstFitDecreasing(OpenBins):
    """First-fit-decreasing over each window; nothing is carried between windows."""

    carries = False

    def place(self, keys: np.ndarray, slots: np.ndarray) -> PackKeys:
        ks, ss = decreasing(keys, slots)
        size = 1 << max(int(keys.shape[0]) - 1, 1).bit_length()
        # Max segment tree over the room of bins 0..size-1 (unused bins have full room).
        tree = [self.capacity] * (2 * size)
        bin_of: list[int] = []
        for s in ss.tolist():
            i = 1
            while i < size:
                i = 2 * i if tree[2 * i] >= s else 2 * i + 1
            bin_of.append(i - size)
            tree[i] -= s
            i >>= 1
            while i:
                m = max(tree[2 * i], tree[2 * i + 1])
                if tree[i] == m:
                    break
                tree[i] = m
                i >>= 1
        return packs_by_bin(ks, np.asarray(bin_of, dtype=np.int64))


class WorldPacker(OpenBins):
    """The world packer (module docstring): ``world`` ranks, ``node_size`` a node; ``carry``: ``bfd``'s."""

    def __init__(self, capacity: int, world: int, node_size: int, tile: int = 128, *, carry: bool = True) -> None:
        self.world, self.node_size, self.tile = world, node_size, tile
        self.keep, self.carries = (CARRY if carry else 0), carry
        super().__init__(capacity)

    def _fill(self, keys: np.ndarray, slots: np.ndarray) -> list[tuple[list[int], list[int], WorldBins]]:
        """First-fit of the pieces, longest first (ties by key), into new packs: ``(keys, slots, bins)`` each."""
        ks, ss = decreasing(keys, slots)
        local = self.capacity // self.world
        packs: list[tuple[list[int], list[int], WorldBins]] = []
        for key, s in zip(ks.tolist(), ss.tolist(), strict=True):
            for pk, ps, bins in packs:
                if (s <= local and s > bins.max_room) or s > bins.total_room or bins.place(s) is None:
                    continue
                pk.append(key)
                ps.append(s)
                break
            else:
                bins = WorldBins(local, self.world, self.node_size, self.tile)
                if bins.place(s) is None:
                    raise ValueError(f"a piece of {s} tokens does not fit a world micro-batch of {self.world} x "
                                     f"{local} tokens; pack with overflow='split' or 'truncate'")  # fmt: skip
                packs.append(([key], [s], bins))
        return packs

    def place(self, keys: np.ndarray, slots: np.ndarray) -> PackKeys:
        _, ck, cs = self.carry_columns()
        packs = self._fill(np.concatenate([ck, keys]), np.concatenate([cs, slots]))
        oldest = int(keys.min()) - MAX_AGE * int(keys.shape[0])
        short = self.capacity // self.world // 4
        open_ = [i for i, (pk, _, bins) in enumerate(packs) if bins.max_room >= short and min(pk) >= oldest]
        kept = set(sorted(open_, key=lambda i: (-packs[i][2].total_room, min(packs[i][0])))[: self.keep])
        self.load_carry([(packs[i][0], packs[i][1]) for i in sorted(kept)])
        return self._emit([p for i, p in enumerate(packs) if i not in kept])

    @staticmethod
    def _emit(packs: list) -> PackKeys:
        keys = PackKeys.from_lists([p[0] for p in packs])
        return packs_by_bin(keys.keys, np.repeat(np.arange(len(keys), dtype=np.int64), keys.sizes))

    def finish(self) -> PackKeys:
        packs = self._fill(*self.carry_columns()[1:])
        self.load_carry([])
        return self._emit(packs)
