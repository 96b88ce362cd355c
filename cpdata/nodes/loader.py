"""Build the worker pipeline for one CP rank as a ``torchdata.nodes`` graph.

::

    Documents -> Pack -> Collate -> ShardForRank -> Prefetcher -> PinMemory (CUDA only) -> Loader
    (DP shard)   plans   B plans    this rank's      background    page-locked
                         + metadata tokens + layout  thread

Every CP rank of a DP group builds the same graph with its own ``cp_rank`` (documents are sharded by DP
rank only). ``Loader.state_dict()`` captures the whole graph; restoring it under another configuration
raises ``ValueError``. torchdata 0.11's ``Loader`` and its iterator reference each other, so use
:func:`closing_loader` (or :func:`close_loader`) to stop an abandoned loader's threads at once.

The graph's tail, :func:`delivered`, prefetches and pins (:func:`maybe_pin`: page-locked host memory for
asynchronous host-to-device copies when a CUDA device can use it; torchdata's ``PinMemory`` raises on
CPU-only builds, so the decision is made once, there).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Iterator
from typing import Any, TypeVar

import torch
from torchdata.nodes import BaseNode, Loader, PinMemory, Prefetcher

from cpdata.layout.maps import layout_spec
from cpdata.nodes.collate import Collate
from cpdata.nodes.epochs import graph_nodes
from cpdata.nodes.options import (
    ENTRY_KEYWORDS,
    DataPolicy,
    Delivery,
    PlanChoice,
    SchedulePlan,
    StreamPlan,
    check_records,
    refuse_keywords,
)
from cpdata.nodes.pack import Pack
from cpdata.nodes.scheduled import ScheduledPacks
from cpdata.nodes.served import ServedPacks
from cpdata.nodes.shard import ShardForRank
from cpdata.nodes.source import Documents
from cpdata.nodes.windowed import WindowedPacks
from cpdata.worker.collate import check_padding_token_id

__all__ = [
    "GraphOptions",
    "ResumableLoader",
    "build_loader",
    "build_node",
    "close_loader",
    "closing_loader",
    "delivered",
    "maybe_pin",
    "rank_node",
    "shard_graph",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GraphOptions:
    """What every CP rank of a DP group shares: :func:`build_loader`'s keywords up to ``Collate``; ``tile``
    joins the layout string (``"tiled:256"``, :func:`cpdata.layout.maps.layout_spec`)."""

    capacity: int
    cp_size: int
    layout: str
    tile: int | None = None
    batch_size: int = 1
    qkv_format: str = "bshd"
    padding_token_id: int = 0
    plan: PlanChoice = StreamPlan()
    data: DataPolicy = DataPolicy()

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", layout_spec(self.layout, self.tile))
        check_records(plan=self.plan, data=self.data)
        if isinstance(self.plan, SchedulePlan) and self.plan.window is not None and self.data.shuffle:
            raise ValueError("SchedulePlan.window plans each window of the stream in stream order: shuffle the "
                             "stream upstream instead of DataPolicy(shuffle=True), or give the lengths and plan "
                             "without a window")  # fmt: skip
        check_padding_token_id(self.padding_token_id, self.data.vocab_size)


def shard_graph(source: Any, options: GraphOptions, *, packs: ServedPacks | None = None) -> Collate:
    """Documents -> Pack -> Collate (or planned packs -> Collate): what every CP rank of a DP group shares.

    ``packs``: planned packs made with the same options (a dataloader worker's share) instead of planning.
    """
    o, plan, data = options, options.plan, options.data
    plans: BaseNode
    if packs is not None:
        plans = packs
    elif isinstance(plan, SchedulePlan):  # (the records refuse shuffle and lengths with a window)
        plans = ScheduledPacks(source, options) if plan.window is None else WindowedPacks(source, options)
    else:
        docs = Documents(
            source, dp_rank=data.dp_rank, dp_size=data.dp_size, vocab_size=data.vocab_size,
            labels_alignment=data.labels_alignment, shuffle=data.shuffle, seed=data.seed, num_epochs=data.epochs,
            shuffle_buffer=plan.shuffle_buffer,
        )  # fmt: skip
        plans = Pack(docs, capacity=o.capacity, layout=o.layout, cp_size=o.cp_size, algorithm=plan.algorithm,
                     overflow=plan.overflow, seed=data.seed, window=plan.window,
                     world_step=plan.world_step)  # fmt: skip
    return Collate(plans, batch_size=o.batch_size, qkv_format=o.qkv_format, padding_token_id=o.padding_token_id)


def rank_node(collated: BaseNode, options: GraphOptions, cp_rank: int, delivery: Delivery) -> ShardForRank:
    """This CP rank's :class:`ShardForRank` over ``collated`` (``delivery``: block size, K/V exchange plan)."""
    return ShardForRank(collated, cp_size=options.cp_size, cp_rank=cp_rank, layout=options.layout,
                        block_size=delivery.block_size, kv_exchange=delivery.kv_exchange)  # fmt: skip


@functools.cache
def _log_once(message: str) -> None:
    logger.info(message)


def maybe_pin(node: BaseNode[T], *, pin_memory: bool | None) -> BaseNode[T]:
    """``PinMemory(node)`` (one thread calling each item's ``pin_memory()``; resume stays exact) when CUDA is
    available and ``pin_memory`` is True or None ("pin when CUDA is available"), else ``node``; ``True``
    without CUDA falls back to no pinning, logged once."""
    if pin_memory is not None and not pin_memory:
        return node
    if not torch.cuda.is_available():
        if pin_memory is None:
            _log_once("CUDA is not available; not pinning batches")
        else:
            _log_once("pin_memory=True but CUDA is not available; batches stay in pageable memory")
        return node
    return PinMemory(node)


def delivered(node: BaseNode, delivery: Delivery) -> BaseNode:
    """``node`` with ``delivery.prefetch`` batches prepared ahead in a thread (None: 2) and pinned as
    ``delivery.pin_memory`` says (:func:`maybe_pin`): the tail of every loader's graph."""
    prefetch = 2 if delivery.prefetch is None else delivery.prefetch
    if prefetch:
        node = Prefetcher(node, prefetch_factor=prefetch)
    return maybe_pin(node, pin_memory=delivery.pin_memory)


def build_node(
    source: Any,
    *,
    capacity: int,
    cp_size: int,
    cp_rank: int,
    layout: str,
    tile: int | None = None,
    batch_size: int = 1,
    qkv_format: str = "bshd",
    padding_token_id: int = 0,
    plan: PlanChoice = StreamPlan(),
    data: DataPolicy = DataPolicy(),
    delivery: Delivery = Delivery(),
    **removed: Any,
) -> BaseNode:
    """The root node of one CP rank's pipeline over ``source`` (anything ``Documents`` accepts).

    ``layout``: one of :data:`cpdata.layout.maps.LAYOUTS` (``tile``: ``"tiled"``'s, 64, 128 or 256);
    ``batch_size``: plans per batch; ``padding_token_id``: ``input_ids`` on pads, in ``[0, vocab_size)``;
    ``plan``, ``data``, ``delivery``: :mod:`cpdata.nodes.options` (``Delivery.prefetch`` defaults to 2 here);
    a keyword of 0.3 is refused naming its record field (:data:`~cpdata.nodes.options.RENAMED`).
    """
    refuse_keywords("build_node", removed, ENTRY_KEYWORDS)
    check_records(delivery=delivery)
    options = GraphOptions(capacity=capacity, cp_size=cp_size, layout=layout, tile=tile, batch_size=batch_size,
                           qkv_format=qkv_format, padding_token_id=padding_token_id, plan=plan, data=data)  # fmt: skip
    return delivered(rank_node(shard_graph(source, options), options, cp_rank, delivery), delivery)


def build_loader(
    source: Any,
    *,
    capacity: int,
    cp_size: int,
    cp_rank: int,
    layout: str,
    tile: int | None = None,
    batch_size: int = 1,
    qkv_format: str = "bshd",
    padding_token_id: int = 0,
    plan: PlanChoice = StreamPlan(),
    data: DataPolicy = DataPolicy(),
    delivery: Delivery = Delivery(),
    restart_on_stop_iteration: bool = True,
    **removed: Any,
) -> ResumableLoader:
    """A :class:`ResumableLoader` over :func:`build_node` (same keywords); ``restart_on_stop_iteration``
    (torchdata's default) starts a new epoch when ``iter()`` is called on a finished loader."""
    refuse_keywords("build_loader", removed, (*ENTRY_KEYWORDS, "restart_on_stop_iteration"))
    root = build_node(source, capacity=capacity, cp_size=cp_size, cp_rank=cp_rank, layout=layout, tile=tile,
                      batch_size=batch_size, qkv_format=qkv_format, padding_token_id=padding_token_id, plan=plan,
                      data=data, delivery=delivery)  # fmt: skip
    return ResumableLoader(root, restart_on_stop_iteration=restart_on_stop_iteration)


class ResumableLoader(Loader):
    """torchdata's ``Loader`` with one fix: a loaded state is never skipped (in torchdata 0.11 a
    ``state_dict()`` before the first ``iter()`` marks the iterator started, so a ``load_state_dict()`` after
    it, ``torch.distributed.checkpoint``'s order, was ignored)."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._iter_for_state_dict = False
        super().load_state_dict(state_dict)


def close_loader(loader: Loader) -> None:
    """Stop the loader's background threads now and break the Loader <-> iterator cycle (idempotent;
    iterating again starts a fresh epoch)."""
    loader._it = None
    for node in graph_nodes(loader.root):
        shutdown = getattr(getattr(node, "_it", None), "_shutdown", None)  # Prefetcher / PinMemory threads
        if callable(shutdown):
            shutdown()


@contextlib.contextmanager
def closing_loader(loader: Loader) -> Iterator[Loader]:
    """``with closing_loader(build_loader(...)) as loader: ...``; threads stop on exit."""
    try:
        yield loader
    finally:
        close_loader(loader)
