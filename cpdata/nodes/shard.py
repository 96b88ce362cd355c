"""``ShardForRank`` node: one CP rank's tokens of each collated batch, plus its layout.

The node works on blocks of batches (``block_size`` of them, or by default
at least :data:`DEFAULT_BLOCK_SIZE` and :data:`BLOCK_TOKENS` tokens): it pulls
up to ``k`` batches, does the small per-batch array math of all of them at once
(:func:`cpdata.worker.shard_block.prepare_block`: stream tables, layout run tables,
causal work, digest, ``info``), then serves them one by one; only when a
batch is served are its rank's row and inverse map written and this rank's
tokens gathered (:func:`cpdata.worker.collate.fill_rank`), never the full pack.
``stream_len`` is ``S`` for bshd (rows index columns, shared by the ``B``
rows) and ``B*S`` for thd (rows index the flat stream). The layout travels as
a :class:`~cpdata.layout.shard_layout.ShardLayout` with the inverse map precomputed.

Layouts whose map does not depend on the documents (found by asking
:func:`~cpdata.layout.maps.rank_indices` for a few different slot lengths, never
by name) are computed once per ``(cp_size, stream_len)`` and reused. With bshd and
``B > 1`` only those layouts are possible: each row would need its own map, so
a document-dependent layout raises ``ValueError`` (use ``qkv_format="thd"`` or
``batch_size=1``).

Block size trade-off (:data:`DEFAULT_BLOCK_SIZE`): ``k`` batches' plans stay
alive and the first batch of a block waits for the block's math, but the
per-batch numpy calls and the source's state read run once per block. The
output never depends on ``k``. Cost per batch and rank, beyond the rank's own
tokens: O(stream_len) for the map, its inverse, the causal work and the digest.
"""

from __future__ import annotations

import functools
from typing import Any, NoReturn

import numpy as np
from torchdata.nodes import BaseNode

from cpdata.errors import is_int
from cpdata.layout.exchange import ExchangePlan, exchange_plan_of_inverse
from cpdata.layout.maps import alignment, check_layout, rank_indices
from cpdata.layout.shard_layout import ShardLayout
from cpdata.nodes.collate import Collate
from cpdata.nodes.document_names import document_sources_of
from cpdata.nodes.state_version import check_saved_config, check_state_version
from cpdata.worker.batch import BatchBuffer, ShardedBatch
from cpdata.worker.buffer_spans import BufferPlan, buffer_plan
from cpdata.worker.collate import SpecKey, fill_rank, rank_spec_key, spec_items
from cpdata.worker.collated import CollatedPack
from cpdata.worker.shard_block import BlockItem, check_rows, prepare_block

__all__ = ["BLOCK_TOKENS", "DEFAULT_BLOCK_SIZE", "MAX_BLOCK_SIZE", "ShardForRank", "layout_depends_on_documents"]

_I64 = np.dtype(np.int64)

DEFAULT_BLOCK_SIZE = 16
"""Batches per block of :class:`ShardForRank` at least, by default (see the module docstring for the trade-off;
docs/architecture.md "blocks": against 8, 16 measured 5-10 % less CPU per pack at 2K-8K and 12 % at 32K cp4 thd (median), for a
first batch 0.15-0.6 ms later)."""

BLOCK_TOKENS = 1 << 19
"""By default a block also grows until its batches hold this many pack tokens (up to :data:`MAX_BLOCK_SIZE`
batches): the per-block numpy calls are a fixed cost that short packs would otherwise pay 16 at a time (64
batches of 2K-8K packs instead of 16 measured 8-18 % less CPU per pack); from 32K tokens per batch the block is
16 batches, whose first batch a larger block would only delay."""

MAX_BLOCK_SIZE = 64
"""The most batches a default block holds (short packs): 64 batches' plans alive and a first batch ~4-8 ms of
CPU after a reset at 2K-8K."""


