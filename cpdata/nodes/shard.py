"""``ShardForRank`` node: one CP rank's tokens of each collated batch, plus its layout.

The node pulls a block of batches, does their small per-batch array math at once
(:func:`cpdata.worker.shard_block.prepare_block`: stream and layout run tables, causal work, digest,
``info``), then serves them one by one; only then are the rank's row and inverse map written and its
tokens gathered (:func:`cpdata.worker.collate.fill_rank`), never the full pack. ``stream_len`` is ``S``
for bshd and ``B*S`` for thd. Layouts whose map does not depend on the documents (found by probing
:func:`~cpdata.layout.maps.rank_indices`, never by name) are computed once per shape; with bshd and
``B > 1`` only those are possible (``ValueError`` otherwise).

Block size trade-off: a block's plans stay alive and its first batch waits for the block's math, but the
per-batch numpy calls and the source's state read run once per block; the output never depends on it
(measurements: docs/architecture.md). Cost per batch and rank beyond its tokens: O(stream_len).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from cpdata.errors import check_bool, check_int, is_int
from cpdata.layout.exchange import ExchangePlan, exchange_plan_of_inverse
from cpdata.layout.maps import alignment, check_layout, node_size_of, rank_indices
from cpdata.layout.shard_layout import ShardLayout
from cpdata.nodes.collate import Collate
from cpdata.nodes.epochs import upstream
from cpdata.nodes.source_kinds import document_sources_of
from cpdata.nodes.state_version import VersionedState
from cpdata.packing.records import PackingConfig
from cpdata.worker.batch import BatchBuffer, ShardedBatch
from cpdata.worker.buffer_spans import BufferPlan, buffer_plan
from cpdata.worker.collate import CollatedPack, SpecKey, fill_rank, rank_spec_key, spec_items
from cpdata.worker.shard_block import BlockItem, check_rows, prepare_block

__all__ = ["BLOCK_TOKENS", "DEFAULT_BLOCK_SIZE", "MAX_BLOCK_SIZE", "ShardForRank", "layout_depends_on_documents"]

_I64 = np.dtype(np.int64)

DEFAULT_BLOCK_SIZE = 16
"""Batches per block at least, by default."""
BLOCK_TOKENS = 1 << 19
"""By default a block also grows until its batches hold this many pack tokens (short packs)..."""
MAX_BLOCK_SIZE = 64
"""... up to this many batches."""


@functools.lru_cache(maxsize=64)
def layout_depends_on_documents(layout: str, cp_size: int) -> bool:
    """Whether ``rank_indices(layout, cp_size, ...)`` changes with the slot lengths (five probes on a small pack)."""
    d, pack_multiple = alignment(layout, cp_size)
    pack_len = 8 * d * pack_multiple
    half = pack_len // 2  # a multiple of d
    probes = ([], [half], [d, 3 * d], [d, half - d, half], [pack_len - d, d])
    rows = [rank_indices(layout, cp_size, lens, pack_len) for lens in probes]
    return any(not np.array_equal(rows[0], r) for r in rows[1:])


@functools.lru_cache(maxsize=256)
def _buffer_plan(spec_key: SpecKey, stream_len: int) -> BufferPlan:
    """The buffer of a rank's batch: the tensors of ``spec_key``, its row int64 ``[L]`` and the inverse map
    int64 ``[stream_len]`` (cached per shape)."""
    local = spec_key[0][-1]
    maps = (("local_token_global_indices", ((local,), _I64)), ("gather_index", ((stream_len,), _I64)))
    return buffer_plan(spec_items(*spec_key), maps)


@functools.lru_cache(maxsize=64)
def _layout_record(stream_len: int, row_shape: tuple[int, int] | None, cp_size: int, cp_rank: int) -> ShardLayout:
    """The :class:`ShardLayout` of a batch without its digest and index maps (per shape and rank, shared)."""
    return ShardLayout(original_seq_len=None, padded_seq_len=stream_len, input_row_shape=row_shape,
                       cp_size=cp_size, cp_rank=cp_rank)  # fmt: skip


def _check_dealt_node_size(node: Any, layout: str, cp_size: int) -> None:
    """``ValueError`` where a world step packer upstream of ``node`` deals its packs under another node size than
    ``layout``'s: a spread document's cut depends on it (:func:`cpdata.layout.spread.spread_chunks`), so the
    packs' owners would lay out other runs than those the deal balanced, or overfill a rank."""
    for stage in upstream(node):
        config = getattr(stage, "config", None)
        if isinstance(config, PackingConfig) and config.world_step > 1:
            dealt, mine = node_size_of(config.layout, config.cp_size), node_size_of(layout, cp_size)
            if dealt != mine:
                raise ValueError(f"the packs are dealt by world steps under layout {config.layout!r} ({dealt} ranks "
                                 f"a node) and sharded under layout {layout!r} ({mine}); a spread document's cut "
                                 f"depends on the node size: shard with layout={config.layout!r}")  # fmt: skip
            return


