"""Byte spans of a batch's one buffer, and the typed views over them (behind
:class:`cpdata.worker.batch.ShardedBatch`'s single storage).

A span is ``(byte offset, bytes, dtype, shape, strides)``: tensors in key order, C-contiguous, each
start 16-byte aligned. A :class:`ViewPlan` holds what depends only on the span tables and is built once
per shape set (:func:`buffer_plan` is cached), never mutated. Each view is one torch call of fixed
cost; grouping keys by dtype into one ``as_strided`` + ``unbind`` is no faster, so the buffer keeps the
key order."""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import torch

from cpdata.layout.shard_layout import ShardLayout

__all__ = ["BufferPlan", "Span", "Spec", "ViewPlan", "buffer_plan", "gap_index", "plan_of", "span_table",
           "tensor_specs", "with_fields"]

_ALIGN = 16
Spec = tuple[tuple[int, ...], torch.dtype, int]  # shape, dtype, itemsize
Span = tuple[int, int, torch.dtype, tuple[int, ...], tuple[int, ...]]  # byte offset, bytes, dtype, shape, strides
Item = tuple[str, int, tuple[int, ...], tuple[int, ...], int]
"""``(key, dtype index, shape, strides, element offset)``: one ``as_strided`` of a typed view."""
Steps = tuple[tuple[torch.dtype, ...], tuple[Item, ...]]
"""A span table's distinct dtypes (one reinterpretation of the buffer each) and its items in key order."""


def with_fields(layout: ShardLayout, fields: Mapping[str, Any]) -> ShardLayout:
    """``dataclasses.replace(layout, **fields)`` without re-running ``__init__`` (a field copy)."""
    out = object.__new__(type(layout))
    out.__dict__.update(layout.__dict__)
    out.__dict__.update(fields)
    return out


