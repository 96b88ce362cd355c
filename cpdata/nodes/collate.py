"""``Collate`` node: group ``batch_size`` pack plans into one light ``CollatedPack``.

The record holds the plans; their stream metadata (O(slots)) is computed when
first read, and the token tensors only on demand, by
:meth:`CollatedPack.tensors` (the full pack) or by
:class:`~cpdata.nodes.shard.ShardForRank` (one rank's tokens, ~cp times less
work). The plans' slots are checked where a stream is built from them
(:func:`cpdata.stream.slot_block`): by ``ShardForRank`` for a block of
batches at once, so a bad plan raises when its batch is served. The last batch of an epoch may hold fewer than
``batch_size`` plans (like ``DataLoader(drop_last=False)``); every CP rank of a
DP group sees the same short batch.
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from cpdata.collate import check_padding_token_id, check_qkv_format, collate_pack
from cpdata.plan import PackPlan
from cpdata.state_version import check_saved_config, check_state_version
from cpdata.stream import slot_tables

__all__ = ["Collate", "CollatedPack"]


@dataclass(frozen=True, kw_only=True)
class CollatedPack:
    """``B`` plans of equal capacity, ready to collate.

    ``metadata`` (keyword): the stream metadata when already computed; None (the default, the
    ``Collate`` node's): computed from the plans' slot tables when first read. Lazy because
    :class:`~cpdata.nodes.shard.ShardForRank` computes the metadata of a block of batches at once
    (:func:`cpdata.stream.build_streams`) and never reads this one.
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
        """Stream metadata (``cu_seqlens`` & co., see :mod:`cpdata.collate`), computed on first read."""
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


class Collate(BaseNode[CollatedPack]):
    """Group ``batch_size`` plans from ``pack_node`` into a :class:`CollatedPack`.

    State: the source's state under ``"source"`` (the node buffers nothing
    between items), a version, and the config; a state saved under another
    ``batch_size``, ``qkv_format`` or ``padding_token_id`` is refused (pads
    switching value mid-run would train on other inputs).
    """

    SOURCE_KEY = "source"
    VERSION_KEY = "version"
    CONFIG_KEY = "config"
    VERSION = 1

    def __init__(
        self,
        pack_node: BaseNode[PackPlan],
        *,
        batch_size: int = 1,
        qkv_format: str = "bshd",
        padding_token_id: int = 0,
    ) -> None:
        super().__init__()
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        check_qkv_format(qkv_format)
        self.source = pack_node
        self.batch_size = batch_size
        self.qkv_format = qkv_format
        self.padding_token_id = check_padding_token_id(padding_token_id)
        self._exhausted = False

    def _config(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "qkv_format": self.qkv_format, "padding_token_id": self.padding_token_id}

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._exhausted = False
        if initial_state is None:
            self.source.reset(None)
            return
        check_state_version("Collate", initial_state, self.VERSION_KEY, self.VERSION)
        check_saved_config("Collate", initial_state[self.CONFIG_KEY], self._config())
        self.source.reset(initial_state[self.SOURCE_KEY])

    def next(self) -> CollatedPack:
        plans = []
        while not self._exhausted and len(plans) < self.batch_size:
            try:
                plans.append(next(self.source))
            except StopIteration:
                self._exhausted = True  # a short last batch; do not pull an exhausted source again
        if not plans:
            raise StopIteration
        return CollatedPack(
            plans=tuple(plans),
            pack_len=plans[0].capacity,
            qkv_format=self.qkv_format,
            padding_token_id=self.padding_token_id,
        )

    def get_state(self) -> dict[str, Any]:
        return {
            self.VERSION_KEY: self.VERSION,
            self.CONFIG_KEY: self._config(),
            self.SOURCE_KEY: self.source.state_dict(),
        }