class ShardForRank(VersionedState, BaseNode[Any]):
    """Turn each :class:`CollatedPack` into this rank's :class:`ShardedBatch`.

    Args:
        all_ranks: emit a tuple of every rank's batch instead (tests, single-process simulation).
        block_size: batches pulled and prepared at once; None: sized by tokens (:data:`DEFAULT_BLOCK_SIZE`,
            :data:`BLOCK_TOKENS`, :data:`MAX_BLOCK_SIZE`).
        kv_exchange: also build each batch's K/V exchange plan (``batch.layout.kv_exchange``,
            :func:`cpdata.layout.exchange.exchange_plan_of_inverse`): one pass over the inverse map.

    State: the source's state before the current block, the batches of the block served (``"skip"``) and
    their plan digests, a version and ``(cp_size, layout)``. A restore pulls the block again and skips the
    served batches without gathering them, refusing one whose digest changed; any ``cp_rank`` and block size
    resumes any other's. A source raising mid-block has the batches before it served first; a bad batch
    raises when it would have been served.
    """

    SKIP_KEY = "skip"
    DIGESTS_KEY = "served_digests"
    VERSION = 2

    def __init__(
        self,
        collate_node: BaseNode[CollatedPack],
        *,
        cp_size: int,
        cp_rank: int,
        layout: str,
        all_ranks: bool = False,
        block_size: int | None = None,
        kv_exchange: bool = False,
    ) -> None:
        super().__init__()
        check_layout(layout, cp_size)
        if not is_int(cp_rank) or not 0 <= cp_rank < cp_size:
            raise ValueError(f"cp_rank must be an int in [0, cp_size={cp_size}), got cp_rank={cp_rank!r}")
        self.source = collate_node
        self.cp_size = int(cp_size)
        self.cp_rank = int(cp_rank)
        self.layout = layout
        self.all_ranks = all_ranks
        fix = " (batches prepared at once; None: sized by tokens)"
        self.block_size = check_int("block_size", block_size, min=1, optional=True, fix=fix)
        check_bool("kv_exchange", kv_exchange)
        self.kv_exchange = kv_exchange
        self._dynamic = layout_depends_on_documents(layout, self.cp_size)
        self._sources = document_sources_of(collate_node)  # a mix: info["doc_source"] names each slot's source
        if isinstance(collate_node, Collate):
            check_rows(layout, self.cp_size, self._dynamic, collate_node.batch_size, collate_node.qkv_format)
        _check_dealt_node_size(collate_node, layout, self.cp_size)
        self._clear(None, [])

    def _clear(self, before: dict[str, Any] | None, served: list[int]) -> None:
        """No block in hand; the next one starts from the source state ``before`` (None: ask the source)
        and skips the ``len(served)`` batches whose digests are ``served``."""
        self._before = before  # the source's state before the current (or next) block
        self._items: list[BlockItem | CollatedPack | None] = []  # a CollatedPack: prepared when served
        self._served = len(served)
        self._digests = served  # of the block's served batches (-1: the batch raised)
        self._error: Exception | None = None  # raised by the source after the block's batches
        self._ended = False  # the source stopped after the block's batches

    def _config(self) -> dict[str, Any]:
        return {"cp_size": self.cp_size, "layout": self.layout}

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is None:
            self.source.reset(None)
            self._clear(None, [])
            return
        self.check_saved(initial_state, self._config())
        skip, served = initial_state.get(self.SKIP_KEY), initial_state.get(self.DIGESTS_KEY)
        if not isinstance(served, list) or skip != len(served) or not all(isinstance(d, int) for d in served):
            raise ValueError(f"ShardForRank state has skip={skip!r} and {self.DIGESTS_KEY}={served!r}; expected the "
                             "batches served from the saved block and their digests (a state written by "
                             "ShardForRank.state_dict())")  # fmt: skip
        before = initial_state[self.SOURCE_KEY]
        self.source.reset(before)
        self._clear(before, list(served))

    def get_state(self) -> dict[str, Any]:
        if self._before is None:  # between blocks after a reset or an error: the source's state now
            self._before = self.source.state_dict()
        return {**self.state_header(self._config()), self.SOURCE_KEY: self._before,
                self.SKIP_KEY: self._served, self.DIGESTS_KEY: list(self._digests)}  # fmt: skip

    def _pull_block(self) -> None:
        """Read the source's state once (unless restored), pull a block of batches and prepare them (restored:
        the first ``self._served`` are skipped, their digests checked)."""
        before = self.source.state_dict() if self._before is None else self._before
        batches: list[CollatedPack] = []
        error, ended, tokens = None, False, 0
        try:
            # restored: at least the served ones, whatever the block size that served them
            while len(batches) < self._served or not self._full(len(batches), tokens):
                batch = next(self.source)
                batches.append(batch)
                tokens += len(batch.plans) * batch.pack_len
        except StopIteration:
            ended = True
        except Exception as exc:  # raised after the batches pulled before it are served
            error = exc
        if len(batches) < self._served and error is None:  # (a source raising there is not the saved one either)
            raise ValueError(
                f"the ShardForRank state had served {self._served} batches of its block, but the source ends "
                f"after {len(batches)} from the saved position; restore onto the same source"
            )
        served = self._digests[: len(batches)]
        try:
            items: list[BlockItem | CollatedPack] = list(prepare_block(batches, self.layout, self.cp_size,
                                                                       self._dynamic, self._sources))  # fmt: skip
        except Exception:  # some batch is bad: each is prepared alone when served, to raise at the bad one
            items = list(batches)
        for i, saved in enumerate(served):
            if self._digest(items[i]) != saved:
                raise ValueError(
                    f"batch {i} of the saved block has another plan digest now ({self._digest(items[i])} != "
                    f"{saved}): the source changed since the state was saved; restore onto the same source"
                )
        self._clear(before, served)
        self._error, self._ended = error, ended
        self._items = [None] * len(served) + items[len(served) :]

    def _full(self, batches: int, tokens: int) -> bool:
        """Whether a block of ``batches`` batches holding ``tokens`` pack tokens is complete."""
        if self.block_size is not None:
            return batches >= self.block_size
        return batches >= MAX_BLOCK_SIZE or (batches >= DEFAULT_BLOCK_SIZE and tokens >= BLOCK_TOKENS)

    def _prepared(self, item: BlockItem | CollatedPack) -> BlockItem:
        """``item`` prepared: a batch its block could not prepare is prepared alone (raising if it is bad)."""
        if isinstance(item, BlockItem):
            return item
        return prepare_block([item], self.layout, self.cp_size, self._dynamic, self._sources)[0]

    def _digest(self, item: BlockItem | CollatedPack) -> int:
        """The item's plan digest, -1 for a batch that raises."""
        try:
            return self._prepared(item).info["digest"]
        except Exception:  # noqa: BLE001  (it raised when it was served too)
            return -1

    def next(self) -> ShardedBatch | tuple[ShardedBatch, ...]:
        while self._served >= len(self._items):  # (a restored state may skip a whole block)
            if self._error is not None:  # the block is served: raise what the source raised after it, start afresh
                error = self._error
                self._clear(None, [])
                raise error
            if self._ended:
                raise StopIteration
            if self._items:  # the next block starts from the source's state now
                self._clear(None, [])
            self._pull_block()
        item = self._items[self._served]
        self._items[self._served] = None  # the served batch is the consumer's
        self._served += 1
        try:
            item = self._prepared(item)
        except Exception:
            self._digests.append(-1)
            raise
        self._digests.append(item.info["digest"])
        return self._serve(item)

    def _serve(self, item: BlockItem) -> ShardedBatch | tuple[ShardedBatch, ...]:
        """This rank's batch of ``item``; every rank's with ``all_ranks``."""
        spec_key = rank_spec_key(item.stream, item.stream_len // self.cp_size, item.batch.qkv_format)
        plan = _buffer_plan(spec_key, item.stream_len)
        if not self.all_ranks:
            return self._serve_rank(item, plan, self.cp_rank, None, None)[0]
        out, inverse, exchange = [], None, None
        for r in range(self.cp_size):
            batch, inverse, exchange = self._serve_rank(item, plan, r, inverse, exchange)
            out.append(batch)
        return tuple(out)

    def _serve_rank(self, item: BlockItem, plan: BufferPlan, r: int, inverse: np.ndarray | None,
                    exchange: ExchangePlan | None) -> tuple[ShardedBatch, np.ndarray, ExchangePlan | None]:  # fmt: skip
        """Rank ``r``'s batch written into its one buffer (its row, the inverse map, tokens, metadata, its part
        of the exchange plan), reusing ``inverse`` and ``exchange`` when given: ``(batch, inverse, exchange)``."""
        buf = BatchBuffer(plan)
        rows_r, gather = buf.maps["local_token_global_indices"], buf.maps["gather_index"]
        if item.fixed is not None:
            rows_r[...], gather[...] = item.fixed[0][r], item.fixed[1]
        else:
            assert item.table is not None
            item.table.row(r, out=rows_r)
            if inverse is None:
                item.table.inverse(out=gather)
            else:
                gather[...] = inverse
        stream, batch = item.stream, item.batch
        fill_rank(stream, rows_r, batch.qkv_format, buf.arrays, increasing=True)
        row_shape = batch.row_shape if batch.qkv_format == "thd" else None
        layout = _layout_record(item.stream_len, row_shape, self.cp_size, r)  # the index maps are the buffer's
        fields = {"digest": item.info["digest"]}
        if self.kv_exchange:
            if exchange is None:
                n_rows = stream.rows if batch.qkv_format == "bshd" else 1
                exchange = exchange_plan_of_inverse(gather, self.cp_size, stream.slot_starts, n_rows=n_rows,
                                                    checked=True, real_ends=stream.real_ends)  # fmt: skip
            fields["kv_exchange"] = exchange.rank(r)
        return buf.batch(layout=layout, info=item.info, fields=fields), gather, exchange
