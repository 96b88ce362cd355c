"""Write Megatron indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``), byte-identical to megatron-core's builder
with one sequence per document (``preprocess_data.py`` without ``--split-sentences``).

The dtype is megatron-core's ``DType.optimal_dtype`` (uint16 below 65,500 ids, else int32). Memory: one
document plus 12 B per document. Both files are written under hidden names and renamed into place, ``.bin``
first (a new ``.bin`` beside an old ``.idx`` is refused by the reader: sizes disagree). Only ``input_ids``
fit the format; labels or masks are refused.
"""

from __future__ import annotations

import os
import struct
from array import array
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from cpdata.sources.base import _written_ids
from cpdata.sources.megatron import DTYPES, MAGIC, VERSION, MegatronIndexed, megatron_paths

__all__ = ["MegatronWriter", "megatron_dtype", "write_megatron"]

_CODES = {dtype: code for code, dtype in DTYPES.items()}
_INT32_MAX = (1 << 31) - 1


def megatron_dtype(vocab_size: int | None) -> np.dtype:
    """megatron-core's choice for a vocabulary: uint16 below 65,500 ids, else int32."""
    return np.dtype("<u2") if vocab_size is not None and vocab_size < 65500 else np.dtype("<i4")


class MegatronWriter:
    """Append documents to ``bin_path``; :meth:`finish` writes ``idx_path`` (``dtype``: default :func:`megatron_dtype`)."""

    def __init__(self, bin_path: Path, idx_path: Path, *, vocab_size: int | None = None,
                 dtype: Any = None, name: str | None = None) -> None:  # fmt: skip
        self.dtype = megatron_dtype(vocab_size) if dtype is None else np.dtype(dtype).newbyteorder("<")
        if self.dtype not in _CODES or self.dtype.kind not in "iu":
            ints = sorted(d.name for d in DTYPES.values() if d.kind in "iu")
            raise ValueError(f"dtype {self.dtype.name} cannot hold Megatron token ids; choose one of {ints}")
        top = int(np.iinfo(self.dtype).max) + 1
        self.limit = top if vocab_size is None else min(int(vocab_size), top)
        if vocab_size is not None and vocab_size > top:
            raise ValueError(f"vocab_size={vocab_size} does not fit dtype {self.dtype.name} (ids up to {top - 1}); "
                             "pass a wider dtype")  # fmt: skip
        self.bin_path, self.idx_path, self.name = bin_path, idx_path, name or str(bin_path)
        self._file = open(bin_path, "wb")  # noqa: SIM115
        self._lengths = array("q")

    @property
    def documents(self) -> int:
        return len(self._lengths)

    def add(self, document: Mapping[str, Any]) -> None:
        """Append one document ``{"input_ids": [n]}``; other per-token keys are refused (the format has none)."""
        index = self.documents
        extra = sorted(k for k in document if k != "input_ids")
        if extra:
            raise ValueError(f"{self.name}: document {index} carries {extra}, but a Megatron indexed dataset holds "
                             "input_ids only; write a token store (`cpdata tokenize --format cpdata`) to keep them")  # fmt: skip
        ids = _written_ids(Path(self.name), index, document, self.limit)
        if ids.shape[0] > _INT32_MAX:
            raise ValueError(f"{self.name}: document {index} has {ids.shape[0]} tokens; the index stores int32 lengths")
        self._file.write(ids.astype(self.dtype).tobytes())
        self._lengths.append(ids.shape[0])

    def finish(self) -> None:
        """Close the ``.bin`` and write the ``.idx`` (both fsynced)."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        lengths = np.frombuffer(self._lengths, dtype=np.int64)
        n = lengths.shape[0]
        pointers = np.zeros(n, dtype="<i8")
        np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        with open(self.idx_path, "wb") as f:
            f.write(MAGIC + struct.pack("<QBQQ", VERSION, _CODES[self.dtype], n, n + 1))
            f.write(lengths.astype("<i4").tobytes())
            f.write(pointers.tobytes())
            f.write(np.arange(n + 1, dtype="<i8").tobytes())
            f.flush()
            os.fsync(f.fileno())


def write_megatron(
    documents: Iterable[Mapping[str, Any]],
    prefix: str | os.PathLike[str],
    *,
    vocab_size: int | None = None,
    dtype: Any = None,
    overwrite: bool = False,
) -> MegatronIndexed:
    """Write ``documents`` as ``PREFIX.bin`` + ``PREFIX.idx`` (module docstring); returns the dataset, opened."""
    bin_path, idx_path = megatron_paths(prefix)
    existing = [str(p) for p in (bin_path, idx_path) if p.exists()]
    if existing and not overwrite:
        raise ValueError(f"{', '.join(existing)} already exist; pass overwrite=True (--force) to replace them")
    if not bin_path.parent.is_dir():
        raise ValueError(f"{bin_path.parent} is not a directory; create it first")
    tmp = [p.with_name(f".{p.name}.tmp-{os.getpid()}") for p in (bin_path, idx_path)]
    writer = None
    try:
        writer = MegatronWriter(tmp[0], tmp[1], vocab_size=vocab_size, dtype=dtype, name=str(bin_path.with_suffix("")))
        for document in documents:
            writer.add(document)
        writer.finish()
        os.replace(tmp[0], bin_path)
        os.replace(tmp[1], idx_path)
    finally:
        if writer is not None and not writer._file.closed:
            writer._file.close()
        for p in tmp:
            p.unlink(missing_ok=True)
    return MegatronIndexed(bin_path.with_suffix(""))