@functools.lru_cache(maxsize=64)
def layout_depends_on_documents(layout: str, cp_size: int) -> bool:
    """Whether ``rank_indices(layout, cp_size, ...)`` changes with the slot lengths.

    Probes five aligned slot-length lists on a small pack (empty, one half, short
    documents, remainders); any difference in the rows means document-dependent.
    """
    d, pack_multiple = alignment(layout, cp_size)
    pack_len = 8 * d * pack_multiple
    half = pack_len // 2  # a multiple of d
    probes = ([], [half], [d, 3 * d], [d, half - d, half], [pack_len - d, d])
    rows = [rank_indices(layout, cp_size, lens, pack_len) for lens in probes]
    return any(not np.array_equal(rows[0], r) for r in rows[1:])


@functools.lru_cache(maxsize=256)
def _buffer_plan(spec_key: SpecKey, stream_len: int) -> BufferPlan:
    """The buffer of a rank's batch: the tensors of ``spec_key`` (:func:`~cpdata.worker.collate.rank_spec_key`),
    then its row int64 ``[L]`` and the inverse map int64 ``[stream_len]`` (cached per shape: no spec dict
    or tuple hashed per batch)."""
    local = spec_key[0][-1]
    maps = (("local_token_global_indices", ((local,), _I64)), ("gather_index", ((stream_len,), _I64)))
    return buffer_plan(spec_items(*spec_key), maps)


@functools.lru_cache(maxsize=64)
def _layout_record(stream_len: int, row_shape: tuple[int, int] | None, cp_size: int, cp_rank: int) -> ShardLayout:
    """The :class:`ShardLayout` of a batch without its digest and index maps (per shape and rank, shared:
    each batch's record is a field copy of it)."""
    return ShardLayout(original_seq_len=None, padded_seq_len=stream_len, input_row_shape=row_shape,
                       cp_size=cp_size, cp_rank=cp_rank)  # fmt: skip


