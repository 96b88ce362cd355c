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
import difflib
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torchdata.nodes import BaseNode, Loader, Prefetcher

from cpdata.layout.maps import layout_spec
from cpdata.nodes.collate import Collate
from cpdata.nodes.epochs import graph_nodes
from cpdata.nodes.pack import Pack
from cpdata.nodes.pin import maybe_pin
from cpdata.nodes.scheduled import ScheduledPacks
from cpdata.nodes.shard import ShardForRank
from cpdata.nodes.shuffle_buffer import DEFAULT_SHUFFLE_BUFFER
from cpdata.nodes.source import Documents
from cpdata.nodes.windowed import WindowedPacks
from cpdata.schedule import CostModel
from cpdata.worker.collate import check_padding_token_id
from cpdata.worker.targets import LabelsAlignment

__all__ = [
    "GraphOptions",
    "ResumableLoader",
    "build_loader",
    "build_node",
    "check_keywords",
    "close_loader",
    "closing_loader",
    "shard_graph",
]


def check_keywords(
    caller: str,
    kwargs: Mapping[str, Any],
    accepted: Callable[..., Any],
    *,
    exclude: tuple[str, ...] = ("source",),
    required: tuple[str, ...] = (),
) -> None:
    """Refuse keyword arguments that ``accepted`` does not take, naming the public ``caller``.

    ``build_loader(**kwargs)`` and ``CPDataset(**kwargs)`` forward to inner
    builders; without this check a typo would surface as
    ``shard_graph() got an unexpected keyword argument``, a function the user
    never called.

    Raises:
        TypeError: ``"{caller}() got an unexpected keyword argument 'capacty'; did you mean 'capacity'?"``,
            or ``"{caller}() is missing the keyword argument 'cp_size'"`` for a name in ``required``.
    """
    names = [n for n in inspect.signature(accepted).parameters if n not in exclude]
    for name in kwargs:
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"it takes {', '.join(names)}"
            raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}; {hint}")
    for name in required:
        if name not in kwargs:
            raise TypeError(f"{caller}() is missing the keyword argument {name!r}")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GraphOptions:
    """The options :func:`shard_graph` and :func:`build_node` share, defined once (documented in
    :func:`build_node`); both functions' signatures list these fields (``inspect.signature``, ``help``)."""

    capacity: int
    cp_size: int
    layout: str
    algorithm: str = "bfd"
    overflow: str | None = None
    padding_token_id: int = 0
    dp_rank: int = 0
    dp_size: int = 1
    seed: int = 0
    batch_size: int = 1
    qkv_format: str = "bshd"
    vocab_size: int | None = None
    window: int | None = None
    labels_alignment: LabelsAlignment | None = None
    shuffle: bool = False
    num_epochs: int | None = None
    shuffle_buffer: int = DEFAULT_SHUFFLE_BUFFER
    micro_batches: int = 1
    schedule: str | None = None
    max_delay: int = 0
    cost: CostModel | None = None
    lengths: Any = None
    tail: str = "pad"
    schedule_window: int | None = None
    tile: int | None = None

    def __post_init__(self) -> None:
        """``tile`` joins the layout string (``layout="tiled", tile=256`` -> ``"tiled:256"``,
        :func:`cpdata.layout.maps.layout_spec`): every node downstream sees one layout string."""
        object.__setattr__(self, "layout", layout_spec(self.layout, self.tile))

    @classmethod
    def of(cls, caller: str, options: Mapping[str, Any]) -> GraphOptions:
        """``options`` checked as ``caller(**options)`` would check them: Python's own ``TypeError`` for an
        unknown or missing keyword, naming ``caller``."""
        try:
            return cls(**options)
        except TypeError as exc:
            prefix = f"{cls.__name__}.__init__()"
            if not str(exc).startswith(prefix):
                raise
            raise TypeError(f"{caller}(){str(exc)[len(prefix):]}") from None


def _list_options(func: Callable[..., Any], after: Mapping[str, str]) -> None:
    """Give ``func(source, *, own..., **options)`` the signature it accepts: ``source``, the fields of
    :class:`GraphOptions`, and its own keywords, each after the field ``after`` names (else at the end)."""
    own = inspect.signature(func)
    source, *extra = [p for p in own.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    params = [source]
    for field in dataclasses.fields(GraphOptions):
        default = inspect.Parameter.empty if field.default is dataclasses.MISSING else field.default
        params.append(inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                        annotation=field.type))  # fmt: skip
        params += [p for p in extra if after.get(p.name) == field.name]
    func.__signature__ = own.replace(parameters=params + [p for p in extra if p.name not in after])  # type: ignore[attr-defined]


