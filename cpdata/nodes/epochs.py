"""One epoch counter, and one way to set the epoch of a whole node graph.

Every stage with epochs (``Documents``, ``Mix``, :class:`~cpdata.nodes.served.ServedPacks`) is an
:class:`EpochNode` counting in its :class:`EpochClock`, as ``CPDataLoader`` counts for its fresh worker
copies: a fresh ``reset()`` (a new ``iter()``) starts the epoch :meth:`EpochNode.set_epoch` named, else
the one after the last, else 0; ``num_epochs`` run in one ``iter()`` (:meth:`EpochClock.advance`); a
restore takes the saved ``(epoch, first)``. :func:`set_graph_epoch` reaches every :class:`EpochNode` by
walking ``source`` links (torchdata's convention), never by listing node classes.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any, TypeVar

from torchdata.nodes import BaseNode

from cpdata.errors import check_int

__all__ = ["EpochClock", "EpochNode", "check_epoch", "check_num_epochs", "graph_nodes", "set_graph_epoch", "upstream"]

T = TypeVar("T")


def check_epoch(epoch: Any, what: str = "epoch") -> int:
    """``epoch`` as an int; ``ValueError`` naming it unless it is an int >= 0."""
    return check_int(what, epoch, min=0)


def check_num_epochs(num_epochs: Any) -> int | None:
    """``num_epochs`` (epochs per ``iter()``); ``ValueError`` unless an int >= 1 or None (one epoch per ``iter()``)."""
    return check_int("num_epochs", num_epochs, min=1, optional=True, fix=" (None: one epoch per iter())")


class EpochClock:
    """The ``epoch`` being served and the ``first`` epoch of the current ``iter()`` (module docstring)."""

    __slots__ = ("epoch", "first", "started", "_next")

    def __init__(self) -> None:
        self.epoch = 0
        self.first = 0
        self.started = False  # whether an epoch was started or restored
        self._next: int | None = None

    def set(self, epoch: int) -> None:
        """The next fresh start is ``epoch`` (as ``DistributedSampler.set_epoch``)."""
        self._next = check_epoch(epoch)

    def start(self) -> int:
        """A fresh ``reset()``: the epoch :meth:`set` named, else the next one; returns it."""
        if self._next is not None:
            self.epoch, self._next = self._next, None
        elif self.started:
            self.epoch += 1
        self.first, self.started = self.epoch, True
        return self.epoch

    def restore(self, epoch: Any, first: Any = None) -> int:
        """A restore: a saved ``epoch`` (and ``first``, default the same), checked; returns the epoch."""
        epoch = check_epoch(epoch, "the saved epoch")
        first = epoch if first is None else check_epoch(first, "the saved first epoch")
        if first > epoch:
            raise ValueError(f"the saved state has first_epoch={first} > epoch={epoch}; it is not a state of this node")
        self.epoch, self.first, self._next, self.started = epoch, first, None, True
        return epoch

    def advance(self, num_epochs: int | None) -> bool:
        """At an epoch's end: go on to the next and return True while fewer than ``num_epochs`` (None: one)
        have run in this ``iter()``; False after the last."""
        if self.epoch + 1 - self.first >= (num_epochs or 1):
            return False
        self.epoch += 1
        return True


class EpochNode(BaseNode[T]):
    """A torchdata node with epochs: its count lives in :attr:`epoch_clock` (the one :class:`EpochClock`)."""

    def __init__(self) -> None:
        super().__init__()
        self.epoch_clock = EpochClock()

    @property
    def epoch(self) -> int:
        """The epoch being served (0-based; counts on across ``iter()`` calls and restores)."""
        return self.epoch_clock.epoch

    def set_epoch(self, epoch: int) -> None:
        """Make the next fresh ``reset()`` start epoch ``epoch`` (as ``DistributedSampler.set_epoch``)."""
        self.epoch_clock.set(epoch)


def upstream(obj: Any, depth: int = 32) -> Iterator[Any]:
    """``obj`` and what it reads from, following ``source`` links (torchdata's convention), ``depth`` at most."""
    seen: set[int] = set()
    while obj is not None and depth and id(obj) not in seen:
        seen.add(id(obj))
        yield obj
        obj, depth = getattr(obj, "source", None), depth - 1


def graph_nodes(node: Any) -> Iterator[BaseNode]:
    """``node`` and the nodes upstream of it (:func:`upstream` up to the first that is not a node)."""
    return itertools.takewhile(lambda n: isinstance(n, BaseNode), upstream(node))


def set_graph_epoch(root: Any, epoch: int) -> int:
    """Make every :class:`EpochNode` of ``root``'s graph start ``epoch`` next; returns how many were reached."""
    epoch = check_epoch(epoch)
    nodes = [node for node in graph_nodes(root) if isinstance(node, EpochNode)]
    for node in nodes:
        node.set_epoch(epoch)
    return len(nodes)
