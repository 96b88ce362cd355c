"""The layout math of a block of collated batches, before any rank's tokens are gathered.

:func:`prepare_block` gives each batch's :class:`BlockItem` for all batches at once; what scales with
a rank's tokens is left to :class:`~cpdata.nodes.shard.ShardForRank`, per batch, when served. Every
output is a function of its own batch only: blocks of any size give the same items."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate, pairwise
from typing import Any

import numpy as np

from cpdata.layout.maps import layout_run_block, layout_runs
from cpdata.layout.runs import RunTable
from cpdata.worker.collate import CollatedPack
from cpdata.worker.keys import N_TARGETS
from cpdata.worker.plan import PackPlan
from cpdata.worker.stream import Stream, StreamBlock, buffer_runs, build_streams, target_counts
from cpdata.worker.stream_slots import SlotBlock

__all__ = ["DIGEST_SAMPLES", "BlockItem", "DocumentSources", "check_rows", "hash63", "plan_digest",
           "prepare_block", "static_layout"]  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockItem:
    """One batch of a block, its layout math done, its tokens not gathered yet.

    Attributes:
        stream_len: positions a layout map covers: ``S`` (bshd) or ``B*S`` (thd).
        table: the layout's run table (rows and inverse made per rank when served); None with ``fixed``.
        fixed: rows int64 ``[cp, stream_len / cp]`` and inverse int64 ``[stream_len]`` of a layout that
            ignores the documents (cached, read-only); None with ``table``.
        info: the batch's ``info`` dict (its digest included), shared by every rank's batch.
    """

    batch: CollatedPack
    stream: Stream
    stream_len: int
    table: RunTable | None
    fixed: tuple[np.ndarray, np.ndarray] | None
    info: dict[str, Any]


def check_rows(layout: str, cp_size: int, dynamic: bool, n_rows: int, qkv_format: str) -> None:
    """Refuse bshd rows ``B > 1`` under a ``dynamic`` (document-dependent) layout: one map cannot serve every row."""
    if qkv_format == "bshd" and n_rows > 1 and dynamic:
        raise ValueError(
            f"layout {layout!r} (cp_size={cp_size}) depends on the documents, so with "
            f"qkv_format='bshd' each of the {n_rows} rows would need its own map; "
            "use qkv_format='thd' (one flat stream) or batch_size=1"
        )


@functools.lru_cache(maxsize=16)
def static_layout(layout: str, cp_size: int, stream_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``[cp, L]`` and inverse ``[stream_len]`` (read-only) of a layout that ignores the documents."""
    table = layout_runs(layout, cp_size, [], stream_len)
    rows, inverse = table.rows(), table.inverse()
    rows.flags.writeable = inverse.flags.writeable = False
    return rows, inverse


@functools.lru_cache(maxsize=64)
def _run_bounds(layout: str, cp_size: int, stream_len: int, n_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Runs of consecutive positions in each rank's row of a layout that ignores the documents, repeated
    every ``stream_len`` for ``n_rows`` bshd rows: the runs' first positions then their ends (int64
    ``[2 * runs]``, grouped by rank) and each rank's first run (int64 ``[cp]``)."""
    rows = static_layout(layout, cp_size, stream_len)[0]
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


Groups = dict[tuple[int, int], list[int]]
"""``(stream length, bshd rows a map repeats over) -> the block's batches of that shape``, in order."""