def span_table(specs: Mapping[str, Spec], offset: int = 0) -> tuple[dict[str, Span], int]:
    """Byte spans for ``key -> (shape, dtype, itemsize)`` packed from ``offset``, and the end offset."""
    spans: dict[str, Span] = {}
    for k, (shape, dtype, itemsize) in specs.items():
        n = math.prod(shape) * itemsize
        strides = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))  # C order, in elements
        spans[k] = (offset, n, dtype, tuple(shape), strides)
        offset += -(-n // _ALIGN) * _ALIGN
    return spans, offset


def gap_index(tables: tuple[Mapping[str, Span], ...], total: int) -> np.ndarray:
    """int64 ``[g]``: the bytes of a ``total``-byte buffer that no span of ``tables`` covers (alignment gaps).

    Writers zero them so a buffer's bytes are a function of its tensors (no allocator leftovers in
    pickles, shared memory and device copies). O(spans log spans + gaps)."""
    runs = sorted((offset, offset + nbytes) for table in tables for offset, nbytes, *_ in table.values())
    gaps, covered = [], 0  # covered: the end of the spans so far
    for start, end in runs:
        if start > covered:
            gaps.append(range(covered, start))
        covered = max(covered, end)
    if total > covered:
        gaps.append(range(covered, total))
    return np.fromiter(itertools.chain.from_iterable(gaps), dtype=np.int64, count=sum(map(len, gaps)))


def tensor_specs(tensors: Mapping[str, torch.Tensor]) -> dict[str, Spec]:
    return {k: (tuple(v.shape), v.dtype, v.element_size()) for k, v in tensors.items()}


def _steps(table: Mapping[str, Span]) -> Steps:
    """The distinct dtypes of ``table`` and its items in key order."""
    dtypes = tuple(dict.fromkeys(span[2] for span in table.values()))
    return dtypes, tuple(
        (k, dtypes.index(dt), shape, strides, off // dt.itemsize) for k, (off, _, dt, shape, strides) in table.items()
    )


class ViewPlan(NamedTuple):
    """A buffer's span tables and how to view them, computed once per table (:func:`plan_of`).

    The batch's tensors start at byte 0 whether the buffer holds the layout maps after them or is the batch
    part alone (``head`` bytes, what :meth:`~cpdata.worker.batch.ShardedBatch.to` moves)."""

    spans: dict[str, Span]
    """Batch key -> span, in key order."""
    map_spans: dict[str, Span]
    """Layout field -> span, after every key."""
    head: int
    """Bytes of the batch part (the layout maps follow)."""
    tensor_steps: Steps
    map_steps: Steps
    tensor_bytes: int
    """``sum(numel * element_size)`` of the batch's tensors."""
    map_bytes: int
    """``sum(numel * element_size)`` of the layout maps."""

    def tensor_views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """The batch's tensors, keys in order, as views of ``buffer`` (whole or batch part)."""
        return _apply(self.tensor_steps, buffer)

    def map_views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Layout field -> view of a whole buffer."""
        return _apply(self.map_steps, buffer)


def _apply(steps: Steps, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
    """Key -> view of ``buffer`` by ``steps``: one reinterpretation per dtype, one ``as_strided`` per key."""
    dtypes, items = steps
    typed = [buffer.view(dt).as_strided for dt in dtypes]
    return {k: typed[i](shape, strides, off) for k, i, shape, strides, off in items}


def plan_of(specs: Mapping[str, Spec], map_specs: Mapping[str, Spec]) -> tuple[ViewPlan, int, np.ndarray]:
    """The :class:`ViewPlan` of a buffer of tensors then layout maps (:data:`Spec` each), its bytes and its
    alignment-gap bytes (:func:`gap_index`)."""
    spans, head = span_table(specs)
    map_spans, total = span_table(map_specs, head)
    tensor_bytes, map_bytes = (sum(span[1] for span in table.values()) for table in (spans, map_spans))
    plan = ViewPlan(spans, map_spans, head, _steps(spans), _steps(map_spans), tensor_bytes, map_bytes)
    return plan, total, gap_index((spans, map_spans), total)


class BufferPlan(NamedTuple):
    """What allocating and viewing a :class:`~cpdata.worker.batch.BatchBuffer` needs, computed once per spec set."""

    view: ViewPlan
    """The torch views of the filled buffer."""
    record: np.dtype
    """A structured dtype of the buffer, one field per array at its span (``"0"``, ``"1"``, ...: the
    tensors in key order, then the maps): a field read of one 0-d array gives each numpy view."""
    arrays: tuple[tuple[str, str], ...]
    """``(key, field)`` of the tensors, in key order."""
    maps: tuple[tuple[str, str], ...]
    """``(layout field, field)`` of the layout maps, after the tensors."""
    gaps: np.ndarray
    """int64 ``[g]``: the alignment-gap bytes (:func:`gap_index`), zeroed at allocation."""


@functools.lru_cache(maxsize=32)
def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    """Torch's dtype of a numpy one (cached: a buffer plan is made per slot count, about once per batch)."""
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


@functools.lru_cache(maxsize=256)
def buffer_plan(tensors: tuple, maps: tuple) -> BufferPlan:
    """The cached :class:`BufferPlan` of a :class:`~cpdata.worker.batch.BatchBuffer` (``(key, (shape,
    numpy dtype))`` items in order)."""

    def specs(items):
        return {k: (tuple(shape), _torch_dtype(np.dtype(dt)), np.dtype(dt).itemsize) for k, (shape, dt) in items}

    view, total, gaps = plan_of(specs(tensors), specs(maps))
    items = [(view.spans[k], dt) for k, (_, dt) in tensors] + [(view.map_spans[k], dt) for k, (_, dt) in maps]
    record = np.dtype({"names": [str(i) for i in range(len(items))], "itemsize": total,
                       "formats": [(np.dtype(dt), span[3]) for span, dt in items],
                       "offsets": [span[0] for span, _ in items]})  # fmt: skip
    keys = [(k, str(i)) for i, (k, _) in enumerate((*tensors, *maps))]
    gaps.flags.writeable = False
    return BufferPlan(view, record, tuple(keys[: len(tensors)]), tuple(keys[len(tensors) :]), gaps)
