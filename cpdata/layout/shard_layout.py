"""``ShardLayout``: what a shard did, so token verbs can undo it (torch only); carried beside the batch tensors,
never inside the batch dict. The inverse map arrives precomputed, so the gather is one collective."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import numpy as np

    from cpdata.layout.exchange import RankExchange

__all__ = ["MAP_FIELDS", "ShardLayout"]

MAP_FIELDS = ("local_token_global_indices", "input_token_stream_positions", "gather_index")
"""The :class:`ShardLayout` fields that hold index tensors (moved, pinned and buffered with the batch)."""


@dataclass(frozen=True)
class ShardLayout:
    """The layout a shard applied, in the coordinates the token verbs need.

    Attributes:
        local_token_global_indices: int64 ``[local_len]``: the global position of each local token.
        original_seq_len: pre-pad sequence length in the caller's coordinates; None for packed streams.
        padded_seq_len: ``cp_size * local_len``, what the token verbs check tensor lengths against.
        input_row_shape: for flat (THD) streams, the ``[B, S]`` shape of the rows before flattening.
        input_token_stream_positions: per row, input position -> padded column (-1 = dropped).
        gather_index: int64 ``[padded_seq_len]``: ``global = concat(all ranks' shards)[gather_index]``.
        digest: 63-bit digest of the plan, equal on every CP rank of a group.
        kv_exchange: this rank's :class:`~cpdata.layout.exchange.RankExchange` (``kv_exchange=True``).
    """

    local_token_global_indices: torch.Tensor | None = None
    original_seq_len: int | None = None
    padded_seq_len: int | None = None
    input_row_shape: tuple[int, ...] | None = None
    input_token_stream_positions: torch.Tensor | None = None
    gather_index: torch.Tensor | None = None
    cp_size: int = 1
    cp_rank: int = 0
    digest: int | None = None
    kv_exchange: RankExchange | None = None

    @classmethod
    def of_rows(cls, rows: np.ndarray, rank: int, **fields: Any) -> ShardLayout:
        """Rank ``rank``'s layout from every rank's rows (int64 ``[cp, L]``, as from ``rank_indices``): its row,
        the inverse map, ``cp_size`` and ``padded_seq_len = cp * L``; ``fields`` set the rest."""
        from cpdata.layout.maps import inverse_indices

        inverse = torch.from_numpy(inverse_indices(rows))
        return cls(local_token_global_indices=torch.from_numpy(rows[rank]), padded_seq_len=rows.size,
                   gather_index=inverse, cp_size=len(rows), cp_rank=rank, **fields)

    def _map_tensors(self, fn) -> ShardLayout:
        maps = {name: getattr(self, name) for name in MAP_FIELDS}
        return replace(self, **{name: fn(t) for name, t in maps.items() if t is not None})

    def to(self, device: torch.device | str, non_blocking: bool = False) -> ShardLayout:
        """A copy with every index tensor on ``device``."""
        return self._map_tensors(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> ShardLayout:
        """A copy with every index tensor in pinned host memory (CUDA builds only)."""
        return self._map_tensors(lambda t: t.pin_memory())