def shard_graph(
    source: Any,
    *,
    worker: tuple[int, int] = (0, 1),
    packs: ScheduledPacks | WindowedPacks | None = None,
    **options: Any,
) -> Collate:
    """Documents -> Pack -> Collate (or ScheduledPacks -> Collate): the part every CP rank of a DP group shares.

    ``options``: the fields of :class:`GraphOptions` (see :func:`build_node`). ``worker`` (``(worker_id,
    num_workers)``, ``schedule=`` only): that worker's share of the packs; ``packs`` reuses a
    :class:`ScheduledPacks` / :class:`WindowedPacks` built with the same arguments.
    """
    o = GraphOptions.of("shard_graph", options)
    check_padding_token_id(o.padding_token_id, o.vocab_size)
    plans: BaseNode
    if packs is not None:
        plans = packs.with_worker(worker)
    elif o.schedule_window is not None:
        plans = WindowedPacks.for_graph(source, o.schedule_window, window=o.window, lengths=o.lengths,
            shuffle=o.shuffle, capacity=o.capacity, layout=o.layout, cp_size=o.cp_size, dp_rank=o.dp_rank,
            dp_size=o.dp_size, micro_batches=o.micro_batches, schedule=o.schedule, cost=o.cost,
            max_delay=o.max_delay, algorithm=o.algorithm, overflow=o.overflow, seed=o.seed, tail=o.tail,
            num_epochs=o.num_epochs, vocab_size=o.vocab_size, worker=worker,
            labels_alignment=o.labels_alignment)  # fmt: skip
    elif o.schedule is not None:
        if o.window is not None:
            raise ValueError("window= sets the streaming packer's window; schedule= plans every document at once")
        plans = ScheduledPacks(
            source, capacity=o.capacity, layout=o.layout, cp_size=o.cp_size, dp_rank=o.dp_rank, dp_size=o.dp_size,
            micro_batches=o.micro_batches, schedule=o.schedule, cost=o.cost, max_delay=o.max_delay,
            algorithm=o.algorithm, overflow=o.overflow, seed=o.seed, shuffle=o.shuffle, num_epochs=o.num_epochs,
            tail=o.tail, lengths=o.lengths, vocab_size=o.vocab_size, worker=worker,
            labels_alignment=o.labels_alignment,
        )  # fmt: skip
    else:
        if o.micro_batches != 1 or o.cost is not None or o.max_delay or o.lengths is not None:
            raise ValueError(
                "micro_batches, cost, max_delay and lengths belong to a global schedule: pass schedule='balanced' "
                "(or 'in_order') with them, or leave them out"
            )
        docs = Documents(
            source, dp_rank=o.dp_rank, dp_size=o.dp_size, vocab_size=o.vocab_size,
            labels_alignment=o.labels_alignment, shuffle=o.shuffle, seed=o.seed, num_epochs=o.num_epochs,
            shuffle_buffer=o.shuffle_buffer,
        )  # fmt: skip
        pack_kw: dict[str, Any] = {} if o.window is None else {"window": o.window}
        plans = Pack(
            docs, capacity=o.capacity, layout=o.layout, cp_size=o.cp_size, algorithm=o.algorithm,
            overflow=o.overflow, seed=o.seed, **pack_kw,
        )  # fmt: skip
    return Collate(plans, batch_size=o.batch_size, qkv_format=o.qkv_format, padding_token_id=o.padding_token_id)


