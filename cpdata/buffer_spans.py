"""Byte spans of a batch's one buffer, and the typed views over them (the mechanics behind
:class:`cpdata.batch.ShardedBatch`'s single storage).

A span is ``(byte offset, bytes, dtype, shape, strides)``: tensors are laid
out C-contiguous, each start 16-byte aligned. Span tables are built once per
shape set (:func:`buffer_plan` is cached: a pipeline repeats a few shapes) and
never mutated, so batches derived from one another share them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from cpdata.shard_layout import ShardLayout

__all__ = ["Span", "ViewPlan", "buffer_plan", "plan_views", "span_table", "tensor_specs", "view_plan", "views",
           "with_fields"]  # fmt: skip

_ALIGN = 16
Span = tuple[int, int, torch.dtype, tuple[int, ...], tuple[int, ...]]  # byte offset, bytes, dtype, shape, strides
ViewPlan = tuple[tuple[torch.dtype, ...], tuple[tuple[str, int, tuple[int, ...], tuple[int, ...], int], ...]]
"""``(dtypes, ((key, dtype index, shape, strides, element offset), ...))``: a span table ready to view."""


def with_fields(layout: ShardLayout, fields: Mapping[str, Any]) -> ShardLayout:
    """``dataclasses.replace(layout, **fields)`` without re-running ``__init__`` (a plain frozen dataclass
    with no checks: a field copy, ~10x cheaper; used per batch on the hot path)."""
    out = object.__new__(type(layout))
    out.__dict__.update(layout.__dict__)
    out.__dict__.update(fields)
    return out


def span_table(
    specs: Mapping[str, tuple[tuple[int, ...], torch.dtype, int]], offset: int = 0
) -> tuple[dict[str, Span], int]:
    """Byte spans for ``key -> (shape, dtype, itemsize)`` packed from ``offset`` (C-contiguous, each
    start 16-byte aligned), and the end offset."""
    spans: dict[str, Span] = {}
    for k, (shape, dtype, itemsize) in specs.items():
        n = math.prod(shape) * itemsize
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
        spans[k] = (offset, n, dtype, tuple(shape), tuple(strides))
        offset += -(-n // _ALIGN) * _ALIGN
    return spans, offset


def tensor_specs(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype, int]]:
    bad = [k for k, v in tensors.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise TypeError(f"ShardedBatch values must be torch tensors; keys {bad} are not")
    return {k: (tuple(v.shape), v.dtype, v.element_size()) for k, v in tensors.items()}


@functools.lru_cache(maxsize=32)
def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


@functools.lru_cache(maxsize=256)
def buffer_plan(tensors: tuple, maps: tuple) -> tuple[dict[str, Span], dict[str, Span], int, ViewPlan]:
    """Span tables of a :class:`BatchBuffer` (``(key, shape, numpy dtype)`` tuples in order), the end
    offset and the tensors' :func:`view_plan`; cached: batches of one pipeline repeat a few shapes (the
    slot count varies)."""

    def specs(items):
        return {k: (tuple(shape), _torch_dtype(np.dtype(dt)), np.dtype(dt).itemsize) for k, shape, dt in items}

    spans, end = span_table(specs(tensors))
    map_spans, total = span_table(specs(maps), end)
    return spans, map_spans, total, view_plan(spans)


def view_plan(spans: Mapping[str, Span]) -> ViewPlan:
    """What :func:`plan_views` needs of a span table, computed once per table: the distinct dtypes and,
    per key, its dtype's index and its offset in elements of that dtype."""
    dtypes = tuple(dict.fromkeys(span[2] for span in spans.values()))
    items = tuple((k, dtypes.index(dt), shape, strides, off // dt.itemsize)
                  for k, (off, _, dt, shape, strides) in spans.items())  # fmt: skip
    return dtypes, items


def plan_views(buffer: torch.Tensor, plan: ViewPlan) -> dict[str, torch.Tensor]:
    """Typed views of ``buffer`` (storage offset 0) by a :func:`view_plan`: one reinterpretation per
    dtype, one ``as_strided`` per key, no other per-key work (each view is ~1 us of torch's own cost)."""
    dtypes, items = plan
    typed = [buffer.view(dt).as_strided for dt in dtypes]
    return {k: typed[i](shape, strides, off) for k, i, shape, strides, off in items}


def views(buffer: torch.Tensor, spans: Mapping[str, Span]) -> dict[str, torch.Tensor]:
    """Typed views of ``buffer`` (a fresh allocation, storage offset 0): one reinterpretation per dtype,
    then one ``as_strided`` per key."""
    typed: dict[torch.dtype, tuple[Any, int]] = {}
    out = {}
    for k, (offset, _, dtype, shape, strides) in spans.items():
        view = typed.get(dtype)
        if view is None:
            whole = buffer.view(dtype)
            view = typed[dtype] = (whole.as_strided, whole.element_size())
        out[k] = view[0](shape, strides, offset // view[1])
    return out
