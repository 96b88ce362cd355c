"""Several tokenized datasets read as one, in order: the shards a distributed tokenizer wrote.

``open_dataset([shard0, shard1, ...])`` gives :class:`ConcatDataset`: document ``i`` is document
``i - starts[s]`` of shard ``s``, ``lengths`` the shards' lengths back to back (8 B/document), so a plan
from the lengths serves from the shards without merging a byte. The fingerprint covers every shard's in
order; errors about a document name the shard and its index there.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from cpdata.errors import naming_parts
from cpdata.sources.base import TokenizedDataset
from cpdata.sources.protocol import carried_targets, declared_labels
from cpdata.worker.targets import agreed_alignment

__all__ = ["ConcatDataset"]


class ConcatDataset(TokenizedDataset):
    """``parts`` (at least one dataset) one after the other (module docstring)."""

    kind = "concat"
    _transient = ("_lengths",)

    def __init__(self, parts: Sequence[TokenizedDataset]) -> None:
        parts = list(parts)
        if not parts:
            raise ValueError("open_dataset([...]) needs at least one path: the shards of the dataset, in order")
        for k, part in enumerate(parts):
            if not isinstance(part, TokenizedDataset):
                raise TypeError(f"part {k} is a {type(part).__name__}, not a dataset open_dataset() opened")
        names = ",".join(p.path.name for p in parts[:3]) + (",..." if len(parts) > 3 else "")
        super().__init__(Path(f"concat({len(parts)}:{names})"))
        self.parts = parts
        self.starts = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int64)
        """int64 ``[parts + 1]``: part ``s`` is documents ``starts[s]:starts[s + 1]``."""
        self.serves_tokens = all(p.serves_tokens for p in parts)
        self.per_token_keys = frozenset().union(*(p.per_token_keys for p in parts))
        named = [(f"part {k} ({part.path})", declared_labels(part), bool(carried_targets(part)))
                 for k, part in enumerate(parts)]  # fmt: skip
        self.labels_alignment = agreed_alignment(
            "open_dataset([...])", named, "rewrite one side's labels in the other convention (shift them by one "
            "token) or write them as a token store that declares theirs (write_token_store(..., "
            "labels_alignment=...)) before concatenating, or train on them as separate sources")
        self._lengths: np.ndarray | None = None

    @property
    def lengths(self) -> np.ndarray:
        if self._lengths is None:
            self._lengths = np.concatenate([np.asarray(p.lengths, dtype=np.int64) for p in self.parts])
        return self._lengths

    def __len__(self) -> int:
        return int(self.starts[-1])

    def locate(self, i: int) -> tuple[int, int]:
        """``(part, index in it)`` of document ``i``."""
        s = int(np.searchsorted(self.starts, i, side="right")) - 1
        return s, i - int(self.starts[s])

    def _read(self, i: int) -> dict[str, np.ndarray]:
        s, j = self.locate(i)
        return self.parts[s][j]

    def describe_document(self, i: int) -> str | None:
        """``"document 5 of part 1 (shard1_text_document)"``: errors about document ``i`` say this instead."""
        if not 0 <= i < len(self):
            return None
        s, j = self.locate(i)
        return f"document {j} of part {s} ({self.parts[s].path})"

    def _named(self) -> list[tuple[str, TokenizedDataset]]:
        """``("part 1 of 3 (PATH)", part)`` of every part: how a check's error names the part that failed."""
        return [(f"part {s} of {len(self.parts)} ({p.path})", p) for s, p in enumerate(self.parts)]

    def check_token_ids(self, vocab_size: int | None = None) -> None:
        naming_parts(self._named(), lambda part: part.check_token_ids(vocab_size))

    def verify_content(self) -> None:
        """Every part checks its stored bytes (a token store: every chunk); an error names the part."""
        naming_parts(self._named(), lambda part: part.verify_content())

    def fingerprint(self) -> str:
        parts = [p.fingerprint() for p in self.parts]
        return f"concat:{hashlib.blake2b(json.dumps(parts).encode(), digest_size=16).hexdigest()}"

    def check_unchanged(self) -> None:
        named = ((f"part {s} of {len(self.parts)}", p) for s, p in enumerate(self.parts))
        naming_parts(named, lambda part: part.check_unchanged())

