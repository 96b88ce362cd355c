"""``ShardedBatch``: one CP rank's batch, a mapping of tensors with its layout beside it.

The model reads it like ``Mapping[str, torch.Tensor]``: the token tensors of
this rank in local order (``input_ids``, ``labels``, ``position_ids``,
``padding_mask``, ``document_ids``, extras; ``[B, L]`` for bshd, ``[L]`` for
thd) and the global stream metadata (``cu_seqlens`` & co., see
:mod:`cpdata.worker.keys`). Two attributes travel beside the keys, never inside them:

- ``layout`` (:class:`~cpdata.layout.shard_layout.ShardLayout`): what the shard did,
  for the device sharder and the gather.
- ``info``: a small plain-python dict, on the host wherever the tensors are
  (it survives pickling, workers, ``.to(device)`` and ``pin_memory``): the
  scalars the model side needs without a device sync and the tracing of
  each slot to its document (keys: docs/batch-contents.md; built per block,
  cost: docs/benchmarks.md). :meth:`ShardedBatch.replace` and
  ``batch["labels"] = other`` drop ``info["n_targets"]``.

Frozen-ish: the key set is fixed and ``layout``/``info`` cannot be reassigned;
an existing key may be replaced by a tensor of the same shape (the path
torch's ``default_convert`` and ``pin_memory`` take: ``copy.copy`` then
``update``), which keeps the batch a ``ShardedBatch`` through
``StatefulDataLoader(batch_size=None)`` and its pin-memory thread. To add or
drop keys, build a new batch with :meth:`replace` or use ``dict(batch)``.
Pickles by value (tensors through torch's shared-memory reducers across
worker processes).

Memory layout: :meth:`ShardedBatch.contiguous` (what ``ShardForRank`` emits)
places every tensor in one byte buffer (16-byte aligned views): first the
batch's tensors, then the layout's index maps. So

- a batch crosses from a dataloader worker to the training process as one
  shared-memory storage (torch's reducers pass one file descriptor per
  storage; the receiver maps it and views it by its byte spans when read);
- pinning is one ``pin_memory`` call;
- the host-to-device move (:meth:`ShardedBatch.to`) is one copy of the
  buffer's batch part (~10 keys: ten small copies, each paying the
  launch/latency cost, become one). The index maps stay on the host, pinned
  with the rest, and move on the first gather that needs them
  (:func:`cpdata.gather.layout_tensor_on`), so a model that never gathers
  never copies them.

Replacing a key by another tensor falls back to per-key copies for that batch.

Lazy views: a contiguous batch holds its buffer, its :class:`ViewPlan`
(shared, cached per shape set) and its layout record without the index maps;
the torch views of its keys are built on the first read of the mapping
(iterating the keys and ``len`` read the plan) and its layout's index maps on
the first ``batch.layout``, once per batch, shared with its shallow copies and
with batches moved from it. Pickling, ``pin_memory`` and ``to()`` build none
on the host, so a worker hands its buffer over without viewing it.
``batch.layout`` is an ordinary, complete :class:`ShardLayout` (the same
object on every read, which keeps identity-keyed caches such as
:func:`cpdata.gather.layout_tensor_on` hitting): what is lazy is when the batch
builds it, not the record (a lazy field of the frozen record would change
what ``getattr``/``dataclasses.replace`` see). Trade-off: the first read pays
the views (one torch call per key) where construction used to. Two threads
reading a fresh batch at once may both build (equal views, different tensor
objects); the pin-memory thread reads none.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import numpy as np
import torch

from cpdata.layout.shard_layout import ShardLayout
from cpdata.worker.buffer_spans import (
    BufferPlan,
    ViewPlan,
    buffer_plan,
    gap_index,
    plan_of,
    span_table,
    tensor_specs,
    views,
    with_fields,
)
from cpdata.worker.keys import LABELS, N_TARGETS

__all__ = ["BatchBuffer", "ShardedBatch"]


_LAYOUT_MAPS = ("local_token_global_indices", "input_token_stream_positions", "gather_index")
"""The :class:`ShardLayout` tensor fields a contiguous batch keeps in its buffer, after the batch's tensors."""


