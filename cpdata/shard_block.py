"""The layout math of a block of collated batches, before any rank's tokens are gathered.

:class:`~cpdata.nodes.shard.ShardForRank` pulls ``k`` batches at a time and
asks :func:`prepare_block` for each batch's :class:`BlockItem`: its stream
(the per-slot tables every rank gathers from), the layout as a run table (or
the cached rows and inverse map of a layout that ignores the documents), the
``info`` dict (with the causal work per rank) and the plan digest. What
scales with a rank's tokens (the rank's row, the inverse map, the gather, the
batch buffer) is left to the node, per batch, when the batch is served.

Every output is a function of its own batch only: grouping batches into blocks
of any size gives the same items. Errors carry the messages of the per-batch
checks; a block that raises is redone one batch at a time by the caller so the
error surfaces at the bad batch.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cpdata.layout_runs import RunTable
from cpdata.layouts import layout_run_block, layout_runs
from cpdata.nodes.collate import CollatedPack
from cpdata.plan import plan_digests
from cpdata.stream import Stream, build_streams

__all__ = ["BlockItem", "check_rows", "prepare_block", "static_layout"]


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockItem:
    """One batch of a block, its layout math done, its tokens not gathered yet.

    Attributes:
        batch: the collated batch.
        stream: its stream (per-slot tables and token buffer).
        stream_len: positions a layout map covers: ``S`` (bshd) or ``B*S`` (thd).
        table: the layout's run table (rows and inverse computed per rank when served); None with ``fixed``.
        fixed: rows int64 ``[cp, stream_len / cp]`` and inverse int64 ``[stream_len]`` of a layout that
            ignores the documents (cached, read-only); None with ``table``.
        info: the batch's ``info`` dict, digest included (shared by every rank's batch).
        digest: the plan digest.
    """

    batch: CollatedPack
    stream: Stream
    stream_len: int
    table: RunTable | None
    fixed: tuple[np.ndarray, np.ndarray] | None
    info: dict[str, Any]
    digest: int


def check_rows(layout: str, cp_size: int, dynamic: bool, n_rows: int, qkv_format: str) -> None:
    """Refuse bshd rows ``B > 1`` under a ``dynamic`` (document-dependent) layout: one map cannot serve every row."""
    if qkv_format == "bshd" and n_rows > 1 and dynamic:
        raise ValueError(
            f"layout {layout!r} (cp_size={cp_size}) depends on the documents, so with "
            f"qkv_format='bshd' each of the {n_rows} rows would need its own map; "
            "use qkv_format='thd' (one flat stream) or batch_size=1"
        )


@functools.lru_cache(maxsize=16)
def static_layout(layout: str, cp_size: int, stream_len: int) -> tuple[RunTable, np.ndarray, np.ndarray]:
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
    rows = static_layout(layout, cp_size, stream_len)[1]
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


def _static_causal_work(stream: Stream, layout: str, cp_size: int, stream_len: int) -> list[float]:
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


def _piece_starts(batch: CollatedPack, stream: Stream) -> np.ndarray:
    """int64 ``[pieces]``: the token-buffer index of each piece's first id, plan after plan (an empty
    plan's padding slot left out)."""
    counts = stream.slot_lens.shape[0] - sum(len(p.columns) for p in batch.plans)
    if counts == 0:
        return stream.src_starts
    keep, at = [], 0
    for p in batch.plans:
        n = len(p.columns)
        keep.append(stream.src_starts[at : at + n])
        at += max(n, 1)  # an empty plan holds one padding slot
    return np.concatenate(keep)


