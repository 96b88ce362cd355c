"""Build the worker pipeline for one CP rank as a ``torchdata.nodes`` graph.

::

    Documents -> Pack -> Collate -> ShardForRank -> Prefetcher -> PinMemory (CUDA only) -> Loader
    (DP shard)   plans   B plans    this rank's      background    page-locked
                         + metadata tokens + layout  thread

Every CP rank of a DP group builds the same graph with its own ``cp_rank``:
the documents are sharded by DP rank only, so the ranks pack identically and
each gathers just its own tokens. ``Loader.state_dict()`` captures the whole
graph (documents read, packer carry, position); restoring it under another
``cp_size``, layout, capacity, ``batch_size`` or ``qkv_format`` raises
``ValueError``.

torchdata 0.11's ``Loader`` and its iterator reference each other, so an
abandoned loader keeps its prefetch and pin threads until cyclic GC; use
:func:`closing_loader` (or call :func:`close_loader`) to stop them at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

from torchdata.nodes import BaseNode, Loader, Prefetcher

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
from cpdata.nodes.pin import maybe_pin
from cpdata.nodes.scheduled import ScheduledPacks
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
    "shard_graph",
]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GraphOptions:
    """What every CP rank of a DP group shares: the graph up to :class:`~cpdata.nodes.collate.Collate`.

    The fields are :func:`build_loader`'s keywords of the same names (documented there); ``tile`` joins
    the layout string (``layout="tiled", tile=256`` -> ``"tiled:256"``,
    :func:`cpdata.layout.maps.layout_spec`), so every node downstream sees one layout string.
    """

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


def shard_graph(
    source: Any,
    options: GraphOptions,
    *,
    worker: tuple[int, int] = (0, 1),
    packs: ScheduledPacks | WindowedPacks | None = None,
) -> Collate:
    """Documents -> Pack -> Collate (or ScheduledPacks -> Collate): the part every CP rank of a DP group shares.

    ``worker`` (``(worker_id, num_workers)``, a :class:`SchedulePlan` only): that worker's share of the
    packs; ``packs`` reuses a :class:`ScheduledPacks` / :class:`WindowedPacks` built with the same options.
    """
    o, plan, data = options, options.plan, options.data
    plans: BaseNode
    if packs is not None:
        plans = packs.with_worker(worker)
    elif isinstance(plan, SchedulePlan) and plan.window is not None:
        plans = WindowedPacks.for_graph(source, plan.window, window=None, lengths=plan.lengths,
            shuffle=data.shuffle, capacity=o.capacity, layout=o.layout, cp_size=o.cp_size, dp_rank=data.dp_rank,
            dp_size=data.dp_size, micro_batches=plan.micro_batches, schedule=plan.kind, cost=plan.cost,
            max_delay=plan.max_delay, algorithm=plan.algorithm, overflow=plan.overflow, seed=data.seed,
            tail=plan.tail, num_epochs=data.epochs, vocab_size=data.vocab_size, worker=worker,
            labels_alignment=data.labels_alignment)  # fmt: skip
    elif isinstance(plan, SchedulePlan):
        plans = ScheduledPacks(
            source, capacity=o.capacity, layout=o.layout, cp_size=o.cp_size, dp_rank=data.dp_rank,
            dp_size=data.dp_size, micro_batches=plan.micro_batches, schedule=plan.kind, cost=plan.cost,
            max_delay=plan.max_delay, algorithm=plan.algorithm, overflow=plan.overflow, seed=data.seed,
            shuffle=data.shuffle, num_epochs=data.epochs, tail=plan.tail, lengths=plan.lengths,
            vocab_size=data.vocab_size, worker=worker, labels_alignment=data.labels_alignment,
        )  # fmt: skip
    else:
        docs = Documents(
            source, dp_rank=data.dp_rank, dp_size=data.dp_size, vocab_size=data.vocab_size,
            labels_alignment=data.labels_alignment, shuffle=data.shuffle, seed=data.seed, num_epochs=data.epochs,
            shuffle_buffer=plan.shuffle_buffer,
        )  # fmt: skip
        pack_kw: dict[str, Any] = {} if plan.window is None else {"window": plan.window}
        plans = Pack(
            docs, capacity=o.capacity, layout=o.layout, cp_size=o.cp_size, algorithm=plan.algorithm,
            overflow=plan.overflow, seed=data.seed, **pack_kw,
        )  # fmt: skip
    return Collate(plans, batch_size=o.batch_size, qkv_format=o.qkv_format, padding_token_id=o.padding_token_id)


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
    """The root node of one CP rank's pipeline (see the module docstring).

    Args:
        source: the documents (anything :class:`cpdata.nodes.source.Documents` accepts).
        capacity: tokens per pack.
        cp_size, cp_rank: CP group size and this rank.
        layout: a name from :data:`cpdata.layout.maps.LAYOUTS`.
        tile: ``layout="tiled"`` only: the kernel's tile (64, 128 or 256; default 128); packs are a multiple
            of ``cp_size * tile`` tokens.
        batch_size: plans per batch (rows for bshd, concatenated for thd).
        qkv_format: ``"bshd"`` or ``"thd"``.
        padding_token_id: ``input_ids`` on pads: an id in ``[0, vocab_size)``
            (a tokenizer without a pad token can use its EOS id).
        plan: :class:`~cpdata.nodes.options.StreamPlan` (default: pack documents as they stream) or
            :class:`~cpdata.nodes.options.SchedulePlan` (a global schedule: equal steps per DP rank).
        data: :class:`~cpdata.nodes.options.DataPolicy`: DP rank and size, seed, shuffle, epochs,
            vocabulary, labels alignment.
        delivery: :class:`~cpdata.nodes.options.Delivery`: prefetch (default 2), pinning, shard blocks,
            the K/V exchange plan; none of it is in the saved state.
        removed: the keywords of cpdata 0.3, each refused with the record field that replaces it
            (:data:`cpdata.nodes.options.RENAMED`).
    """
    refuse_keywords("build_node", removed, ENTRY_KEYWORDS)
    check_records(delivery=delivery)
    options = GraphOptions(capacity=capacity, cp_size=cp_size, layout=layout, tile=tile, batch_size=batch_size,
                           qkv_format=qkv_format, padding_token_id=padding_token_id, plan=plan, data=data)  # fmt: skip
    collated = shard_graph(source, options)
    node: BaseNode = ShardForRank(collated, cp_size=cp_size, cp_rank=cp_rank, layout=options.layout,
                                  block_size=delivery.block_size, kv_exchange=delivery.kv_exchange)  # fmt: skip
    prefetch = 2 if delivery.prefetch is None else delivery.prefetch
    if prefetch:
        node = Prefetcher(node, prefetch_factor=prefetch)
    return maybe_pin(node, pin_memory=delivery.pin_memory)


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
    """A ``torchdata.nodes.Loader`` (:class:`ResumableLoader`) over :func:`build_node` (same keyword arguments).

    ``restart_on_stop_iteration=True`` (torchdata's default) starts a new epoch
    when ``iter()`` is called on a finished loader, also right after restoring a
    state saved at the end of an epoch.
    """
    refuse_keywords("build_loader", removed, (*ENTRY_KEYWORDS, "restart_on_stop_iteration"))
    root = build_node(source, capacity=capacity, cp_size=cp_size, cp_rank=cp_rank, layout=layout, tile=tile,
                      batch_size=batch_size, qkv_format=qkv_format, padding_token_id=padding_token_id, plan=plan,
                      data=data, delivery=delivery)  # fmt: skip
    return ResumableLoader(root, restart_on_stop_iteration=restart_on_stop_iteration)


class ResumableLoader(Loader):
    """torchdata's ``Loader`` with one fix: a loaded state is never skipped.

    In torchdata 0.11, ``state_dict()`` before the first ``iter()`` creates an
    iterator and marks it "already started", so a ``load_state_dict()`` that
    follows (the order ``torch.distributed.checkpoint`` uses) is ignored by the
    next ``iter()``: the epoch replays from its start and the state then lands
    on the epoch after. Loading a state clears that mark.
    """

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._iter_for_state_dict = False
        super().load_state_dict(state_dict)


def close_loader(loader: Loader) -> None:
    """Stop the loader's background threads now and break the Loader <-> iterator cycle.

    Safe to call twice. Iterating the loader again starts a fresh epoch (its
    ``iter()`` resets the graph, which restarts the threads).
    """
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
