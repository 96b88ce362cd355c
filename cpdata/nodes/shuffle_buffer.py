"""A shuffle buffer for streams (re-iterables, nodes) that cannot be indexed.

The buffer holds up to ``size`` items; each draw hands out a uniformly random one and puts the stream's
next item in its place. Epoch ``e`` draws from ``default_rng([seed, e, dp_rank, TAG])``, so every CP rank
of a DP group draws the same order. The order is local (an item leaves ~``size`` draws after it entered):
shuffle a sorted source before streaming it. Trade-off: the state is one integer (draws this epoch) and a
restore re-reads the epoch up to ``drawn + size`` items, instead of putting up to ``size`` documents
(160 MB at 10,000 x 2K tokens) in every checkpoint. Memory: up to ``size`` raw items.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import numpy as np

from cpdata.errors import check_int

__all__ = ["DEFAULT_SHUFFLE_BUFFER", "ShuffleBuffer"]

T = TypeVar("T")

DEFAULT_SHUFFLE_BUFFER = 10_000
"""Documents a stream's shuffle buffer holds by default (``shuffle_buffer=``)."""

_TAG = 0x5B0F  # separates the buffer's random stream from the permutation of sequence sources


class ShuffleBuffer(Generic[T]):
    """Random order over a stream with a buffer of ``size`` items (1 keeps the stream order)."""

    def __init__(self, size: int, seed: int, dp_rank: int = 0) -> None:
        fix = f" (documents held to shuffle a stream); the default is {DEFAULT_SHUFFLE_BUFFER}"
        self.size = check_int("shuffle_buffer", size, min=1, fix=fix)
        self.seed, self.dp_rank = int(seed), int(dp_rank)
        self.drawn = 0
        self._items: list[T] = []
        self._ended = False
        self._rng = np.random.default_rng([self.seed, 0, self.dp_rank, _TAG])

    def start(self, epoch: int) -> None:
        """Empty the buffer and seed the draws of ``epoch``."""
        self._items, self._ended, self.drawn = [], False, 0
        self._rng = np.random.default_rng([self.seed, int(epoch), self.dp_rank, _TAG])

    def next(self, read: Callable[[], T]) -> T:
        """The next item in shuffled order; ``read()`` gives the stream's next item (StopIteration at its end)."""
        while not self._ended and len(self._items) < self.size:
            try:
                self._items.append(read())
            except StopIteration:
                self._ended = True
        if not self._items:
            raise StopIteration
        j = int(self._rng.integers(len(self._items)))
        item = self._items[j]
        last = self._items.pop()
        if j < len(self._items):
            self._items[j] = last
        self.drawn += 1
        return item

    def replay(self, epoch: int, drawn: int, read: Callable[[], T]) -> None:
        """Restore: start ``epoch`` and redo its first ``drawn`` draws over a stream read from its start
        (``ValueError`` if the stream ends first)."""
        self.start(epoch)
        for done in range(int(drawn)):
            try:
                self.next(read)
            except StopIteration:
                raise ValueError(
                    f"the saved state had drawn {drawn} documents from the shuffle buffer, but the stream ends "
                    f"after {done}; restore onto the same source"
                ) from None
