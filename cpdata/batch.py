"""``ShardedBatch``: one CP rank's batch, a mapping of tensors with its layout beside it.

The model reads it like ``Mapping[str, torch.Tensor]``: the token tensors of
this rank in local order (``input_ids``, ``labels``, ``position_ids``,
``padding_mask``, ``document_ids``, extras; ``[B, L]`` for bshd, ``[L]`` for
thd) and the global stream metadata (``cu_seqlens`` & co., see
:mod:`cpdata.keys`). Two attributes travel beside the keys, never inside them:

- ``layout`` (:class:`~cpdata.shard_layout.ShardLayout`): what the shard did,
  for the device sharder and the gather.
- ``info``: a small plain-python dict, on the host wherever the tensors are
  (it survives pickling, workers, ``.to(device)`` and ``pin_memory``). Scalars
  the model side needs without a device sync: ``layout`` (name),
  ``max_seqlen`` (longest real document), ``max_seqlen_padded`` (longest
  slot); and for logging: ``pack_indices``, ``real_tokens``, ``pack_tokens``,
  ``n_documents``, ``causal_work`` (per rank), ``digest``.

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
  storage; the receiver maps it and rebuilds the views from byte spans);
- pinning is one ``pin_memory`` call;
- the host-to-device move (:meth:`ShardedBatch.to`) is one copy of the
  buffer's batch part (~10 keys: ten small copies, each paying the
  launch/latency cost, become one). The index maps stay on the host, pinned
  with the rest, and move on the first gather that needs them
  (:func:`cpdata.gather.layout_tensor_on`), so a model that never gathers
  never copies them.

Replacing a key by another tensor falls back to per-key copies for that batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import numpy as np
import torch

from cpdata.buffer_spans import ViewPlan, buffer_plan, plan_of, span_table, tensor_specs, views, with_fields
from cpdata.shard_layout import ShardLayout

__all__ = ["BatchBuffer", "ShardedBatch"]


_LAYOUT_MAPS = ("local_token_global_indices", "input_token_stream_positions", "gather_index")
"""The :class:`ShardLayout` tensor fields a contiguous batch keeps in its buffer, after the batch's tensors."""


def _restore(tensors: dict[str, torch.Tensor], layout: ShardLayout, info: dict[str, Any]) -> ShardedBatch:
    return ShardedBatch(tensors, layout=layout, info=info)


def _restore_buffer(
    buffer: torch.Tensor, plan: ViewPlan, layout: ShardLayout, info: dict[str, Any], maps: bool
) -> ShardedBatch:
    return ShardedBatch._from_buffer(buffer, plan, layout, info, maps)


class BatchBuffer:
    """A batch's one host buffer before it is filled: write the numpy views in place, then :meth:`batch`.

    Args:
        tensors: key -> ``(shape, numpy dtype)`` of every batch tensor, in order.
        maps: layout field (``local_token_global_indices``, ...) -> ``(shape, dtype)``; placed after the tensors.

    Attributes:
        arrays: key -> numpy view of the buffer (uninitialised; the writer fills every element).
        maps: layout field -> numpy view.
    """

    __slots__ = ("buffer", "plan", "arrays", "maps")

    def __init__(self, tensors: Mapping[str, tuple[tuple[int, ...], np.dtype]],
                 maps: Mapping[str, tuple[tuple[int, ...], np.dtype]]) -> None:  # fmt: skip
        try:  # the specs as they come are the cache key (tuple shapes, numpy dtypes)
            self.plan, total, arrays, map_arrays = buffer_plan(tuple(tensors.items()), tuple(maps.items()))
        except TypeError:  # an unhashable spec (a list shape): normalised
            self.plan, total, arrays, map_arrays = buffer_plan(
                tuple((k, (tuple(shape), np.dtype(dt))) for k, (shape, dt) in tensors.items()),
                tuple((k, (tuple(shape), np.dtype(dt))) for k, (shape, dt) in maps.items()))  # fmt: skip
        self.buffer = torch.empty(total, dtype=torch.uint8)
        raw = self.buffer.numpy()
        ndarray = np.ndarray
        self.arrays = {k: ndarray(shape, dt, raw, off) for k, shape, dt, off in arrays}
        self.maps = {k: ndarray(shape, dt, raw, off) for k, shape, dt, off in map_arrays}

    def batch(self, *, layout: ShardLayout, info: Mapping[str, Any] | None = None,
              fields: Mapping[str, Any] | None = None) -> ShardedBatch:  # fmt: skip
        """The filled buffer as a :class:`ShardedBatch`; ``layout``'s map fields become views of the buffer,
        its other ``fields`` (e.g. ``{"digest": ...}``) are set in the same copy of the record."""
        return ShardedBatch._from_buffer(self.buffer, self.plan, layout, info, True, fields)