def _static_causal_work(block: StreamBlock, layout: str, cp_size: int, groups: Groups) -> list[list[float]]:
    """Per-rank :func:`cpdata.layout.maps.causal_work` of each batch under a document-blind layout.

    A real token at offset ``o`` of its slot attends to ``o + 1`` keys, pads to none; each run costs
    ``W(end) - W(first)``, ``W(g)`` the work of the block's positions ``< g``: one search per stream length,
    O(runs * B * k + N)."""
    offsets, real = block.offsets, block.slots.table[:, 2]
    twice = real * (real + 1)
    below = twice.cumsum()
    below -= twice  # 2 W(offset of each slot)
    firsts = block.slots.first
    works: list[list[float]] = [[]] * len(block.streams)
    for (stream_len, n_rows), members in groups.items():
        bounds, first_run = _run_bounds(layout, cp_size, stream_len, n_rows)
        at = offsets[[firsts[b] for b in members]][:, None] + bounds  # [m, 2 runs]: each batch's runs
        k = offsets.searchsorted(at, side="right")
        k -= 1
        m = np.minimum(at - offsets[k], real[k])
        w = below[k] + m * (m + 1)  # 2 W(g)
        half = bounds.shape[0] // 2
        work = (np.add.reduceat(w[:, half:] - w[:, :half], first_run, axis=1) // 2).astype(np.float64).tolist()
        for j, b in enumerate(members):
            works[b] = work[j]
    return works


DIGEST_SAMPLES = 8
"""Token ids per piece that :func:`plan_digest` hashes (evenly spaced, first and last included)."""
_SAMPLE_AT = np.arange(DIGEST_SAMPLES, dtype=np.int64)


def plan_digest(plan: PackPlan, layout: str, cp_size: int) -> int:
    """63-bit digest of everything that decides a rank's shard of ``plan``.

    CP ranks of one DP group must agree on it (the device-side check all-reduces it). It covers layout, cp
    size, capacity, pack index, slot lengths (and a world step's slot owners), every piece's columns and up to
    :data:`DIGEST_SAMPLES` sampled token ids per piece: ``n_pieces * 12`` int64s instead of every id, so ranks
    reading other data of the same shape disagree, while a change confined to unsampled positions goes unseen."""
    return _digests(build_streams([([plan], 0)]), layout, cp_size, [len(plan.pieces)])[0]


def hash63(data: bytes) -> int:
    """The 63-bit digest of ``data`` (blake2b, 8 bytes, little-endian, top bit cleared) every layout check uses."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & ((1 << 63) - 1)


def _digests(block: StreamBlock, layout: str, cp_size: int, n_documents: list[int]) -> list[int]:
    """Each batch's digest: :func:`plan_digest` of its plan, or a hash of every plan's.

    One table of every piece's columns and sampled ids (an empty piece's -1), the samples gathered once per
    run of batches sharing a token buffer; one hash per plan over its rows and checked slot lengths;
    ``n_documents``: each batch's pieces."""
    slots, streams = block.slots, block.streams
    columns, starts, first, raw = slots.table, block.src_starts, slots.first, slots.raw_lens
    if min(slots.counts) == 0:  # an empty plan's padding slot (document -1) is no piece
        piece = columns[:, 0] >= 0
        columns, starts, raw = columns[piece], starts[piece], raw[piece]
        first = [0, *accumulate(n_documents)]
    rows = np.empty((columns.shape[0], 4 + DIGEST_SAMPLES), dtype=np.int64)
    rows[:, :4] = columns
    lens, samples = columns[:, 2], rows[:, 4:]
    at = np.multiply.outer(lens - 1, _SAMPLE_AT)
    at //= DIGEST_SAMPLES - 1
    at += starts[:, None]
    for b, e in buffer_runs(streams):  # one gather per run of batches reading one buffer, no boolean masks
        part = slice(first[b], first[e])
        streams[b].buffer.ids.take(at[part], out=samples[part], mode="clip")  # empty pieces: below
    samples[lens <= 0] = -1  # an empty piece's
    prefix, data, width = f"{layout}|{cp_size}|", rows.tobytes(), 8 * rows.shape[1]
    lens_data = raw.astype(np.int64, copy=False).tobytes()
    digests, row = [], 0
    for plan, k in zip(slots.plans, slots.counts, strict=True):
        head = (prefix + f"{plan.capacity}|{plan.index}").encode() + lens_data[8 * row : 8 * (row + k)]
        if plan.owners is not None:  # a world step's deal is the packer's, not the slot lengths'
            head += b"|owners|" + np.ascontiguousarray(plan.owners, dtype=np.int64).tobytes()
        digests.append(hash63(head + data[width * row : width * (row + k)]))
        row += k
    per_batch = [digests[lo:hi] for lo, hi in pairwise(slots.plan_first)]
    return [d[0] if len(d) == 1 else hash63(np.asarray(d, dtype=np.int64).tobytes()) for d in per_batch]


def _dynamic_layouts(layout: str, cp_size: int, block: StreamBlock, groups: Groups
                     ) -> tuple[list[RunTable], list[list[float]]]:  # fmt: skip
    """Run tables and per-rank causal work under a document-dependent layout, one block call per stream
    length; raises the per-batch error of :func:`cpdata.layout.maps.layout_runs`."""
    slots, real, k = block.slots, block.slots.table[:, 2], len(block.streams)
    tables: list[RunTable] = [None] * k  # type: ignore[list-item]
    works: list[list[float]] = [[]] * k
    for (stream_len, _), members in groups.items():  # (one row: a dynamic layout refuses bshd rows)
        run_block = layout_run_block(layout, cp_size, [slots.layout_lens_of(i) for i in members], stream_len,
                                     [_owners_of(slots, i) for i in members])  # fmt: skip
        block_tables = run_block.tables()
        reals = [real[slots.first[i] : slots.first[i] + n]
                 for i, n in zip(members, run_block.doc_counts(), strict=True)]  # fmt: skip
        work = run_block.causal_work(reals[0] if len(reals) == 1 else np.concatenate(reals)).tolist()
        for j, i in enumerate(members):
            tables[i], works[i] = block_tables[j], work[j]
    return tables, works