def _digests(batches: Sequence[CollatedPack], streams: Sequence[Stream], layout: str, cp_size: int) -> list[int]:
    """Each batch's digest: :func:`cpdata.plan.plan_digest` of its plan, or a hash of every plan's.

    The plans of batches reading the same token buffer (a packing window's) are digested together
    (:func:`cpdata.plan.plan_digests`: one gather of their samples).
    """
    groups: dict[int, list[int]] = {}
    for i, stream in enumerate(streams):
        groups.setdefault(id(stream.buffer), []).append(i)
    per_plan: list[list[int]] = [[] for _ in batches]
    for members in groups.values():
        plans = [p for i in members for p in batches[i].plans]
        starts = [_piece_starts(batches[i], streams[i]) for i in members]
        ids = streams[members[0]].buffer.ids
        digests = plan_digests(plans, layout, cp_size, ids, starts[0] if len(starts) == 1 else np.concatenate(starts))
        at = 0
        for i in members:
            n = len(batches[i].plans)
            per_plan[i], at = digests[at : at + n], at + n
    out = []
    for digests in per_plan:
        if len(digests) == 1:
            out.append(digests[0])
        else:
            h = hashlib.blake2b(np.asarray(digests, dtype=np.int64).tobytes(), digest_size=8)
            out.append(int.from_bytes(h.digest(), "little") & ((1 << 63) - 1))
    return out


def _dynamic_layouts(layout: str, cp_size: int, streams: Sequence[Stream], stream_lens: Sequence[int]
                     ) -> tuple[list[RunTable], list[list[float]]]:  # fmt: skip
    """Run tables and per-rank causal work of batches under a document-dependent layout: one
    :func:`cpdata.layouts.layout_run_block` per stream length (all batches but a short last one).

    Raises the per-batch error of :func:`cpdata.layouts.layout_runs` (pack or slot multiples).
    """
    tables: list[RunTable] = [None] * len(streams)  # type: ignore[list-item]
    works: list[list[float]] = [[]] * len(streams)
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(stream_lens):
        groups.setdefault(n, []).append(i)
    for stream_len, members in groups.items():
        block = layout_run_block(layout, cp_size, [streams[i].layout_lens for i in members], stream_len)
        block_tables = block.tables()
        real = [streams[i].real_lens[: t.hi - t.lo] for i, t in zip(members, block_tables, strict=True)]
        work = block.causal_work(real[0] if len(real) == 1 else np.concatenate(real)).tolist()
        for j, i in enumerate(members):
            tables[i], works[i] = block_tables[j], work[j]
    return tables, works


def prepare_block(batches: Sequence[CollatedPack], layout: str, cp_size: int, dynamic: bool) -> list[BlockItem]:
    """The :class:`BlockItem` of every batch of a block, in order.

    ``dynamic``: whether the layout depends on the documents
    (:func:`cpdata.nodes.shard.layout_depends_on_documents`). The streams and
    their metadata (:func:`cpdata.stream.build_streams`), the run tables and
    causal work (per stream length), and the digest samples (per token
    buffer) are built for all batches at once.

    Raises:
        ValueError, TypeError: the per-batch checks (:func:`check_rows`, the stream's slot tables, the
            layout's slot multiples) for some batch of the block; which one is not said: redo the block
            with one batch at a time to raise at the bad batch.
    """
    if not batches:
        return []
    stream_lens = []
    for batch in batches:
        n_rows, pack_len = batch.row_shape
        check_rows(layout, cp_size, dynamic, n_rows, batch.qkv_format)
        stream_lens.append(pack_len if batch.qkv_format == "bshd" else n_rows * pack_len)
    streams = build_streams([(batch.plans, batch.padding_token_id, batch.slots) for batch in batches])
    if dynamic:
        tables, works = _dynamic_layouts(layout, cp_size, streams, stream_lens)
    else:
        fixed = [static_layout(layout, cp_size, n)[1:] for n in stream_lens]
        works = [_static_causal_work(s, layout, cp_size, n) for s, n in zip(streams, stream_lens, strict=True)]
    digests = _digests(batches, streams, layout, cp_size)
    items = []
    for i, batch in enumerate(batches):
        stream = streams[i]
        assert stream.metadata is not None
        info = {
            "layout": layout,
            "max_seqlen": int(stream.metadata["max_seqlen"]),
            "max_seqlen_padded": stream.max_slot_len,
            "pack_indices": [p.index for p in batch.plans],
            "real_tokens": stream.total,
            "pack_tokens": len(batch.plans) * batch.pack_len,
            "n_documents": sum(len(p.columns) for p in batch.plans),
            "causal_work": works[i],
            "digest": digests[i],
        }
        items.append(BlockItem(batch=batch, stream=stream, stream_len=stream_lens[i],
                               table=tables[i] if dynamic else None, fixed=None if dynamic else fixed[i],
                               info=info, digest=digests[i]))  # fmt: skip
    return items