def build_node(
    source: Any,
    *,
    cp_rank: int,
    pin_memory: bool | None = None,
    prefetch: int = 2,
    block_size: int | None = None,
    kv_exchange: bool = False,
    **options: Any,
) -> BaseNode:
    """The root node of one CP rank's pipeline (see the module docstring).

    Args:
        source: the documents (anything :class:`cpdata.nodes.source.Documents` accepts).
        capacity: tokens per pack.
        cp_size, cp_rank: CP group size and this rank.
        layout: a name from :data:`cpdata.layout.maps.LAYOUTS`.
        tile: ``layout="tiled"`` only: the kernel's tile (64, 128 or 256; default 128); packs are a multiple
            of ``cp_size * tile`` tokens.
        algorithm, overflow, seed, window: packer settings (:class:`cpdata.nodes.pack.Pack`).
        padding_token_id: ``input_ids`` on pads: an id in ``[0, vocab_size)``
            (a tokenizer without a pad token can use its EOS id).
        dp_rank, dp_size: data-parallel rank and size. Without ``schedule`` each rank reads and packs
            documents ``i % dp_size == dp_rank`` as they stream (any source; epochs may differ by rank).
        micro_batches, schedule, max_delay, cost, lengths, tail: ``schedule="balanced"`` (or ``"in_order"``)
            plans every document's length first (:class:`cpdata.nodes.scheduled.ScheduledPacks`): every rank
            gets the same number of steps of ``micro_batches`` packs, cost-balanced, and reads only its own
            documents; needs ``lengths`` (default ``source.lengths``) and an indexable source. ``shuffle``
            plans each epoch over the ``(seed, epoch)`` order; ``num_epochs`` as below.
        schedule_window: with ``schedule=``, plan a stream without lengths in windows of this many documents
            (:class:`cpdata.nodes.windowed.WindowedPacks`: equal steps per DP rank, own packs only).
        batch_size: plans per batch (rows for bshd, concatenated for thd).
        qkv_format: ``"bshd"`` or ``"thd"``.
        vocab_size: token ids are checked against it when given.
        labels_alignment: ``"inputs"`` (HF, TRL, torchtune) or ``"targets"``
            (Megatron, NeMo); required when documents carry ``labels`` or a
            mask (see :mod:`cpdata.worker.targets`). Batch ``labels`` are always
            next-token targets.
        shuffle, num_epochs: document order (:class:`~cpdata.nodes.source.Documents`):
            ``shuffle=True`` draws a fresh permutation of a sequence source per
            epoch from ``(seed, epoch)`` and shuffles a stream through a buffer of
            ``shuffle_buffer`` documents (default 10,000); ``num_epochs`` passes
            per ``iter()`` (default one). ``bfd`` packs best from a mixed order.
        pin_memory: pin batches (None: when CUDA is available).
        prefetch: batches prepared ahead in a background thread (0: none).
        block_size: collated batches :class:`~cpdata.nodes.shard.ShardForRank` pulls and prepares at once
            (default None: 16 batches, more for short packs, up to 64 at 8K tokens or fewer per batch; see
            :data:`~cpdata.nodes.shard.BLOCK_TOKENS`): larger blocks share more of the per-batch layout math
            and read the graph's state less often, and keep more plans alive and delay the first batch. Not
            part of the saved state.
        kv_exchange: build each batch's K/V exchange plan on the worker (``batch.layout.kv_exchange``):
            document-causal attention (the sharder's ctx with ``document_mask=True``, the mask helpers) then
            moves only the keys each rank needs, in one all-to-all, instead of all-gathering K/V. Not part of
            the saved state.
    """
    o = GraphOptions.of("build_node", options)  # an unknown keyword first, as Python refuses it at the call
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be an int >= 0, got {prefetch!r}")
    collated = shard_graph(source, **options)
    node: BaseNode = ShardForRank(collated, cp_size=o.cp_size, cp_rank=cp_rank, layout=o.layout, block_size=block_size,
                                  kv_exchange=kv_exchange)  # fmt: skip
    if prefetch:
        node = Prefetcher(node, prefetch_factor=prefetch)
    return maybe_pin(node, pin_memory=pin_memory)


_list_options(shard_graph, {})
_list_options(build_node, {"cp_rank": "cp_size", "pin_memory": "vocab_size", "prefetch": "vocab_size",
                          "block_size": "vocab_size", "kv_exchange": "vocab_size"})  # fmt: skip


def build_loader(
    source: Any,
    *,
    capacity: int,
    cp_size: int,
    cp_rank: int,
    layout: str,
    restart_on_stop_iteration: bool = True,
    **kwargs: Any,
) -> ResumableLoader:
    """A ``torchdata.nodes.Loader`` (:class:`ResumableLoader`) over :func:`build_node` (same keyword arguments).

    ``restart_on_stop_iteration=True`` (torchdata's default) starts a new epoch
    when ``iter()`` is called on a finished loader, also right after restoring a
    state saved at the end of an epoch.
    """
    check_keywords("build_loader", kwargs, build_node)
    root = build_node(source, capacity=capacity, cp_size=cp_size, cp_rank=cp_rank, layout=layout, **kwargs)
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
