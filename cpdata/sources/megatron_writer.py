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

__all__ = ["write_megatron"]

_CODES = {dtype: code for code, dtype in DTYPES.items()}
_INT32_MAX = (1 << 31) - 1


def _dtype(vocab_size: int | None, dtype: Any) -> tuple[np.dtype, int]:
    """``(dtype, limit)``: the token dtype (None: as the module docstring says) and the ids it holds, ``[0, limit)``."""
    if dtype is None:
        dtype = np.dtype("<u2") if vocab_size is not None and vocab_size < 65500 else np.dtype("<i4")
    dtype = np.dtype(dtype).newbyteorder("<")
    if dtype not in _CODES or dtype.kind not in "iu":
        ints = sorted(d.name for d in DTYPES.values() if d.kind in "iu")
        raise ValueError(f"dtype {dtype.name} cannot hold Megatron token ids; choose one of {ints}")
    top = int(np.iinfo(dtype).max) + 1
    if vocab_size is not None and vocab_size > top:
        raise ValueError(f"vocab_size={vocab_size} does not fit dtype {dtype.name} (ids up to {top - 1}); "
                         "pass a wider dtype")  # fmt: skip
    return dtype, top if vocab_size is None else int(vocab_size)


def _write(documents: Iterable[Mapping[str, Any]], bin_path: Path, idx_path: Path, dtype: np.dtype, limit: int,
           name: Path) -> None:  # fmt: skip
    """Append every document's ids to ``bin_path``, then write ``idx_path`` (both fsynced)."""
    lengths = array("q")
    with open(bin_path, "wb") as f:
        for index, document in enumerate(documents):
            extra = sorted(k for k in document if k != "input_ids")
            if extra:
                raise ValueError(f"{name}: document {index} carries {extra}, but a Megatron indexed dataset holds "
                                 "input_ids only; write a token store (`cpdata tokenize --format cpdata`) to keep "
                                 "them")  # fmt: skip
            ids = _written_ids(name, index, document, limit)
            if ids.shape[0] > _INT32_MAX:
                raise ValueError(f"{name}: document {index} has {ids.shape[0]} tokens; the index stores int32 "
                                 "lengths")  # fmt: skip
            f.write(ids.astype(dtype).tobytes())
            lengths.append(ids.shape[0])
        f.flush()
        os.fsync(f.fileno())
    n = len(lengths)
    sizes = np.frombuffer(lengths, dtype=np.int64)
    pointers = np.zeros(n, dtype="<i8")
    np.cumsum(sizes[:-1] * dtype.itemsize, out=pointers[1:])
    with open(idx_path, "wb") as f:
        f.write(MAGIC + struct.pack("<QBQQ", VERSION, _CODES[dtype], n, n + 1))
        f.write(sizes.astype("<i4").tobytes())
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
    dtype, limit = _dtype(vocab_size, dtype)
    tmp = [p.with_name(f".{p.name}.tmp-{os.getpid()}") for p in (bin_path, idx_path)]
    try:
        _write(documents, tmp[0], tmp[1], dtype, limit, bin_path.with_suffix(""))
        os.replace(tmp[0], bin_path)
        os.replace(tmp[1], idx_path)
    finally:
        for p in tmp:
            p.unlink(missing_ok=True)
    return MegatronIndexed(bin_path.with_suffix(""))