class ShardedBatch(MutableMapping[str, torch.Tensor]):
    """One rank's tensors (a mapping) plus ``.layout`` and ``.info``.

    Args:
        tensors: key -> tensor; see the module docstring for the keys.
        layout: the :class:`ShardLayout` that produced the token tensors.
        info: small plain-python metadata (no tensors).
    """

    __slots__ = ("_tensors", "_layout", "_info", "_buffer", "_plan", "_maps", "_head")

    def __init__(
        self, tensors: Mapping[str, torch.Tensor], *, layout: ShardLayout, info: Mapping[str, Any] | None = None
    ) -> None:
        if not isinstance(layout, ShardLayout):
            raise TypeError(f"layout must be a ShardLayout, got {type(layout).__name__}")
        bad = [k for k, v in tensors.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise TypeError(f"ShardedBatch values must be torch tensors; keys {bad} are not")
        self._tensors = dict(tensors)
        self._layout = layout
        self._info = dict(info or {})
        self._buffer: torch.Tensor | None = None  # uint8 [bytes] backing every tensor, when contiguous
        self._plan: ViewPlan | None = None  # the buffer's span tables and how to view them (shared, immutable)
        self._maps = False  # _buffer holds the layout maps after the batch part (else the batch part alone)
        self._head: torch.Tensor | None = None  # _buffer's batch part (what to() moves), once asked for

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
        for view, v in zip((*views(buffer, spans).values(), *views(buffer, map_spans).values()),
                           (*tensors.values(), *maps.values()), strict=True):  # fmt: skip
            view.copy_(v)
        return cls._from_buffer(buffer, plan_of(spans, map_spans, total), layout, info, True)

    @classmethod
    def _from_buffer(
        cls, buffer: torch.Tensor, plan: ViewPlan, layout: ShardLayout, info: Mapping[str, Any] | None, maps: bool,
        fields: Mapping[str, Any] | None = None,
    ) -> ShardedBatch:  # fmt: skip
        """Views of ``buffer`` by ``plan``: the whole buffer when ``maps`` (``layout``'s map fields become
        views too), else the batch part alone (a moved batch); no per-key checks (the spans were made
        from tensors). Plans are never mutated, so batches derived from one another share them."""
        batch = cls.__new__(cls)
        maps = maps and bool(plan.map_spans)  # a buffer without maps is its batch part
        if maps:
            batch._tensors, map_views = plan.views(buffer)
            batch._layout, batch._head = with_fields(layout, {**fields, **map_views} if fields else map_views), None
        else:
            batch._tensors, batch._head = plan.head_views(buffer), buffer
            batch._layout = with_fields(layout, fields) if fields else layout
        batch._info = dict(info or {})
        batch._buffer, batch._plan, batch._maps = buffer, plan, maps
        return batch

    def _batch_bytes(self) -> int:
        """Bytes of the buffer's batch part (every key; the layout maps follow)."""
        return self._plan.head if self._plan is not None else 0

    @property
    def _spans(self) -> dict:
        """Key -> byte span of the buffer (empty without one)."""
        return self._plan.spans if self._plan is not None else {}

    @property
    def layout(self) -> ShardLayout:
        return self._layout

    @property
    def info(self) -> dict[str, Any]:
        return self._info

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._tensors[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        old = self._tensors.get(key)
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
        if value is not old:  # the buffer no longer backs every key
            self._buffer, self._plan, self._maps, self._head = None, None, False, None
        self._tensors[key] = value

    def __delitem__(self, key: str) -> None:
        raise TypeError(f"ShardedBatch keys are fixed; cannot delete {key!r}. Use batch.replace() or dict(batch)")

    def __copy__(self) -> ShardedBatch:
        # Same tensor objects: torch's default_convert copies then update()s with the originals, which must
        # not look like replacements (that would drop the single buffer).
        batch = ShardedBatch.__new__(ShardedBatch)  # no per-key checks: the values are this batch's tensors
        batch._tensors, batch._layout, batch._info = dict(self._tensors), self._layout, dict(self._info)
        batch._buffer, batch._plan, batch._maps, batch._head = self._buffer, self._plan, self._maps, self._head
        return batch

    def __reduce__(self):
        if self._buffer is not None:  # one storage: the views are rebuilt from the spans on the other side
            bare = with_fields(self._layout, dict.fromkeys(self._plan.map_spans)) if self._maps else self._layout
            return _restore_buffer, (self._buffer, self._plan, bare, self._info, self._maps)
        return _restore, (self._tensors, self._layout, self._info)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}: {tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}" for k, v in self.items())
        return f"ShardedBatch(cp_rank={self._layout.cp_rank}/{self._layout.cp_size}, {{{shapes}}})"

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors as a new plain dict (same tensor objects)."""
        return dict(self._tensors)

    def replace(self, **tensors: torch.Tensor | None) -> ShardedBatch:
        """A new batch with keys set (or removed, for ``None``); layout and info kept."""
        out = dict(self._tensors)
        for k, v in tensors.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = v
        return ShardedBatch(out, layout=self._layout, info=self._info)

    def to(self, device: torch.device | str, non_blocking: bool = False, copy: bool = False) -> ShardedBatch:
        """Tensors on ``device`` (one copy of the buffer's batch part when contiguous); the layout stays on
        the host (the gather moves its maps on first use). ``copy=True`` copies even when already on
        ``device`` (a ``clone()``), as ``Tensor.to``."""
        head = self._head
        if head is None:
            if self._buffer is None:
                moved = {k: v.to(device, non_blocking=non_blocking, copy=copy) for k, v in self._tensors.items()}
                return ShardedBatch(moved, layout=self._layout, info=self._info)
            head = self._head = self._buffer[: self._plan.head]  # the maps stay behind
        if copy and head.device == (device if isinstance(device, torch.device) else torch.device(device)):
            moved = head.clone()  # ~40% cheaper than Tensor.to(copy=True) on CPU
        else:
            moved = head.to(device, non_blocking=non_blocking, copy=copy)
            if moved is head:  # already there: this batch, as Tensor.to returns self
                return self
        return ShardedBatch._from_buffer(moved, self._plan, self._layout, self._info, False)

    def pin_memory(self, device: Any = None) -> ShardedBatch:
        """Tensors and layout tensors in pinned host memory (CUDA builds only)."""
        if self._buffer is not None:
            pinned = self._buffer.pin_memory()
            layout = self._layout if self._maps else self._layout.pin_memory()
            return ShardedBatch._from_buffer(pinned, self._plan, layout, self._info, self._maps)
        pinned = {k: v.pin_memory() for k, v in self._tensors.items()}
        return ShardedBatch(pinned, layout=self._layout.pin_memory(), info=self._info)
