"""``ShardedBatch``: one CP rank's batch, a mapping of tensors with its layout beside it.

Keys: this rank's token tensors in local order (``[B, L]`` bshd, ``[L]`` thd) and the global stream
metadata (:mod:`cpdata.worker.keys`). Beside them travel ``layout`` (for the sharder and the gather) and
``info`` (host values surviving pickling, workers, ``to()`` and ``pin_memory``; docs/batch-contents.md).
The key set is fixed; a key may be replaced by a tensor of its shape (as ``default_convert`` and
``pin_memory`` do; ``labels`` drops ``info["n_targets"]``); :meth:`ShardedBatch.replace` changes keys.

One storage (docs/architecture.md): :meth:`ShardedBatch.contiguous` and :class:`BatchBuffer` put the
tensors, then the layout's index maps, in one 16-byte-aligned buffer: one shared-memory storage across
processes, one ``pin_memory`` call, one device copy of the batch part. Replacing a key falls back to
per-key tensors. The torch views are built once, on first read, and shared with copies and moved
batches; pickling, pinning and ``to()`` build none."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import numpy as np
import torch

from cpdata.layout.shard_layout import MAP_FIELDS, ShardLayout
from cpdata.worker.buffer_spans import BufferPlan, ViewPlan, plan_of, tensor_specs, with_fields
from cpdata.worker.keys import LABELS, N_TARGETS

__all__ = ["BatchBuffer", "ShardedBatch"]


class _BufferViews:
    """One buffer's torch views, built on first need and shared by a batch, its copies and moved batches.

    ``base`` is the layout record when ``maps`` (the layout is then the record with its map fields set to
    views of the buffer and ``fields`` set: one copy per batch, made when read); otherwise the layout, or
    the :class:`_BufferViews` of the batch this one was moved from."""

    __slots__ = ("buffer", "plan", "maps", "base", "fields", "tensors", "layout", "builds")

    def __init__(self, buffer: torch.Tensor, plan: ViewPlan, maps: bool, base: Any,
                 fields: Mapping[str, Any] | None = None) -> None:  # fmt: skip
        if fields and not maps:  # no map views to wait for: the record now
            base, fields = with_fields(base, fields), None
        self.buffer, self.plan, self.maps, self.base, self.fields = buffer, plan, maps, base, fields
        self.tensors: dict[str, torch.Tensor] | None = None  # key -> view, once built
        self.layout: ShardLayout | None = None  # once resolved
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

    def record(self) -> ShardLayout:
        """The layout without the map fields this buffer holds (what a pickle carries)."""
        base, names = self.base, self.plan.map_spans
        changes = dict(self.fields or {})
        if any(base.__dict__.get(name) is not None for name in names):
            changes.update(dict.fromkeys(names))
        return with_fields(base, changes) if changes else base


class BatchBuffer:
    """A batch's one host buffer before it is filled, laid out by a cached
    :func:`~cpdata.worker.buffer_spans.buffer_plan`: write the numpy views in place, then :meth:`batch`.

    ``arrays`` and ``maps`` (layout fields, placed after the tensors) hold the numpy views (uninitialised but
    for the zeroed alignment gaps). One allocation and one structured-field read per array; no torch view."""

    __slots__ = ("buffer", "plan", "arrays", "maps")

    def __init__(self, plan: BufferPlan) -> None:
        raw = np.empty(plan.record.itemsize, dtype=np.uint8)
        if plan.gaps.size:  # the writer fills every array; the alignment gaps are zeroed here
            raw[plan.gaps] = 0
        record = np.ndarray((), plan.record, raw)  # each field read is a view of raw
        self.plan, self.buffer = plan.view, torch.from_numpy(raw)
        self.arrays = {k: record[field] for k, field in plan.arrays}
        self.maps = {k: record[field] for k, field in plan.maps}

    def batch(self, *, layout: ShardLayout, info: Mapping[str, Any] | None = None,
              fields: Mapping[str, Any] | None = None) -> ShardedBatch:  # fmt: skip
        """The filled buffer as a :class:`ShardedBatch`; ``layout``'s map fields become views of the
        buffer, its other ``fields`` (e.g. ``{"digest": ...}``) are set in the same record copy."""
        return ShardedBatch._from_buffer(self.buffer, self.plan, layout, info, True, fields)


def _without_target_count(info: dict[str, Any]) -> dict[str, Any]:
    """``info`` without ``n_targets`` (a new dict): the labels it counted were replaced."""
    return {k: v for k, v in info.items() if k != N_TARGETS}


class ShardedBatch(MutableMapping[str, torch.Tensor]):
    """One rank's tensors (a mapping) plus ``.layout`` (the :class:`ShardLayout` that produced them) and
    ``.info`` (small plain-python metadata)."""

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
        """A batch whose tensors and layout maps (those set) are views of one host buffer."""
        cls(tensors, layout=layout)  # the values and the layout checked as for any batch
        maps = {name: getattr(layout, name) for name in MAP_FIELDS if getattr(layout, name) is not None}
        plan, total, gaps = plan_of(tensor_specs(tensors), tensor_specs(maps))
        buffer = torch.empty(total, dtype=torch.uint8)
        buffer.numpy()[gaps] = 0  # alignment gaps: no allocator leftovers
        for view, v in zip((*plan.tensor_views(buffer).values(), *plan.map_views(buffer).values()),
                           (*tensors.values(), *maps.values()), strict=True):  # fmt: skip
            view.copy_(v)
        return cls._from_buffer(buffer, plan, layout, info, True)

    @classmethod
    def _from_buffer(
        cls, buffer: torch.Tensor, plan: ViewPlan, layout: Any, info: Mapping[str, Any] | None, maps: bool,
        fields: Mapping[str, Any] | None = None,
    ) -> ShardedBatch:  # fmt: skip
        """A batch of ``buffer`` by ``plan``, views built when read.

        ``maps``: the buffer holds the layout's maps, else it is the batch part alone and ``layout`` may be
        the :class:`_BufferViews` it was moved from; ``fields`` are set in the layout copy."""
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

    def _batch_bytes(self) -> int:
        """Bytes of the buffer's batch part (the layout maps follow)."""
        return self._views.plan.head if self._views is not None else 0

    def _tensor_dict(self) -> dict[str, torch.Tensor]:
        """Key -> tensor (a buffer's views built here, once)."""
        tensors = self._tensors
        if tensors is None:
            tensors = self._tensors = self._views.get_tensors()
        return tensors

    def nbytes(self) -> int:
        """Bytes of the batch's tensors (the layout maps excluded); from the plan when contiguous."""
        if self._views is not None:
            return self._views.plan.tensor_bytes
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    def _map_nbytes(self) -> int:
        """Bytes of the layout's index maps (those set)."""
        views = self._views
        if views is not None and views.maps:
            return views.plan.map_bytes
        maps = (getattr(self.layout, name) for name in MAP_FIELDS)
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
        return self._tensor_dict()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._views.plan.spans if self._tensors is None else self._tensors)  # no view built for keys

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
        if key == LABELS and N_TARGETS in self._info and not (
            value.device == old.device and value.dtype == old.dtype and bool(torch.equal(value, old))
        ):
            # other labels than the pipeline counted (another device counts as changed): the recorded target
            # count no longer holds (hf_model_kwargs then counts with one all-reduce, or asks for
            # num_items_in_batch); a pinned copy keeps it
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
            return ShardedBatch._from_buffer, (views.buffer, views.plan, base, self._info, views.maps)
        return functools.partial(ShardedBatch, layout=self._layout, info=self._info), (self._tensors,)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}: {tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}" for k, v in self.items())
        return f"ShardedBatch(cp_rank={self.layout.cp_rank}/{self.layout.cp_size}, {{{shapes}}})"

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors as a new plain dict (same tensor objects)."""
        return dict(self._tensor_dict())

    def replace(self, **tensors: torch.Tensor | None) -> ShardedBatch:
        """A new batch with keys set (or removed, for ``None``); ``info["n_targets"]`` dropped when
        ``labels`` is given."""
        out = {k: v for k, v in {**self._tensor_dict(), **tensors}.items() if v is not None}
        info = _without_target_count(self._info) if LABELS in tensors else self._info
        return ShardedBatch(out, layout=self.layout, info=info)

    def to(self, device: torch.device | str, non_blocking: bool = False, copy: bool = False) -> ShardedBatch:
        """Tensors on ``device`` (one copy of the buffer's batch part when contiguous); the layout stays on
        the host. ``copy=True`` copies even on the same device, as ``Tensor.to``."""
        views = self._views
        if views is None:
            moved = {k: v.to(device, non_blocking=non_blocking, copy=copy) for k, v in self._tensors.items()}
            return ShardedBatch(moved, layout=self._layout, info=self._info)
        head = views.buffer[: views.plan.head] if views.maps else views.buffer  # the maps stay behind
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
