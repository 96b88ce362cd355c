"""``TokenizedDataset``: the base every reader of tokenized documents shares (indexing, slices, id checks, the
parsing of a tokenized row).

Readers of each format subclass it; :func:`cpdata.sources.open.open_dataset` picks one from a path.
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from cpdata.errors import is_int
from cpdata.sources.protocol import declared_labels
from cpdata.worker.targets import ATTENTION_MASK, check_unpadded

__all__ = ["PER_TOKEN_KEYS", "DatasetSlice", "TokenizedDataset", "json_row", "token_row"]

PER_TOKEN_KEYS: tuple[str, ...] = ("labels", "loss_mask", "assistant_masks", "completion_mask")
"""Optional JSONL fields kept as per-token arrays (labels and the mask names of :mod:`cpdata.worker.targets`);
other fields of a row are ignored."""
_UTF8_BOM = b"\xef\xbb\xbf"


def _check_ids(path: Path, index: int, ids: np.ndarray, vocab_size: int | None) -> None:
    if not ids.shape[0]:
        return
    low = int(ids.argmin())
    if ids[low] < 0:
        raise ValueError(
            f"{path}: document {index} has token id {int(ids[low])} at position {low}; token ids index the "
            "vocabulary and must be >= 0 (do not pre-pad with negative ids: cpdata pads with padding_token_id; "
            "put ignored targets such as -100 in 'labels')"
        )
    high = int(ids.argmax())
    if vocab_size is not None and ids[high] >= vocab_size:
        raise ValueError(
            f"{path}: document {index} has token id {int(ids[high])} at position {high}, >= vocab_size={vocab_size}; "
            "check the tokenizer or --vocab-size"
        )


def _written_ids(name: Path, index: int, document: Any, limit: int) -> np.ndarray:
    """A document's ``input_ids`` about to be written: 1-D integers in ``[0, limit)``, else the error names it."""
    ids = np.asarray(document["input_ids"]).reshape(-1)
    if ids.size and ids.dtype.kind not in "iu":
        raise TypeError(f"{name}: document {index}: input_ids must be integers, got {ids.dtype}")
    _check_ids(name, index, ids.astype(np.int64, copy=False), limit)
    return ids


def json_row(line: bytes, path: Path, where: object, offset: int) -> Any:
    """Line ``where`` of the JSONL ``path`` (at byte ``offset``) parsed; anything but UTF-8 (UTF-16/32 too,
    which ``json.loads`` of bytes would take) is refused naming the file, line and byte offset."""
    nul = line.find(b"\0")
    if nul >= 0:  # JSON text never holds a raw NUL byte; UTF-16/32 text does on every ASCII character
        wide = line[:2] in (b"\xff\xfe", b"\xfe\xff")
        bom = " (it starts with a UTF-16/32 byte-order mark)" if wide else ""
        raise ValueError(
            f"{path} line {where} (byte offset {offset + nul}): NUL byte; the file looks "
            f"UTF-16 or UTF-32 encoded{bom}, but JSONL must be UTF-8: convert it, e.g. "
            f"`iconv -f UTF-16 -t UTF-8 {path.name} > out.jsonl`"
        )
    start = len(_UTF8_BOM) if offset == 0 and line.startswith(_UTF8_BOM) else 0
    try:
        return json.loads(line[start:].decode("utf-8"))
    except UnicodeDecodeError as e:
        at = start + e.start
        raise ValueError(
            f"{path} line {where} (byte offset {offset + at}): invalid UTF-8 byte 0x{line[at]:02x} "
            f"({e.reason}); JSONL must be UTF-8 encoded, every field included: re-encode the file as UTF-8 "
            "or fix the bytes of that line"
        ) from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} line {where}: not valid JSON ({e.msg} at column {e.colno})") from None


