"""``CollatedPack``: the record between ``Collate`` and ``ShardForRank``, ``B`` plans of one batch."""

from __future__ import annotations

from dataclasses import InitVar, dataclass

import numpy as np

from cpdata.worker.collate import collate_pack
from cpdata.worker.plan import PackPlan
from cpdata.worker.stream_slots import pack_metadata

__all__ = ["CollatedPack"]


@dataclass(frozen=True, kw_only=True)
class CollatedPack:
    """``B`` plans of equal capacity, ready to collate.

    ``metadata``: the stream metadata when already computed, else computed from the slot tables when first
    read (``ShardForRank`` computes a block's at once and never reads this one)."""

    plans: tuple[PackPlan, ...]
    """One per row (bshd) or concatenated (thd)."""
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
        """Stream metadata (``cu_seqlens`` & co.), computed on first read."""
        if self._metadata is None:
            object.__setattr__(self, "_metadata", pack_metadata(self.plans))
        return self._metadata

    @property
    def row_shape(self) -> tuple[int, int]:
        """``(B, S)``."""
        return (len(self.plans), self.pack_len)

    def tensors(self) -> dict[str, np.ndarray]:
        """The full batch, built now: O(B*S)."""
        return collate_pack(self.plans, padding_token_id=self.padding_token_id, qkv_format=self.qkv_format)


CollatedPack.metadata = property(CollatedPack._read_metadata, doc=CollatedPack._read_metadata.__doc__)  # type: ignore[assignment,method-assign]