class ShardForRank(BaseNode[Any]):
    """Turn each :class:`CollatedPack` into this rank's :class:`ShardedBatch`.

    Args:
        collate_node: a node emitting :class:`CollatedPack` (normally :class:`Collate`).
        cp_size: CP ranks (>= 1).
        cp_rank: this rank, ``0 <= cp_rank < cp_size``.
        layout: one of :data:`cpdata.layout.maps.LAYOUTS`.
        all_ranks: emit a tuple of every rank's batch instead (tests, single-process simulation).
        block_size: batches pulled and prepared at once (int >= 1); None (the default): at least
            :data:`DEFAULT_BLOCK_SIZE` batches holding :data:`BLOCK_TOKENS` pack tokens, at most
            :data:`MAX_BLOCK_SIZE` batches.
        kv_exchange: also build each batch's K/V exchange plan
            (:func:`cpdata.layout.exchange.exchange_plan_of_inverse` of the batch's inverse map and slots;
            this rank's part in ``batch.layout.kv_exchange``), so document-causal attention moves only the
            keys each rank needs instead of all-gathering them. Costs one pass over the inverse map plus
            ~25 numpy calls on the layout's pieces per batch. Not part of the saved state (the batches are
            the same either way).

    State: the source's state before the current block under ``"source"``
    (read once per block: between blocks the state is a cached dict, not a
    walk of the graph), the batches of the block already served under
    ``"skip"`` and their plan digests under ``"served_digests"``, a version
    and ``(cp_size, layout)``; a state from another ``cp_size`` or layout is
    refused. Restoring resets the source and pulls the block again, skipping
    the served batches without gathering their tokens; a skipped batch whose
    digest is not the saved one (the source changed) is refused. ``cp_rank``
    and ``block_size`` are not part of it: every CP rank of a DP group has the
    same state, and any block size resumes any other's.

    Errors lose nothing: a source raising mid-block has the batches pulled
    before it served first, then the same exception; a batch whose plans fail
    the layout checks raises when it would have been served, with the
    per-batch message.
    """

    SOURCE_KEY = "source"
    SKIP_KEY = "skip"
    DIGESTS_KEY = "served_digests"
    VERSION_KEY = "version"
    CONFIG_KEY = "config"
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
        if block_size is not None and (not is_int(block_size) or block_size < 1):
            raise ValueError(f"block_size must be an int >= 1 (batches prepared at once) or None (sized by tokens), "
                             f"got block_size={block_size!r}")  # fmt: skip
        self.block_size = None if block_size is None else int(block_size)
        if not isinstance(kv_exchange, bool):
            raise TypeError(f"kv_exchange must be a bool, got {type(kv_exchange).__name__} {kv_exchange!r}")
        self.kv_exchange = kv_exchange
        self._dynamic = layout_depends_on_documents(layout, self.cp_size)
        self._sources = document_sources_of(collate_node)  # a mix: info["doc_source"] names each slot's source
        if isinstance(collate_node, Collate):
            check_rows(layout, self.cp_size, self._dynamic, collate_node.batch_size, collate_node.qkv_format)
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
        check_state_version("ShardForRank", initial_state, self.VERSION_KEY, self.VERSION)
        check_saved_config("ShardForRank", initial_state[self.CONFIG_KEY], self._config())
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
        return {
            self.VERSION_KEY: self.VERSION,
            self.CONFIG_KEY: self._config(),
            self.SOURCE_KEY: self._before,
            self.SKIP_KEY: self._served,
            self.DIGESTS_KEY: list(self._digests),
        }

    def _pull_block(self) -> None:
        """Read the source's state once (unless restored), pull a block of batches (:meth:`_full`) and prepare them.

        Restored: the first ``self._served`` are pulled again and skipped, their tokens not gathered; their
        digests must be the saved ones (else the source changed since the state was saved).
        """
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

    def _digest(self, item: BlockItem | CollatedPack) -> int:
        """The item's plan digest, -1 for a batch that raises."""
        if not isinstance(item, BlockItem):
            try:
                item = prepare_block([item], self.layout, self.cp_size, self._dynamic, self._sources)[0]
            except Exception:  # noqa: BLE001  (it raised when it was served too)
                return -1
        return item.digest

    def _raise_end(self) -> NoReturn:
        """The block is served: raise what the source raised after it (then start afresh), or StopIteration."""
        if self._error is not None:
            error = self._error
            self._clear(None, [])
            raise error
        raise StopIteration

    def next(self) -> ShardedBatch | tuple[ShardedBatch, ...]:
        while self._served >= len(self._items):  # (a restored state may skip a whole block)
            if self._error is not None or self._ended:
                self._raise_end()
            if self._items:  # the next block starts from the source's state now
                self._clear(None, [])
            self._pull_block()
        item = self._items[self._served]
        self._items[self._served] = None  # the served batch is the consumer's
        self._served += 1
        if not isinstance(item, BlockItem):
            try:
                item = prepare_block([item], self.layout, self.cp_size, self._dynamic, self._sources)[0]
            except Exception:
                self._digests.append(-1)
                raise
        self._digests.append(item.digest)
        return self._serve(item)

    def _serve(self, item: BlockItem) -> ShardedBatch | tuple[ShardedBatch, ...]:
        """This rank's batch of ``item``; every rank's with ``all_ranks`` (the inverse map and the exchange
        plan computed once)."""
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
        """Rank ``r``'s batch, written straight into its one buffer (laid out by ``plan``): its row, the
        inverse map (a copy of ``inverse`` when not None), its tokens and the stream metadata; with
        ``kv_exchange``, rank ``r``'s part of the exchange plan (``exchange``, or the plan of the inverse
        map and the stream's slots: bshd rows share the columns' plan). Returns the batch, its inverse
        map and the exchange plan."""
        buf = BatchBuffer.of(plan)
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
        fields = {"digest": item.digest}
        if self.kv_exchange:
            if exchange is None:
                n_rows = stream.rows if batch.qkv_format == "bshd" else 1
                exchange = exchange_plan_of_inverse(gather, self.cp_size, stream.slot_starts, n_rows=n_rows,
                                                    checked=True, real_ends=stream.real_ends)  # fmt: skip
            fields["kv_exchange"] = exchange.rank(r)
        return buf.batch(layout=layout, info=item.info, fields=fields), gather, exchange