def _restore(tensors: dict[str, torch.Tensor], layout: ShardLayout, info: dict[str, Any]) -> ShardedBatch:
    return ShardedBatch(tensors, layout=layout, info=info)


def _restore_buffer(
    buffer: torch.Tensor, plan: ViewPlan, layout: ShardLayout, info: dict[str, Any], maps: bool
) -> ShardedBatch:
    return ShardedBatch._from_buffer(buffer, plan, layout, info, maps)


class _BufferViews:
    """One buffer's torch views, built on first need and shared by a batch, its shallow copies and the
    batches moved from it (never mutated once built).

    ``base`` is the layout record when ``maps`` (the buffer holds the index maps: the layout is the
    record with its map fields set to views of the buffer, and its ``fields`` set, e.g. the batch's
    digest: one record copy per batch, made when the layout is read); otherwise the layout itself, or
    the :class:`_BufferViews` of the batch this one was moved from (whose layout it shares).
    """

    __slots__ = ("buffer", "plan", "maps", "base", "fields", "tensors", "layout", "head", "builds")

    def __init__(self, buffer: torch.Tensor, plan: ViewPlan, maps: bool, base: Any,
                 fields: Mapping[str, Any] | None = None) -> None:  # fmt: skip
        if fields and not maps:  # no map views to wait for: the record now
            base, fields = with_fields(base, fields), None
        self.buffer, self.plan, self.maps, self.base, self.fields = buffer, plan, maps, base, fields
        self.tensors: dict[str, torch.Tensor] | None = None  # key -> view, once built
        self.layout: ShardLayout | None = None  # once resolved
        self.head: torch.Tensor | None = None  # the batch part (what to() moves), once asked for
        self.builds = 0  # views built: 1 for the tensors, 1 for the layout maps (read by tests)

    def get_tensors(self) -> dict[str, torch.Tensor]:
        if self.tensors is None:
            self.tensors = self.plan.tensor_views(self.buffer)
            self.builds += 1
        return self.tensors

    def get_layout(self) -> ShardLayout:
        layout = self.layout
        if layout is None:
            base = self.base
            if self.maps:
                views = self.plan.map_views(self.buffer)
                layout = with_fields(base, {**self.fields, **views} if self.fields else views)
                self.builds += 1
            else:
                layout = base if isinstance(base, ShardLayout) else base.get_layout()
            self.layout = layout
        return layout

    def get_head(self) -> torch.Tensor:
        if self.head is None:
            self.head = self.buffer[: self.plan.head] if self.maps else self.buffer
        return self.head

    def record(self) -> ShardLayout:
        """The layout without the map fields this buffer holds (what a pickle of the buffer carries)."""
        base, names = self.base, self.plan.map_spans
        changes = dict(self.fields or {})
        if any(base.__dict__.get(name) is not None for name in names):
            changes.update(dict.fromkeys(names))
        return with_fields(base, changes) if changes else base