def token_row(row: Any, where: str, *, every_list: bool = False) -> dict[str, np.ndarray]:
    """A tokenized row (JSON, or an Arrow row's arrays) as a document: int64 ``input_ids`` ``[n]`` and the
    lists of :data:`PER_TOKEN_KEYS` (``[n]`` each, ``labels`` integers); an all-ones ``attention_mask`` is
    dropped, a padded one refused. ``every_list`` (``cpdata pack-store``, a ``datasets.Dataset``) keeps every
    other flat numeric list of ``[n]`` too; ragged or non-numeric ones are metadata, skipped. Errors start
    with ``where``."""
    if not isinstance(row, dict) or not isinstance(row.get("input_ids"), (list, np.ndarray)):
        text = isinstance(row, dict) and ("text" in row or "messages" in row)
        untokenized = text and "input_ids" not in row
        hint = ("; the rows are text or chat, not tokens: tokenize them first (`cpdata precompute FILE "
                "--tokenizer PATH ...` tokenizes and plans in one go, `cpdata tokenize FILE --tokenizer PATH "
                "--out DIR` writes a token store, cpdata.Tokenize(rows, tokenizer) does it in Python)"
                if untokenized else "")  # fmt: skip
        raise ValueError(
            f"{where}: expected an object with an 'input_ids' list, "
            f"got {type(row).__name__} with keys {sorted(row) if isinstance(row, dict) else []}{hint}"
        )
    out = {"input_ids": _array(row["input_ids"], "input_ids", where, integer=True)}
    named = [k for k in (*PER_TOKEN_KEYS, ATTENTION_MASK) if k in row]
    others = [k for k, v in row.items() if every_list and isinstance(v, (list, np.ndarray))
              and k not in (*named, "input_ids")]  # fmt: skip
    for key in (*named, *others):
        value = _array(row[key], key, where, integer=key == "labels", strict=key in named)
        if value is None:
            continue
        if value.shape != out["input_ids"].shape:
            raise ValueError(
                f"{where}: {key!r} has {value.shape[0]} entries but input_ids has "
                f"{out['input_ids'].shape[0]}; per-token fields must match input_ids"
            )
        if key == ATTENTION_MASK:  # a tokenizer's output: all ones is dropped, a padded row refused
            check_unpadded(value, where)
        else:
            out[key] = value
    return out


def _array(value: object, key: str, where: str, *, integer: bool, strict: bool = True) -> np.ndarray | None:
    """A 1-D numeric array of a row's field, nothing cast, rounded or flattened silently (not ``strict``: None
    for anything else)."""
    try:
        arr = np.asarray(value)
    except ValueError:  # ragged nested lists
        arr = np.asarray(value, dtype=object)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim == 1 and arr.dtype.kind in ("iu" if integer else "iufb"):
        return arr.astype(np.int64) if integer else arr
    if not strict:
        return None
    raise ValueError(
        f"{where}: {key!r} must be a flat list of {'integers' if integer else 'numbers'}, got shape "
        f"{arr.shape} of {arr.dtype} (first values {arr.reshape(-1)[:4].tolist()}); write one token per entry"
    )


