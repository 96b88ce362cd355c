"""Hugging Face ``datasets`` as a tokenized source: :class:`HFDocuments` wraps a ``datasets.Dataset`` with an
``input_ids`` list column as a :class:`~cpdata.sources.base.TokenizedDataset`.

Lengths come from a ``length``/``num_tokens`` column when present, else from the Arrow list offsets (no token
values read). A read is one Arrow row; every list-of-numbers column travels as a per-token array, an
all-ones ``attention_mask`` is dropped and a padded one refused. A streaming ``IterableDataset`` has no
index: the loaders read it in order, planners refuse it. ``datasets`` is an optional extra, imported only
when a dataset is wrapped.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from cpdata.sources.base import TokenizedDataset, token_row
from cpdata.sources.fingerprint import LIST_SAMPLES, sample_digest, sample_positions
from cpdata.sources.protocol import is_hf_dataset

__all__ = ["LENGTH_COLUMNS", "HFDocuments", "is_hf_dataset"]

LENGTH_COLUMNS: tuple[str, ...] = ("length", "num_tokens")
"""Integer columns taken as tokens per document, in this order of preference."""


def _per_token(feature: Any) -> bool:
    """A list column of numbers (``List(Value('int32'))``, ``Sequence(Value('float32'))``, ...)."""
    from datasets import LargeList, Sequence, Value

    inner = feature.feature if isinstance(feature, (Sequence, LargeList)) else None
    return isinstance(inner, Value) and inner.dtype.startswith(("int", "uint", "float", "bool"))


class HFDocuments(TokenizedDataset):
    """A ``datasets.Dataset`` of tokenized rows as a :class:`TokenizedDataset` (module docstring).

    ``length_column``: the column of tokens per document; None picks the first of :data:`LENGTH_COLUMNS`
    present, ``""`` never uses one."""

    kind = "hf_dataset"

    def __init__(self, dataset: Any, *, length_column: str | None = None) -> None:
        if is_hf_dataset(dataset, "IterableDataset"):
            raise TypeError(
                "a streaming datasets.IterableDataset has no index, so it cannot be planned ahead or served "
                "from a plan; materialise it (datasets.Dataset.from_generator(lambda: iter(ds)), or load it "
                "without streaming=True), or pass it to build_loader/CPDataset, which read it in order"
            )
        if not is_hf_dataset(dataset):
            raise TypeError(f"expected a datasets.Dataset, got {type(dataset).__name__}")
        columns = list(dataset.column_names)
        if "input_ids" not in columns:
            raise ValueError(
                f"the datasets.Dataset has columns {columns} but no 'input_ids'; tokenize it first "
                "(dataset.map(lambda row: tokenizer(row['text']), batched=True) or cpdata.Tokenize)"
            )
        if length_column is None:
            length_column = next((c for c in LENGTH_COLUMNS if c in columns), "")
        elif length_column and length_column not in columns:
            raise ValueError(f"length_column={length_column!r} is not a column of the dataset; columns: {columns}")
        cache = [f["filename"] for f in dataset.cache_files]
        self._cache_sizes = {name: os.stat(name).st_size for name in cache}
        super().__init__(Path(cache[0]).parent if cache else Path(f"datasets-{dataset._fingerprint}"))
        self.dataset = dataset
        self.length_column = length_column
        per_token = [c for c in columns if c != length_column and _per_token(dataset.features[c])]
        keys = ["input_ids", *(c for c in per_token if c != "input_ids")]
        self._rows = dataset.select_columns(keys).with_format("numpy")
        self._lengths = self._read_lengths()
        self._samples = sample_digest(self._rows, len(self._lengths))

    def _read_lengths(self) -> np.ndarray:
        if self.length_column:
            raw = np.asarray(self.dataset.with_format("numpy")[self.length_column])
            if raw.ndim != 1 or raw.dtype.kind not in "iu":
                raise ValueError(
                    f"length column {self.length_column!r} must hold one integer per row, got dtype {raw.dtype} "
                    f"shape {raw.shape}; drop it or pass length_column=''"
                )
            lengths = raw.astype(np.int64)
        else:
            import pyarrow.compute as pc

            counts = pc.list_value_length(self._token_column())
            if self.dataset._indices is not None:  # a select/shuffle/filter view: its rows' lengths, in its order
                counts = pc.take(counts, self.dataset._indices.column(0))
            if counts.null_count:
                raise ValueError("the dataset's 'input_ids' column has null rows; fill or filter them first")
            lengths = np.asarray(counts.to_numpy(zero_copy_only=False), dtype=np.int64)
        if lengths.size and int(lengths.min()) < 0:
            bad = int(np.argmin(lengths))
            raise ValueError(f"length column {self.length_column!r}: row {bad} has negative length {int(lengths[bad])}")
        return lengths

    def _read(self, i: int) -> dict[str, np.ndarray]:
        out = token_row(self._rows[i], f"dataset row {i}", every_list=True)
        if out["input_ids"].shape[0] != self._lengths[i]:
            raise ValueError(
                f"dataset row {i}: {self.length_column or 'input_ids'} says {int(self._lengths[i])} tokens but "
                f"'input_ids' has {out['input_ids'].shape[0]}; fix the {self.length_column!r} column or pass "
                "length_column=''"
            )
        return out

    def _token_column(self) -> Any:
        return self.dataset.data.column("input_ids")  # the Arrow column, every row (before any indices mapping)

    @property
    def _id_range(self) -> tuple[int, int]:  # type: ignore[override]
        """One Arrow min/max over all tokens (C speed): rows are read only to name a culprit."""
        import pyarrow.compute as pc

        bounds = pc.min_max(pc.list_flatten(self._token_column())).as_py()
        return (0, -1) if bounds["min"] is None else (bounds["min"], bounds["max"])

    def fingerprint(self) -> str:
        """``hf_dataset:`` + the sha256 of ``_fingerprint`` (it names the transforms, not the bytes), rows,
        columns, features and length column + the sampled rows' values (:mod:`cpdata.sources.fingerprint`)."""
        ds = self.dataset
        identity = {"fingerprint": ds._fingerprint, "rows": len(ds), "columns": list(ds.column_names),
                    "features": str(ds.features), "length_column": self.length_column}  # fmt: skip
        return f"hf_dataset:{hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()}:{self._samples}"

    def check_unchanged(self) -> None:
        """Raise ``ValueError`` if an Arrow cache file of the dataset changed size, or a sampled row's
        ``input_ids`` changed, since it was opened (16 row reads)."""
        now = sample_digest(self._rows, len(self._lengths))
        if now != self._samples:
            raise ValueError(
                f"the datasets.Dataset {self.dataset._fingerprint!r} changed since it was opened: the input_ids of "
                f"sampled rows (of {sample_positions(len(self), LIST_SAMPLES)}) differ (its Arrow files were "
                "edited in place); load the dataset again and start a new run"
            )
        for name, size in self._cache_sizes.items():
            now = os.stat(name).st_size if os.path.exists(name) else None
            if now != size:
                raise ValueError(
                    f"the datasets cache file {name} changed since it was opened ({size} bytes then, {now} now); "
                    "load the dataset again and start a new run"
                )

    def __repr__(self) -> str:
        return f"HFDocuments(fingerprint={self.dataset._fingerprint!r}, documents={len(self)})"

