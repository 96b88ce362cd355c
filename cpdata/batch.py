"""``ShardedBatch``: one CP rank's batch, a mapping of tensors with its layout beside it.

The model reads it like ``Mapping[str, torch.Tensor]``: the token tensors of
this rank in local order (``input_ids``, ``labels``, ``position_ids``,
``padding_mask``, ``document_ids``, extras; ``[B, L]`` for bshd, ``[L]`` for
thd) and the global stream metadata (``cu_seqlens`` & co., see
:mod:`cpdata.keys`). Two attributes travel beside the keys, never inside them:

- ``layout`` (:class:`~cpdata.shard_layout.ShardLayout`): what the shard did,
  for the device sharder and the gather.
- ``info``: a small plain-python dict for logging (pack indices, token counts,
  number of documents, causal work per rank, digest).

Frozen-ish: the key set is fixed and ``layout``/``info`` cannot be reassigned;
an existing key may be replaced by a tensor of the same shape (the path
torch's ``default_convert`` and ``pin_memory`` take: ``copy.copy`` then
``update``), which keeps the batch a ``ShardedBatch`` through
``StatefulDataLoader(batch_size=None)`` and its pin-memory thread. To add or
drop keys, build a new batch with :meth:`replace` or use ``dict(batch)``.
Pickles by value (tensors through torch's shared-memory reducers across
worker processes).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import torch

from cpdata.shard_layout import ShardLayout

__all__ = ["ShardedBatch"]


def _restore(tensors: dict[str, torch.Tensor], layout: ShardLayout, info: dict[str, Any]) -> ShardedBatch:
    return ShardedBatch(tensors, layout=layout, info=info)


class ShardedBatch(MutableMapping[str, torch.Tensor]):
    """One rank's tensors (a mapping) plus ``.layout`` and ``.info``.

    Args:
        tensors: key -> tensor; see the module docstring for the keys.
        layout: the :class:`ShardLayout` that produced the token tensors.
        info: small plain-python metadata (no tensors).
    """

    __slots__ = ("_tensors", "_layout", "_info")

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
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise TypeError(
                f"ShardedBatch[{key!r}] may only be replaced by a tensor of shape {tuple(old.shape)}, got {got}; "
                "use batch.replace(...) to change shapes"
            )
        self._tensors[key] = value

    def __delitem__(self, key: str) -> None:
        raise TypeError(f"ShardedBatch keys are fixed; cannot delete {key!r}. Use batch.replace() or dict(batch)")

    def __copy__(self) -> ShardedBatch:
        return ShardedBatch(self._tensors, layout=self._layout, info=self._info)

    def __reduce__(self):
        return _restore, (self._tensors, self._layout, self._info)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}: {tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}" for k, v in self.items())
        return f"ShardedBatch(cp_rank={self._layout.cp_rank}/{self._layout.cp_size}, {{{shapes}}})"

    def replace(self, **tensors: torch.Tensor | None) -> ShardedBatch:
        """A new batch with keys set (or removed, for ``None``); layout and info kept."""
        out = dict(self._tensors)
        for k, v in tensors.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = v
        return ShardedBatch(out, layout=self._layout, info=self._info)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> ShardedBatch:
        """Tensors on ``device``; the layout stays on the host (the sharder moves what it needs)."""
        moved = {k: v.to(device, non_blocking=non_blocking) for k, v in self._tensors.items()}
        return ShardedBatch(moved, layout=self._layout, info=self._info)

    def pin_memory(self, device: Any = None) -> ShardedBatch:
        """Tensors and layout tensors in pinned host memory (CUDA builds only)."""
        pinned = {k: v.pin_memory() for k, v in self._tensors.items()}
        return ShardedBatch(pinned, layout=self._layout.pin_memory(), info=self._info)
