"""Online greedy packers: ``next_fit`` (one open bin; torchtune / NeMo ``pack_dataset``) and
``first_fit`` (Grain's ``FirstFitPackIterDataset``, 8 bins).

Both place pieces one at a time in arrival order, so their packs do not depend on the windows. A piece
that fits no open bin closes the bin (``next_fit``; an exactly full bin closes at once) or all the bins
(``first_fit``, which then starts a new batch of rows)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cpdata.packing.records import PackKeys

__all__ = ["FirstFit", "NextFit", "OpenBins"]


class OpenBins:
    """Open bins as lists of keys and slot lengths with their fill: the carry of every packer but ``bfd``
    (``ffd`` keeps none between windows; the world packer keeps whole micro-batches)."""

    carries = True
    """Whether open bins pass from one window to the next (not under ``ffd``: a carry restored is refused)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.load_carry([])

    def finish(self) -> PackKeys:
        out = self._keys
        self.load_carry([])
        return PackKeys.from_lists(out)

    def carry_columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        offsets = np.cumsum([0, *map(len, self._keys)], dtype=np.int64)
        keys = np.array([k for ks in self._keys for k in ks], dtype=np.int64)
        return offsets, keys, np.array([s for ss in self._slots for s in ss], dtype=np.int64)

    def load_carry(self, bins: Sequence[tuple[Sequence[int], Sequence[int]]]) -> None:
        if bins and not self.carries:
            raise ValueError(f"'ffd' carries nothing between windows, but the state holds {len(bins)} open "
                             "packs; restore it under the packing algorithm it was saved with")  # fmt: skip
        self._keys = [list(k) for k, _ in bins]
        self._slots = [list(s) for _, s in bins]
        self._used = [sum(s) for s in self._slots]


class NextFit(OpenBins):
    """Sequential packing with a single open bin (never an empty one); also the back end of ``concat``."""

    @property
    def fill(self) -> int:
        """Slot tokens in the open bin."""
        return self._used[0] if self._used else 0

    def place(self, keys: np.ndarray, slots: np.ndarray) -> PackKeys:
        out: list[list[int]] = []
        cap, used = self.capacity, self.fill
        cur_k, cur_s = (self._keys[0], self._slots[0]) if self._keys else ([], [])
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
        self._keys, self._slots, self._used = ([cur_k], [cur_s], [used]) if cur_k else ([], [], [])
        return PackKeys.from_lists(out)


class FirstFit(OpenBins):
    """First-fit over a batch of ``n_bins`` rows, emitted together when a piece fits none of them."""

    def __init__(self, capacity: int, n_bins: int = 8) -> None:
        super().__init__(capacity)
        self.n_bins = n_bins

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