class TokenizedDataset(ABC):
    """A dataset of tokenized documents addressed by index; ``lengths`` is int64 ``[n_docs]`` (may be
    memory-mapped), ``serves_tokens`` False for a lengths-only file."""

    kind: str = ""
    serves_tokens: bool = True
    per_token_keys: frozenset[str] = frozenset()
    """Per-token keys besides ``input_ids`` that some document carries (``labels``, masks)."""
    _transient: tuple[str, ...] = ()
    """Attributes a pickled copy (a worker's) leaves out: handles, maps and caches it rebuilds."""
    _id_range: tuple[int, int] | None = None
    """``(lowest, highest)`` id of every document when the reader knows it without reading them ((0, -1): none)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    @property
    def lengths(self) -> np.ndarray:
        return self._lengths  # set by the reader, or computed on first use by an override

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        """Document ``i`` as ``{"input_ids": int64 [n], "labels"?: [n], ...}``; a slice gives a :class:`DatasetSlice` view."""
        if isinstance(i, slice):
            return DatasetSlice(self, i)  # type: ignore[return-value]
        n = len(self)
        if not is_int(i):
            raise TypeError(f"documents are addressed by an int index or a slice (dataset[:1000], a view), got "
                            f"{type(i).__name__} {i!r}")  # fmt: skip
        if not -n <= i < n:
            raise IndexError(f"document index {i} out of range for {n} documents in {self.path}")
        return self._read(int(i) % n)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        for i in range(len(self)):
            yield self[i]

    @abstractmethod
    def _read(self, i: int) -> dict[str, np.ndarray]: ...

    @abstractmethod
    def fingerprint(self) -> str:
        """The one identity a resume or a plan binds to (:mod:`cpdata.sources.fingerprint`)."""

    @abstractmethod
    def check_unchanged(self) -> None:
        """Raise ``ValueError`` naming what changed since the data was opened."""

    def check_token_ids(self, vocab_size: int | None = None) -> None:
        """Raise ``ValueError`` naming the first document holding an id ``< 0`` or ``>= vocab_size`` (reads
        every document unless ``_id_range`` is known and within bounds)."""
        low, high = self._id_range or (-1, 0)  # unknown: read every document
        if not self.serves_tokens or (low >= 0 and (vocab_size is None or high < vocab_size)):
            return
        for i in range(len(self)):
            _check_ids(self.path, i, self._read(i)["input_ids"], vocab_size)

    def verify_content(self) -> None:  # noqa: B027 (a no-op unless the format records checksums)
        """Check every stored byte against checksums recorded with the data (a token store); ``precompute``
        calls it."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r}, documents={len(self)})"

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, **dict.fromkeys(self._transient)}


class DatasetSlice(TokenizedDataset):
    """Documents ``parent[s]`` for a slice ``s`` (what ``parent[a:b:c]`` returns): a view, nothing is copied.

    Document ``i`` is read through the parent (its checks apply); ``indices`` costs 8 B per document. The
    fingerprint is the parent's plus the slice, so a resume or a plan binds to the same documents.
    """

    _transient = ("_lengths",)

    def __init__(self, parent: TokenizedDataset, part: slice) -> None:
        super().__init__(parent.path)
        self.parent = parent
        self.start, self.stop, self.step = part.indices(len(parent))
        self.indices = np.arange(self.start, self.stop, self.step, dtype=np.int64)
        self.kind = parent.kind
        self.serves_tokens = parent.serves_tokens
        self.per_token_keys = parent.per_token_keys
        alignment = declared_labels(parent)
        if alignment is not None:
            self.labels_alignment = alignment
        self._lengths: np.ndarray | None = None

    @property
    def _part(self) -> str:
        return f"[{self.start}:{self.stop}:{self.step}]"

    @property
    def lengths(self) -> np.ndarray:
        if self._lengths is None:
            self._lengths = np.asarray(self.parent.lengths, dtype=np.int64)[self.indices]
        return self._lengths

    def __len__(self) -> int:
        return int(self.indices.shape[0])

    def _read(self, i: int) -> dict[str, np.ndarray]:
        return self.parent[int(self.indices[i])]

    def describe_document(self, i: int) -> str | None:
        """``"document 7 of the slice [5:100:1] (document 12 of PATH)"``: errors name both indices."""
        if not 0 <= i < len(self):
            return None
        return f"document {i} of the slice {self._part} (document {int(self.indices[i])} of {self.parent.path})"

    def verify_content(self) -> None:
        self.parent.verify_content()

    def fingerprint(self) -> str:
        return f"{self.parent.fingerprint()}{self._part}"

    def check_unchanged(self) -> None:
        self.parent.check_unchanged()

    def __repr__(self) -> str:
        return f"{self.parent!r}{self._part}"
