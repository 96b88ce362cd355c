"""``CollatedPack``: ``B`` pack plans of one batch, with stream metadata computed on first read.

The record the ``Collate`` node emits and ``ShardForRank`` consumes. Its stream
metadata (O(slots)) is computed when first read, the full token tensors only on
demand (:meth:`CollatedPack.tensors`); a rank's own tokens are gathered by
:class:`~cpdata.nodes.shard.ShardForRank` (~cp times less work).
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass

import numpy as np

from cpdata.worker.collate import collate_pack
from cpdata.worker.plan import PackPlan
from cpdata.worker.stream import slot_tables

__all__ = ["CollatedPack"]


@dataclass(frozen=True, kw_only=True)
class CollatedPack:
    """``B`` plans of equal capacity, ready to collate.

    ``metadata`` (keyword): the stream metadata when already computed; None (the default, the
    ``Collate`` node's): computed from the plans' slot tables when first read. Lazy because
    :class:`~cpdata.nodes.shard.ShardForRank` computes the metadata of a block of batches at once
    (:func:`cpdata.worker.stream.build_streams`) and never reads this one.
    """

    plans: tuple[PackPlan, ...]
    """The batch's plans, one per row (bshd) or concatenated (thd)."""
    pack_len: int
    """Tokens per plan (the capacity ``S``)."""
    qkv_format: str
    """``"bshd"`` (``[B, S]`` rows) or ``"thd"`` (flat ``[B*S]`` stream)."""
    padding_token_id: int
    """``input_ids`` value on pads."""
    metadata: InitVar[dict[str, np.ndarray] | None] = None  # (read through the property set below)

    def __post_init__(self, metadata: dict[str, np.ndarray] | None) -> None:
        object.__setattr__(self, "_metadata", metadata)

    def _read_metadata(self) -> dict[str, np.ndarray]:
        """Stream metadata (``cu_seqlens`` & co., see :mod:`cpdata.worker.collate`), computed on first read."""
        if self._metadata is None:
            object.__setattr__(self, "_metadata", slot_tables(self.plans).metadata())
        return self._metadata

    @property
    def row_shape(self) -> tuple[int, int]:
        """``(B, S)``."""
        return (len(self.plans), self.pack_len)

    def tensors(self) -> dict[str, np.ndarray]:
        """The full batch (every token), built now: O(B*S)."""
        return collate_pack(self.plans, padding_token_id=self.padding_token_id, qkv_format=self.qkv_format)


CollatedPack.metadata = property(CollatedPack._read_metadata, doc=CollatedPack._read_metadata.__doc__)  # type: ignore[assignment,method-assign]
