"""``ShardForRank`` node: one CP rank's tokens of each collated batch, plus its layout.

Per batch: ``rows = rank_indices(layout, cp_size, stream slot lengths,
stream_len)`` once, then only this rank's tokens are gathered from the pieces
(:func:`cpdata.collate.collate_rank`), never the full pack. ``stream_len`` is
``S`` for bshd (rows index columns, shared by the ``B`` rows) and ``B*S`` for
thd (rows index the flat stream). The layout travels as a
:class:`~cpdata.shard_layout.ShardLayout` with the inverse map precomputed.

Layouts whose map does not depend on the documents (found by asking
:func:`~cpdata.layouts.rank_indices` for a few different slot lengths, never
by name) are computed once per ``(cp_size, stream_len)`` and reused. With bshd and
``B > 1`` only those layouts are possible: each row would need its own map, so
a document-dependent layout raises ``ValueError`` (use ``qkv_format="thd"`` or
``batch_size=1``).

Cost per batch and rank, beyond the rank's own tokens: O(stream_len) for the
map, its inverse, the causal-work figures in ``info`` and the plan digest.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from cpdata.batch import BatchBuffer, ShardedBatch
from cpdata.collate import build_stream, fill_rank, rank_specs
from cpdata.layout_runs import RunTable
from cpdata.layouts import alignment, check_layout, layout_runs, rank_indices
from cpdata.nodes.collate import Collate, CollatedPack
from cpdata.plan import plan_digest
from cpdata.shard_layout import ShardLayout
from cpdata.state_version import check_saved_config, check_state_version
from cpdata.stream import Stream

__all__ = ["ShardForRank", "layout_depends_on_documents"]


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


@functools.lru_cache(maxsize=16)
def _static_layout(layout: str, cp_size: int, stream_len: int) -> tuple[RunTable, np.ndarray, np.ndarray]:
    """Run table, rows ``[cp, L]`` and inverse ``[stream_len]`` of a layout that ignores the documents."""
    table = layout_runs(layout, cp_size, [], stream_len)
    rows, inverse = table.rows(), table.inverse()
    rows.flags.writeable = inverse.flags.writeable = False
    return table, rows, inverse


@functools.lru_cache(maxsize=64)
def _run_bounds(layout: str, cp_size: int, stream_len: int, n_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Runs of consecutive positions in each rank's row of a layout that ignores the documents.

    Found once from the cached rows and repeated every ``stream_len`` for the
    ``n_rows`` bshd rows. Returns the stream positions of the runs' first
    tokens then of their ends (int64 ``[2 * runs]``, runs grouped by rank) and
    the index of each rank's first run (int64 ``[cp]``).
    """
    rows = _static_layout(layout, cp_size, stream_len)[1]
    repeats = np.arange(n_rows, dtype=np.int64)[:, None] * stream_len
    firsts, ends, group = [], [], []
    for row in rows:
        cut = np.flatnonzero(np.diff(row) != 1) + 1
        group.append(sum(f.size for f in firsts))
        firsts.append((repeats + row[np.concatenate([[0], cut])]).reshape(-1))
        ends.append((repeats + row[np.concatenate([cut - 1, [row.size - 1]])] + 1).reshape(-1))
    bounds, first_run = np.concatenate(firsts + ends), np.asarray(group, dtype=np.int64)
    bounds.flags.writeable = first_run.flags.writeable = False
    return bounds, first_run