class BatchBuffer:
    """A batch's one host buffer before it is filled: write the numpy views in place, then :meth:`batch`.

    Args:
        tensors: key -> ``(shape, numpy dtype)`` of every batch tensor, in order.
        maps: layout field (``local_token_global_indices``, ...) -> ``(shape, dtype)``; placed after the tensors.

    Attributes:
        arrays: key -> numpy view of the buffer (uninitialised: the writer fills every element; the alignment
            gaps between arrays are zeroed).
        maps: layout field -> numpy view.

    Cost: one cached plan lookup (none through :meth:`of`), one allocation (numpy's, wrapped by torch:
    cheaper than ``torch.empty`` + ``.numpy()``) and one field read of a structured view per array
    (:class:`~cpdata.worker.buffer_spans.BufferPlan`); no torch view (the batch builds those when
    read).
    """

    __slots__ = ("buffer", "plan", "arrays", "maps")

    def __init__(self, tensors: Mapping[str, tuple[tuple[int, ...], np.dtype]],
                 maps: Mapping[str, tuple[tuple[int, ...], np.dtype]]) -> None:  # fmt: skip
        try:  # the specs as they come are the cache key (tuple shapes, numpy dtypes)
            plan = buffer_plan(tuple(tensors.items()), tuple(maps.items()))
        except TypeError:  # an unhashable spec (a list shape): normalised
            plan = buffer_plan(tuple((k, (tuple(shape), np.dtype(dt))) for k, (shape, dt) in tensors.items()),
                               tuple((k, (tuple(shape), np.dtype(dt))) for k, (shape, dt) in maps.items()))  # fmt: skip
        self._allocate(plan)

    @classmethod
    def of(cls, plan: BufferPlan) -> BatchBuffer:
        """A buffer laid out by ``plan`` (:func:`~cpdata.worker.buffer_spans.buffer_plan` of the specs, kept by a
        caller that serves many batches of one shape)."""
        buf = cls.__new__(cls)
        buf._allocate(plan)
        return buf

    def _allocate(self, plan: BufferPlan) -> None:
        raw = np.empty(plan.record.itemsize, dtype=np.uint8)
        if plan.gaps.size:  # the writer fills every array; the alignment gaps are zeroed here
            raw[plan.gaps] = 0
        record = np.ndarray((), plan.record, raw)  # each field read is a view of raw
        self.plan, self.buffer = plan.view, torch.from_numpy(raw)
        self.arrays = {k: record[field] for k, field in plan.arrays}
        self.maps = {k: record[field] for k, field in plan.maps}

    def batch(self, *, layout: ShardLayout, info: Mapping[str, Any] | None = None,
              fields: Mapping[str, Any] | None = None) -> ShardedBatch:  # fmt: skip
        """The filled buffer as a :class:`ShardedBatch`; ``layout``'s map fields become views of the buffer
        (when read), its other ``fields`` (e.g. ``{"digest": ...}``) are set in the same copy of the record."""
        return ShardedBatch._from_buffer(self.buffer, self.plan, layout, info, True, fields)


def _same_values(new: torch.Tensor, old: torch.Tensor) -> bool:
    """Whether ``new`` holds ``old``'s values (a pinned copy does; a check on the host only: another device
    counts as changed, so no device sync)."""
    return new.device == old.device and new.dtype == old.dtype and bool(torch.equal(new, old))


def _without_target_count(info: dict[str, Any]) -> dict[str, Any]:
    """``info`` without ``n_targets`` (a new dict): the labels it counted were replaced."""
    return {k: v for k, v in info.items() if k != N_TARGETS}


