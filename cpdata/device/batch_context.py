"""The ctx a CP batch comes with: :class:`AttentionContextFactory`, what ``ContextParallelSharder.shard`` (and NeMo's
sharders, :mod:`cpdata.nemo`) return as ``ctx`` at cp > 1. Calling it enters nothing: it builds the
:class:`~cpdata.device.cp_attention.ContextParallelAttention` for the batch, with the batch's document mask where
it carries one, and refuses a plain causal mask over a row that packs several documents (torch only).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from cpdata.device.cp_attention import ContextParallelAttention, LocalMaskPolicy
from cpdata.layout.shard_layout import ShardLayout

__all__ = ["AttentionContextFactory"]


@dataclass(frozen=True)
class AttentionContextFactory:
    """What ``ContextParallelSharder.shard`` returns as its ctx at cp > 1: ``ctx()`` is a
    :class:`ContextParallelAttention` with the batch's document mask when it carries one, plain causal
    otherwise; ``document_mask=False`` is allowed only where every row holds one document."""

    layout: ShardLayout
    group: Any = None
    document_ids: torch.Tensor | None = None
    cu_seqlens_padded: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None

    @classmethod
    def of_batch(cls, layout: ShardLayout, group: Any, tensors: Mapping[str, Any]) -> AttentionContextFactory:
        """The factory for a batch's tensors: its ``document_ids`` and slot offsets, where it has them."""
        found = {name: tensors.get(name) for name in ("document_ids", "cu_seqlens_padded", "cu_seqlens")}
        return cls(layout, group, **{k: v if isinstance(v, torch.Tensor) else None for k, v in found.items()})

    def __call__(
        self,
        *,
        document_mask: bool | None = None,
        local_attn_mask: LocalMaskPolicy = "refuse",
        window: int | None = None,
        require_calls: bool = True,
    ) -> ContextParallelAttention:
        known = self.document_ids is not None and self.cu_seqlens_padded is not None
        if document_mask and not known:
            raise ValueError(
                "document_mask=True needs the batch's 'document_ids' (per-token document ids in local order) and "
                "'cu_seqlens_padded'; this batch has none — build it with cpdata's pipeline, or enter ctx() "
                "without document_mask"
            )
        if document_mask is False and known and (most := self._most_documents_in_a_row()) > 1:
            raise ValueError(
                f"ctx(document_mask=False) on a pack with {most} documents in one row: "
                "causal attention over the packed row would attend across documents; enter ctx() (the document "
                "mask is the default), or pack one document per row"
            )
        document_ids = self.document_ids if document_mask is not False and known else None
        return ContextParallelAttention(  # check_every=0: sharder.shard() checked the layout
            self.layout, self.group, document_ids=document_ids, cu_seqlens_padded=self.cu_seqlens_padded,
            cu_seqlens=self.cu_seqlens, local_attn_mask=local_attn_mask, check_every=0, window=window,
            require_calls=require_calls,
        )  # fmt: skip

    def _most_documents_in_a_row(self) -> int:
        """The most slots holding real tokens in one row of ``S`` global positions (one host read)."""
        cu = self.cu_seqlens_padded.to("cpu", torch.int64).reshape(-1)
        real = cu if self.cu_seqlens is None else self.cu_seqlens.to("cpu", torch.int64).reshape(-1)
        row_len = self.layout.padded_seq_len or self.layout.local_token_global_indices.numel() * self.layout.cp_size
        rows = cu[:-1][real.diff() > 0] // row_len
        return int(rows.bincount().max()) if rows.numel() else 0