def _causal_work(stream: Stream, layout: str, cp_size: int, stream_len: int) -> list[float]:
    """Per-rank work of :func:`cpdata.layouts.causal_work` for a layout that ignores the documents.

    A real token at offset ``o`` of its slot attends to ``o + 1`` keys; pads
    cost 0. The few runs of these layouts (2 per rank at most, repeated every
    ``S`` in bshd rows) are costed as ``W(end) - W(first)``, ``W(g)`` the work
    of stream positions ``< g`` (one search over the slot starts): O(runs * B + slots).
    """
    bounds, first_run = _run_bounds(layout, cp_size, stream_len, stream.rows * stream.row_len // stream_len)
    real, slot_starts = stream.real_lens, stream.slot_starts
    twice = real * (real + 1)
    k = slot_starts.searchsorted(bounds, side="right") - 1
    m = np.minimum(bounds - slot_starts[k], real[k])
    w = (twice.cumsum() - twice)[k] + m * (m + 1)  # 2 W(g)
    half = w.size // 2
    return (np.add.reduceat(w[half:] - w[:half], first_run) // 2).astype(np.float64).tolist()


@functools.lru_cache(maxsize=64)
def _layout_record(stream_len: int, row_shape: tuple[int, int] | None, cp_size: int, cp_rank: int) -> ShardLayout:
    """The :class:`ShardLayout` of a batch without its digest and index maps (per shape and rank, shared:
    each batch's record is a field copy of it)."""
    return ShardLayout(original_seq_len=None, padded_seq_len=stream_len, input_row_shape=row_shape,
                       cp_size=cp_size, cp_rank=cp_rank)  # fmt: skip


def _digest(batch: CollatedPack, layout: str, cp_size: int, stream: Stream) -> int:
    """:func:`cpdata.plan.plan_digest` of the batch's plan, or a hash of every plan's; the sampled ids
    read from the stream's token buffer."""
    plans, ids, starts = batch.plans, stream.buffer.ids, stream.src_starts
    if len(plans) == 1:
        return plan_digest(plans[0], layout, cp_size, ids, starts)
    digests, at = [], 0
    for p in plans:
        n = len(p.columns)
        digests.append(plan_digest(p, layout, cp_size, ids, starts[at : at + n]))
        at += max(n, 1)  # an empty plan holds one padding slot
    h = hashlib.blake2b(np.asarray(digests, dtype=np.int64).tobytes(), digest_size=8)
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


class ShardForRank(BaseNode[Any]):
    """Turn each :class:`CollatedPack` into this rank's :class:`ShardedBatch`.

    Args:
        collate_node: a node emitting :class:`CollatedPack` (normally :class:`Collate`).
        cp_size: CP ranks (>= 1).
        cp_rank: this rank, ``0 <= cp_rank < cp_size``.
        layout: one of :data:`cpdata.layouts.LAYOUTS`.
        all_ranks: emit a tuple of every rank's batch instead (tests, single-process simulation).

    State: the source's under ``"source"``, a version and ``(cp_size, layout)``;
    a state from another ``cp_size`` or layout is refused. ``cp_rank`` is not
    part of it: every CP rank of a DP group has the same state.
    """

    SOURCE_KEY = "source"
    VERSION_KEY = "version"
    CONFIG_KEY = "config"
    VERSION = 1

    def __init__(
        self,
        collate_node: BaseNode[CollatedPack],
        *,
        cp_size: int,
        cp_rank: int,
        layout: str,
        all_ranks: bool = False,
    ) -> None:
        super().__init__()
        check_layout(layout, cp_size)
        if isinstance(cp_rank, bool) or not isinstance(cp_rank, (int, np.integer)) or not 0 <= cp_rank < cp_size:
            raise ValueError(f"cp_rank must be an int in [0, cp_size={cp_size}), got cp_rank={cp_rank!r}")
        self.source = collate_node
        self.cp_size = int(cp_size)
        self.cp_rank = int(cp_rank)
        self.layout = layout
        self.all_ranks = all_ranks
        self._dynamic = layout_depends_on_documents(layout, self.cp_size)
        if isinstance(collate_node, Collate):
            self._check_rows(collate_node.batch_size, collate_node.qkv_format)

    def _check_rows(self, n_rows: int, qkv_format: str) -> None:
        if qkv_format == "bshd" and n_rows > 1 and self._dynamic:
            raise ValueError(
                f"layout {self.layout!r} (cp_size={self.cp_size}) depends on the documents, so with "
                f"qkv_format='bshd' each of the {n_rows} rows would need its own map; "
                "use qkv_format='thd' (one flat stream) or batch_size=1"
            )

    def _config(self) -> dict[str, Any]:
        return {"cp_size": self.cp_size, "layout": self.layout}

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is None:
            self.source.reset(None)
            return
        check_state_version("ShardForRank", initial_state, self.VERSION_KEY, self.VERSION)
        check_saved_config("ShardForRank", initial_state[self.CONFIG_KEY], self._config())
        self.source.reset(initial_state[self.SOURCE_KEY])

    def get_state(self) -> dict[str, Any]:
        return {
            self.VERSION_KEY: self.VERSION,
            self.CONFIG_KEY: self._config(),
            self.SOURCE_KEY: self.source.state_dict(),
        }

    def next(self) -> ShardedBatch | tuple[ShardedBatch, ...]:
        batch: CollatedPack = next(self.source)
        ranks = range(self.cp_size) if self.all_ranks else [self.cp_rank]
        n_rows, pack_len = batch.row_shape
        self._check_rows(n_rows, batch.qkv_format)
        stream_len = pack_len if batch.qkv_format == "bshd" else n_rows * pack_len
        stream = build_stream(batch.plans, batch.padding_token_id, batch.slots)
        if self._dynamic:
            table = layout_runs(self.layout, self.cp_size, stream.layout_lens, stream_len, checked=True)
            fixed = None
        else:
            table, *fixed = _static_layout(self.layout, self.cp_size, stream_len)
        seq_lens_padded = batch.metadata["seq_lens_padded"]
        info = {
            "layout": self.layout,
            "max_seqlen": int(batch.metadata["max_seqlen"]),
            "max_seqlen_padded": int(seq_lens_padded.max()) if seq_lens_padded.size else 0,
            "pack_indices": [p.index for p in batch.plans],
            "real_tokens": stream.total,
            "pack_tokens": n_rows * pack_len,
            "n_documents": sum(len(p.columns) for p in batch.plans),
            "causal_work": table.causal_work(stream.real_lens).tolist() if self._dynamic
            else _causal_work(stream, self.layout, self.cp_size, stream_len),
        }
        digest = info["digest"] = _digest(batch, self.layout, self.cp_size, stream)
        local = stream_len // self.cp_size
        specs = rank_specs(stream, local, batch.qkv_format)
        maps = {"local_token_global_indices": ((local,), np.int64), "gather_index": ((stream_len,), np.int64)}
        row_shape = batch.row_shape if batch.qkv_format == "thd" else None
        out, inverse = [], None
        for r in ranks:  # everything is written straight into the batch's one buffer
            buf = BatchBuffer(specs, maps)
            rows_r, gather = buf.maps["local_token_global_indices"], buf.maps["gather_index"]
            if fixed is not None:
                rows_r[...], gather[...] = fixed[0][r], fixed[1]
            else:
                table.row(r, out=rows_r)
                if inverse is None:
                    inverse = table.inverse(out=gather)
                else:
                    gather[...] = inverse
            fill_rank(stream, rows_r, batch.qkv_format, buf.arrays, batch.metadata, increasing=True)
            layout = _layout_record(stream_len, row_shape, self.cp_size, r)  # the index maps are the buffer's
            out.append(buf.batch(layout=layout, info=info, fields={"digest": digest}))
        return tuple(out) if self.all_ranks else out[0]