class ShardedBatch(MutableMapping[str, torch.Tensor]):
    """One rank's tensors (a mapping) plus ``.layout`` and ``.info``.

    Args:
        tensors: key -> tensor; see the module docstring for the keys.
        layout: the :class:`ShardLayout` that produced the token tensors.
        info: small plain-python metadata (no tensors).
    """

    __slots__ = ("_tensors", "_layout", "_info", "_views")

    def __init__(
        self, tensors: Mapping[str, torch.Tensor], *, layout: ShardLayout, info: Mapping[str, Any] | None = None
    ) -> None:
        if not isinstance(layout, ShardLayout):
            raise TypeError(f"layout must be a ShardLayout, got {type(layout).__name__}")
        bad = [k for k, v in tensors.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise TypeError(f"ShardedBatch values must be torch tensors; keys {bad} are not")
        self._tensors: dict[str, torch.Tensor] | None = dict(tensors)  # None until a buffer's views are read
        self._layout: ShardLayout | None = layout  # None until a buffer's layout is read
        self._info = dict(info or {})
        self._views: _BufferViews | None = None  # the one buffer backing every tensor (contiguous batches)

    @classmethod
    def contiguous(
        cls, tensors: Mapping[str, torch.Tensor], *, layout: ShardLayout, info: Mapping[str, Any] | None = None
    ) -> ShardedBatch:
        """A batch whose tensors and layout maps are views of one host buffer (one extra host copy).

        Buffer: ``tensors`` in order, then the layout's index maps
        (``local_token_global_indices``, ``input_token_stream_positions``,
        ``gather_index``, those that are set), each span 16-byte aligned.
        """
        spans, end = span_table(tensor_specs(tensors))
        maps = {name: getattr(layout, name) for name in _LAYOUT_MAPS if getattr(layout, name) is not None}
        map_spans, total = span_table(tensor_specs(maps), end)
        buffer = torch.empty(total, dtype=torch.uint8)
        buffer.numpy()[gap_index((spans, map_spans), total)] = 0  # alignment gaps: no allocator leftovers
        for view, v in zip((*views(buffer, spans).values(), *views(buffer, map_spans).values()),
                           (*tensors.values(), *maps.values()), strict=True):  # fmt: skip
            view.copy_(v)
        return cls._from_buffer(buffer, plan_of(spans, map_spans, total), layout, info, True)

    @classmethod
    def _from_buffer(
        cls, buffer: torch.Tensor, plan: ViewPlan, layout: Any, info: Mapping[str, Any] | None, maps: bool,
        fields: Mapping[str, Any] | None = None,
    ) -> ShardedBatch:  # fmt: skip
        """A batch of ``buffer`` by ``plan``, views built when read: the whole buffer when ``maps``
        (``layout``'s map fields become views too), else the batch part alone (a moved batch; ``layout``
        may then be the :class:`_BufferViews` it was moved from); ``fields`` are set in ``layout``'s copy
        that gets the map views (made when the layout is read). No per-key checks (the spans were made
        from tensors). Plans are never mutated, so batches derived from one another share them."""
        batch = cls.__new__(cls)
        maps = maps and bool(plan.map_spans)  # a buffer without maps is its batch part
        batch._views = _BufferViews(buffer, plan, maps, layout, fields)
        batch._tensors = batch._layout = None
        batch._info = dict(info or {})
        return batch

    @property
    def _buffer(self) -> torch.Tensor | None:
        """The uint8 buffer backing every tensor, when contiguous."""
        return self._views.buffer if self._views is not None else None

    @property
    def _plan(self) -> ViewPlan | None:
        """The buffer's span tables and how to view them (shared, immutable), when contiguous."""
        return self._views.plan if self._views is not None else None

    def _batch_bytes(self) -> int:
        """Bytes of the buffer's batch part (every key; the layout maps follow)."""
        return self._views.plan.head if self._views is not None else 0

    @property
    def _spans(self) -> dict:
        """Key -> byte span of the buffer (empty without one)."""
        return self._views.plan.spans if self._views is not None else {}

    def _tensor_dict(self) -> dict[str, torch.Tensor]:
        """Key -> tensor (a buffer's views are built here, once); never mutated while a buffer backs it."""
        tensors = self._tensors
        if tensors is None:
            tensors = self._tensors = self._views.get_tensors()
        return tensors

    def nbytes(self) -> int:
        """Bytes of the batch's tensors, ``sum(t.numel() * t.element_size())`` over the keys (the layout
        maps excluded); read from the buffer's plan when contiguous, so no view is built."""
        if self._views is not None:
            return self._views.plan.tensor_bytes
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    def _map_nbytes(self) -> int:
        """Bytes of the layout's index maps (those set), from the plan when the buffer holds them."""
        views = self._views
        if views is not None and views.maps:
            return views.plan.map_bytes
        maps = (getattr(self.layout, name) for name in _LAYOUT_MAPS)
        return sum(t.numel() * t.element_size() for t in maps if t is not None)

    @property
    def layout(self) -> ShardLayout:
        layout = self._layout
        if layout is None:
            layout = self._layout = self._views.get_layout()
        return layout

    @property
    def info(self) -> dict[str, Any]:
        return self._info

    def __getitem__(self, key: str) -> torch.Tensor:
        tensors = self._tensors
        if tensors is None:
            tensors = self._tensor_dict()
        return tensors[key]

    def __iter__(self) -> Iterator[str]:
        if self._tensors is None:  # the keys are the plan's: no view needed
            return iter(self._views.plan.spans)
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._views.plan.spans if self._tensors is None else self._tensors)

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        old = self._tensor_dict().get(key)
        if old is None:
            raise TypeError(
                f"ShardedBatch keys are fixed; cannot add {key!r}. Use batch.replace({key}=...) or dict(batch)"
            )
        if not isinstance(value, torch.Tensor) or value.shape != old.shape:
            # ValueError, not TypeError: torch's default_collate catches TypeError and would silently turn
            # the batch into a plain dict without its layout (the sharder would then re-shard it).
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(
                f"ShardedBatch[{key!r}] may only be replaced by a tensor of shape {tuple(old.shape)}, got {got}. "
                "A DataLoader collating ShardedBatches needs batch_size=None (each item is already a batch); "
                "to change shapes use batch.replace(...)"
            )
        if value is old:
            return
        if key == LABELS and N_TARGETS in self._info and not _same_values(value, old):
            # other labels than the pipeline counted: the recorded target count no longer holds (hf_model_kwargs
            # then counts with one all-reduce, or asks for num_items_in_batch); a pinned copy keeps it
            self._info = _without_target_count(self._info)
        if self._views is not None:  # the buffer no longer backs every key: this batch owns its tensors
            self._layout, self._tensors, self._views = self.layout, dict(self._tensors), None
        self._tensors[key] = value

    def __delitem__(self, key: str) -> None:
        raise TypeError(f"ShardedBatch keys are fixed; cannot delete {key!r}. Use batch.replace() or dict(batch)")

    def __copy__(self) -> ShardedBatch:
        # Same tensor objects (the buffer's views are shared, built once for both): torch's default_convert
        # copies then update()s with the originals, which must not look like replacements (that would drop
        # the single buffer). Builds no view.
        batch = ShardedBatch.__new__(ShardedBatch)  # no per-key checks: the values are this batch's tensors
        tensors = self._tensors
        batch._tensors = tensors if tensors is None or self._views is not None else dict(tensors)
        batch._layout, batch._info, batch._views = self._layout, dict(self._info), self._views
        return batch

    def __reduce__(self):
        views = self._views
        if views is not None:  # one storage: the views are rebuilt from the spans on the other side
            base = views.record() if views.maps else self.layout
            return _restore_buffer, (views.buffer, views.plan, base, self._info, views.maps)
        return _restore, (self._tensors, self._layout, self._info)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}: {tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}" for k, v in self.items())
        return f"ShardedBatch(cp_rank={self.layout.cp_rank}/{self.layout.cp_size}, {{{shapes}}})"

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors as a new plain dict (same tensor objects)."""
        return dict(self._tensor_dict())

    def replace(self, **tensors: torch.Tensor | None) -> ShardedBatch:
        """A new batch with keys set (or removed, for ``None``); layout and info kept, but ``info["n_targets"]``
        (the count of the pipeline's labels) dropped when ``labels`` is given."""
        out = dict(self._tensor_dict())
        for k, v in tensors.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = v
        info = _without_target_count(self._info) if LABELS in tensors else self._info
        return ShardedBatch(out, layout=self.layout, info=info)

    def to(self, device: torch.device | str, non_blocking: bool = False, copy: bool = False) -> ShardedBatch:
        """Tensors on ``device`` (one copy of the buffer's batch part when contiguous; views built when
        read); the layout stays on the host (the gather moves its maps on first use). ``copy=True``
        copies even when already on ``device`` (a ``clone()``), as ``Tensor.to``."""
        views = self._views
        if views is None:
            moved = {k: v.to(device, non_blocking=non_blocking, copy=copy) for k, v in self._tensors.items()}
            return ShardedBatch(moved, layout=self._layout, info=self._info)
        head = views.get_head()  # the maps stay behind
        if copy and head.device == (device if isinstance(device, torch.device) else torch.device(device)):
            moved = head.clone()  # ~40% cheaper than Tensor.to(copy=True) on CPU
        else:
            moved = head.to(device, non_blocking=non_blocking, copy=copy)
            if moved is head:  # already there: this batch, as Tensor.to returns self
                return self
        layout = self._layout or views.layout or (views if views.maps else views.base)  # resolved when read
        return ShardedBatch._from_buffer(moved, views.plan, layout, self._info, False)

    def pin_memory(self, device: Any = None) -> ShardedBatch:
        """Tensors and layout tensors in pinned host memory (CUDA builds only)."""
        views = self._views
        if views is not None:
            pinned = views.buffer.pin_memory()
            base = views.base if views.maps else self.layout.pin_memory()
            return ShardedBatch._from_buffer(pinned, views.plan, base, self._info, views.maps, views.fields)
        pinned = {k: v.pin_memory() for k, v in self._tensors.items()}
        return ShardedBatch(pinned, layout=self._layout.pin_memory(), info=self._info)
