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

from cpdata.buffer_spans import (
    Span,
    ViewPlan,
    buffer_plan,
    plan_views,
    span_table,
    tensor_specs,
    view_plan,
    views,
    with_fields,
)
from cpdata.shard_layout import ShardLayout

__all__ = ["BatchBuffer", "ShardedBatch"]


_LAYOUT_MAPS = ("local_token_global_indices", "input_token_stream_positions", "gather_index")
"""The :class:`ShardLayout` tensor fields a contiguous batch keeps in its buffer, after the batch's tensors."""


def _restore(tensors: dict[str, torch.Tensor], layout: ShardLayout, info: dict[str, Any]) -> ShardedBatch:
    return ShardedBatch(tensors, layout=layout, info=info)


def _restore_buffer(
    buffer: torch.Tensor, spans: dict[str, Span], layout: ShardLayout, info: dict[str, Any],
    map_spans: dict[str, Span] | None = None, plan: ViewPlan | None = None,
) -> ShardedBatch:  # fmt: skip
    return ShardedBatch._from_buffer(buffer, spans, layout, info, map_spans or {}, plan)


class BatchBuffer:
    """A batch's one host buffer before it is filled: write the numpy views in place, then :meth:`batch`.

    Args:
        tensors: key -> ``(shape, numpy dtype)`` of every batch tensor, in order.
        maps: layout field (``local_token_global_indices``, ...) -> ``(shape, dtype)``; placed after the tensors.

    Attributes:
        arrays: key -> numpy view of the buffer (uninitialised; the writer fills every element).
        maps: layout field -> numpy view.
    """

    __slots__ = ("buffer", "spans", "map_spans", "plan", "arrays", "maps")

    def __init__(self, tensors: Mapping[str, tuple[tuple[int, ...], np.dtype]],
                 maps: Mapping[str, tuple[tuple[int, ...], np.dtype]]) -> None:  # fmt: skip
        key = tuple((k, tuple(shape), dt) for k, (shape, dt) in tensors.items())
        map_key = tuple((k, tuple(shape), dt) for k, (shape, dt) in maps.items())
        self.spans, self.map_spans, total, self.plan = buffer_plan(key, map_key)
        self.buffer = torch.empty(total, dtype=torch.uint8)
        raw = self.buffer.numpy()

        def view(span: Span, dt) -> np.ndarray:
            off, n, _, shape, _ = span
            return raw[off : off + n].view(dt).reshape(shape)

        self.arrays = {k: view(self.spans[k], dt) for k, (_, dt) in tensors.items()}
        self.maps = {k: view(self.map_spans[k], dt) for k, (_, dt) in maps.items()}

    def batch(self, *, layout: ShardLayout, info: Mapping[str, Any] | None = None) -> ShardedBatch:
        """The filled buffer as a :class:`ShardedBatch`; ``layout``'s map fields become views of the buffer."""
        return ShardedBatch._from_buffer(self.buffer, self.spans, layout, info, self.map_spans, self.plan)


class ShardedBatch(MutableMapping[str, torch.Tensor]):
    """One rank's tensors (a mapping) plus ``.layout`` and ``.info``.

    Args:
        tensors: key -> tensor; see the module docstring for the keys.
        layout: the :class:`ShardLayout` that produced the token tensors.
        info: small plain-python metadata (no tensors).
    """

    __slots__ = ("_tensors", "_layout", "_info", "_buffer", "_spans", "_map_spans", "_head", "_plan")

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
        self._spans: dict[str, Span] = {}  # key -> span in _buffer
        self._map_spans: dict[str, Span] = {}  # layout field -> span in _buffer, after every key
        self._head = 0  # bytes of _buffer before the layout maps
        self._plan: ViewPlan | None = None  # how to view _buffer as the batch's tensors (view_plan of _spans)

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
        return cls._from_buffer(buffer, spans, layout, info, map_spans)

    @classmethod
    def _from_buffer(
        cls, buffer: torch.Tensor, spans: dict[str, Span], layout: ShardLayout, info: Mapping[str, Any] | None,
        map_spans: dict[str, Span], plan: ViewPlan | None = None,
    ) -> ShardedBatch:  # fmt: skip
        """Views of ``buffer`` by ``plan`` (the :func:`view_plan` of ``spans``, computed when None); no
        per-key checks (the spans were made from tensors). Span tables and plans are never mutated, so
        batches derived from one another share them."""
        if plan is None:
            plan = view_plan(spans)
        batch = cls.__new__(cls)
        if map_spans:
            layout = with_fields(layout, views(buffer, map_spans))
            batch._head = min(span[0] for span in map_spans.values())
        else:
            batch._head = buffer.numel()
        batch._tensors, batch._layout, batch._info = plan_views(buffer, plan), layout, dict(info or {})
        batch._buffer, batch._spans, batch._map_spans, batch._plan = buffer, spans, map_spans, plan
        return batch

    def _batch_bytes(self) -> int:
        """Bytes of the buffer's batch part (every key; the layout maps follow)."""
        return self._head

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
            self._buffer, self._spans, self._map_spans, self._head, self._plan = None, {}, {}, 0, None
        self._tensors[key] = value

    def __delitem__(self, key: str) -> None:
        raise TypeError(f"ShardedBatch keys are fixed; cannot delete {key!r}. Use batch.replace() or dict(batch)")

    def __copy__(self) -> ShardedBatch:
        # Same tensor objects: torch's default_convert copies then update()s with the originals, which must
        # not look like replacements (that would drop the single buffer).
        batch = ShardedBatch.__new__(ShardedBatch)  # no per-key checks: the values are this batch's tensors
        batch._tensors, batch._layout, batch._info = dict(self._tensors), self._layout, dict(self._info)
        batch._buffer, batch._spans, batch._map_spans, batch._head, batch._plan = (
            self._buffer, self._spans, self._map_spans, self._head, self._plan)  # fmt: skip
        return batch

    def __reduce__(self):
        if self._buffer is not None:  # one storage: the views are rebuilt from the spans on the other side
            bare = with_fields(self._layout, dict.fromkeys(self._map_spans))
            return _restore_buffer, (self._buffer, self._spans, bare, self._info, self._map_spans, self._plan)
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
        buffer = self._buffer
        if buffer is not None:
            head = buffer if self._head == buffer.numel() else buffer[: self._head]
            if copy and head.device == (device if isinstance(device, torch.device) else torch.device(device)):
                moved = head.clone()  # ~40% cheaper than Tensor.to(copy=True) on CPU
            else:
                moved = head.to(device, non_blocking=non_blocking, copy=copy)
                if moved is head:  # already there: this batch, as Tensor.to returns self
                    return self
            return ShardedBatch._from_buffer(moved, self._spans, self._layout, self._info, {}, self._plan)
        moved = {k: v.to(device, non_blocking=non_blocking, copy=copy) for k, v in self._tensors.items()}
        return ShardedBatch(moved, layout=self._layout, info=self._info)

    def pin_memory(self, device: Any = None) -> ShardedBatch:
        """Tensors and layout tensors in pinned host memory (CUDA builds only)."""
        if self._buffer is not None:
            pinned = self._buffer.pin_memory()
            layout = self._layout if self._map_spans else self._layout.pin_memory()
            return ShardedBatch._from_buffer(pinned, self._spans, layout, self._info, self._map_spans, self._plan)
        pinned = {k: v.pin_memory() for k, v in self._tensors.items()}
        return ShardedBatch(pinned, layout=self._layout.pin_memory(), info=self._info)
