"""Online greedy packers: ``next_fit`` (one open bin; torchtune / NeMo ``pack_dataset``) and
``first_fit`` (Grain's ``FirstFitPackIterDataset``, 8 bins).

Both place pieces one at a time in arrival order, so their packs do not depend on the windows. A piece
that fits no open bin closes the bin (``next_fit``; an exactly full bin closes at once) or all the bins
(``first_fit``, which then starts a new batch of rows)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cpdata.packing.records import PackKeys

__all__ = ["FirstFit", "NextFit"]


class NextFit:
    """Sequential packing with a single open bin; also the back end of ``concat``."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._keys: list[int] = []
        self._slots: list[int] = []
        self._used = 0

    @property
    def fill(self) -> int:
        """Slot tokens in the open bin."""
        return self._used

    def place(self, keys: np.ndarray, slots: np.ndarray) -> PackKeys:
        out: list[list[int]] = []
        cap, used = self.capacity, self._used
        cur_k, cur_s = self._keys, self._slots
        for k, s in zip(keys.tolist(), slots.tolist(), strict=True):
            if used + s > cap:
                out.append(cur_k)
                cur_k, cur_s, used = [], [], 0
            cur_k.append(k)
            cur_s.append(s)
            used += s
            if used == cap:
                out.append(cur_k)
                cur_k, cur_s, used = [], [], 0
        self._keys, self._slots, self._used = cur_k, cur_s, used
        return PackKeys.from_lists(out)

    def finish(self) -> PackKeys:
        out = [self._keys] if self._keys else []
        self._keys, self._slots, self._used = [], [], 0
        return PackKeys.from_lists(out)

    def carry(self) -> list[tuple[list[int], list[int]]]:
        """Open bins as ``(keys, slots)`` pairs, in bin order."""
        return [(list(self._keys), list(self._slots))] if self._keys else []

    def load_carry(self, bins: Sequence[tuple[Sequence[int], Sequence[int]]]) -> None:
        assert len(bins) <= 1, "next_fit carries at most one bin"
        self._keys = list(bins[0][0]) if bins else []
        self._slots = list(bins[0][1]) if bins else []
        self._used = sum(self._slots)


class FirstFit:
    """First-fit over a batch of ``n_bins`` rows, emitted together when a piece fits none of them."""

    def __init__(self, capacity: int, n_bins: int = 8) -> None:
        self.capacity = capacity
        self.n_bins = n_bins
        self._keys: list[list[int]] = []
        self._slots: list[list[int]] = []
        self._used: list[int] = []

    def place(self, keys: np.ndarray, slots: np.ndarray) -> PackKeys:
        out: list[list[int]] = []
        cap, used = self.capacity, self._used
        for k, s in zip(keys.tolist(), slots.tolist(), strict=True):
            for i, u in enumerate(used):
                if u + s <= cap:
                    self._keys[i].append(k)
                    self._slots[i].append(s)
                    used[i] = u + s
                    break
            else:
                if len(used) == self.n_bins:
                    out.extend(self._keys)
                    self._keys, self._slots, used = [], [], []
                    self._used = used
                self._keys.append([k])
                self._slots.append([s])
                used.append(s)
        return PackKeys.from_lists(out)

    def finish(self) -> PackKeys:
        out = self._keys
        self._keys, self._slots, self._used = [], [], []
        return PackKeys.from_lists(out)

    def carry(self) -> list[tuple[list[int], list[int]]]:
        return [(list(k), list(s)) for k, s in zip(self._keys, self._slots, strict=True)]

    def load_carry(self, bins: Sequence[tuple[Sequence[int], Sequence[int]]]) -> None:
        self._keys = [list(k) for k, _ in bins]
        self._slots = [list(s) for _, s in bins]
        self._used = [sum(s) for s in self._slots]