def _owners_of(slots: SlotBlock, b: int) -> np.ndarray | None:
    """Batch ``b``'s slot owners (a world step's, :attr:`PackPlan.owners`), or None."""
    plans = slots.plans[slots.plan_first[b] : slots.plan_first[b + 1]]
    owned = [plan.owners is not None for plan in plans]
    if any(owned) and len(plans) > 1:
        raise ValueError(f"a batch of {len(plans)} packs dealt by world steps: each pack is its own world "
                         "micro-batch; use batch_size=1 with StreamPlan(world_step=...)")  # fmt: skip
    return plans[0].owners if owned[0] else None


DocumentSources = Callable[[np.ndarray], tuple[list[str], np.ndarray]]
"""``sources(doc_index int64 [n]) -> (names, index int64 [n])``: each mixed document's source name and
index there, e.g. :meth:`cpdata.nodes.mix.Mix.document_sources`."""


def _trace(table: np.ndarray, sources: DocumentSources | None
           ) -> tuple[list[int], list[int], list[str | None] | None]:  # fmt: skip
    """Per slot: document index, the piece's offset in it and, with ``sources``, the mix source's name (the
    index then local to that source); an empty plan's padding slot: -1, 0, None."""
    index, start = table[:, 0], table[:, 1]
    names: list[str | None] | None = None
    if sources is not None:
        real = index >= 0
        found, at = sources(index[real])
        index = index.copy()
        index[real] = at
        names = [None] * index.shape[0]
        for j, name in zip(np.flatnonzero(real).tolist(), found, strict=True):
            names[j] = name
    return index.tolist(), start.tolist(), names


def prepare_block(batches: Sequence[CollatedPack], layout: str, cp_size: int, dynamic: bool,
                  sources: DocumentSources | None = None) -> list[BlockItem]:  # fmt: skip
    """The :class:`BlockItem` of every batch of a block, in order.

    ``dynamic``: whether the layout depends on the documents; ``sources``: a mix's :data:`DocumentSources`
    (``info["doc_source"]`` and source-local ``doc_index``), or None. Streams, run tables, causal work and
    digest samples are built for all batches at once.

    Raises:
        ValueError, TypeError: a per-batch check failed for some batch of the block; redo the block one
            batch at a time to raise at the bad batch.
    """
    if not batches:
        return []
    stream_lens, groups, k = [], {}, len(batches)
    for i, batch in enumerate(batches):  # (a short last batch: other rows or another length)
        n_rows, bshd = len(batch.plans), batch.qkv_format == "bshd"
        check_rows(layout, cp_size, dynamic, n_rows, batch.qkv_format)
        stream_lens.append(batch.pack_len * (1 if bshd else n_rows))
        groups.setdefault((stream_lens[-1], n_rows if bshd else 1), []).append(i)
    block = build_streams([(batch.plans, batch.padding_token_id) for batch in batches])
    if dynamic:
        tables, works = _dynamic_layouts(layout, cp_size, block, groups)
        fixed: list[tuple[np.ndarray, np.ndarray] | None] = [None] * k
    else:
        tables, fixed = [None] * k, [static_layout(layout, cp_size, n) for n in stream_lens]  # (cached)
        works = _static_causal_work(block, layout, cp_size, groups)
    slots = block.slots
    pf, indices = slots.plan_first, [p.index for p in slots.plans]
    n_documents = [sum(slots.counts[pf[i] : pf[i + 1]]) for i in range(k)]
    digests = _digests(block, layout, cp_size, n_documents)
    doc_index, doc_start, doc_source = _trace(slots.table, sources)
    n_targets = target_counts(block)
    widest = np.maximum.reduceat(slots.slot_lens, slots.first[:-1]).tolist()  # each batch's longest slot
    items = []
    for i, batch in enumerate(batches):
        lo, hi, meta = slots.first[i], slots.first[i + 1], block.streams[i].metadata
        info = {
            "layout": layout,
            "max_seqlen": int(meta["max_seqlen"]),
            "max_seqlen_padded": widest[i],
            "pack_indices": indices[pf[i] : pf[i + 1]],
            "real_tokens": int(meta["cu_seqlens"][-1]),
            "pack_tokens": (pf[i + 1] - pf[i]) * batch.pack_len,
            N_TARGETS: n_targets[i],
            "n_documents": n_documents[i],
            "causal_work": works[i],
            "digest": digests[i],
            "doc_index": doc_index[lo:hi],
            "doc_start": doc_start[lo:hi],
        }
        if doc_source is not None:
            info["doc_source"] = doc_source[lo:hi]
        items.append(BlockItem(batch=batch, stream=block.streams[i], stream_len=stream_lens[i], table=tables[i],
                               fixed=fixed[i], info=info))  # fmt: skip
    return items
