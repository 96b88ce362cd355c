"""Batch keys and their pad values: one table every stage reads (meanings: docs/batch-contents.md).

| key            | dtype  | pad value                         |
|----------------|--------|-----------------------------------|
| input_ids      | int64  | ``padding_token_id``              |
| labels         | int64  | -100 (also at every document end) |
| position_ids   | int64  | continue the slot's document      |
| padding_mask   | bool   | True                              |
| document_ids   | int64  | the slot's index                  |
| loss_mask, extras | source | 0                              |

Stream metadata (global, TE / flash-attn varlen conventions): ``cu_seqlens`` and ``cu_seqlens_padded``
(int32 ``[n+1]``), ``seq_lens`` and ``seq_lens_padded`` (int32 ``[n]``), ``max_seqlen`` (0-d int32)."""

from __future__ import annotations

__all__ = ["DOCUMENT_IDS", "IGNORE_INDEX", "INPUT_IDS", "LABELS", "LOSS_MASK", "METADATA_KEYS", "N_TARGETS",
           "PADDING_MASK", "POSITION_IDS", "STANDARD_TOKEN_KEYS"]  # fmt: skip

INPUT_IDS = "input_ids"
LABELS = "labels"
POSITION_IDS = "position_ids"
PADDING_MASK = "padding_mask"
DOCUMENT_IDS = "document_ids"
LOSS_MASK = "loss_mask"
IGNORE_INDEX = -100

STANDARD_TOKEN_KEYS: tuple[str, ...] = (INPUT_IDS, LABELS, POSITION_IDS, PADDING_MASK, DOCUMENT_IDS)
METADATA_KEYS: tuple[str, ...] = ("cu_seqlens", "cu_seqlens_padded", "seq_lens", "seq_lens_padded", "max_seqlen")
N_TARGETS = "n_targets"
"""The ``batch.info`` key of the batch's target count (all rows, all CP ranks)."""
