"""On-disk format of a precomputed plan: ``.npy`` arrays plus a checksummed manifest.

A plan directory holds ``manifest.json`` (format and version, configuration, counts, stats, the input's
identity, and each array's dtype, shape and sha256) and the arrays of :data:`ARRAYS`: the CSR
``pack_offsets`` (int64 ``[n_packs + 1]``) over per-piece ``doc_index``, ``doc_start``, ``doc_len``,
``slot_len`` (int64 ``[n_pieces]``) and ``continues`` (bool), and per-pack ``pack_tokens`` (int64
``[n_packs]``) and ``rank_work`` (int64 ``[n_packs, cp]``). Output is byte-identical for identical inputs;
the manifest carries its own digest; writes are atomic (:func:`cpdata.sources.atomic.atomic_directory`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cpdata.sources.atomic import atomic_directory, interrupted_write, stall
from cpdata.sources.chunksums import file_sums
from cpdata.sources.manifest import DIGEST_KEY, MANIFEST, read_manifest, write_manifest

__all__ = ["ARRAYS", "FORMAT", "FORMAT_VERSION", "MANIFEST", "PackStore", "read_store", "reopen_store", "write_store"]

FORMAT = "cpdata.packs"
FORMAT_VERSION = 2
"""2: the input is bound by its identity (:func:`cpdata.sources.fingerprint.source_identity`); 1: by checksums."""
ARRAYS: tuple[str, ...] = ("continues", "doc_index", "doc_len", "doc_start", "pack_offsets", "pack_tokens", "rank_work",
                           "slot_len")
_RERUN = "re-run `cpdata precompute` to rebuild the directory"


@dataclass(frozen=True, kw_only=True, slots=True)
class PackStore:
    """A verified plan directory; arrays are memory-mapped, read-only."""

    path: Path
    """The directory."""
    manifest: Mapping[str, Any]
    """Parsed ``manifest.json``."""
    arrays: Mapping[str, np.ndarray]
    """Every array of :data:`ARRAYS`, memory-mapped."""

    @property
    def digest(self) -> str:
        """sha256 of the manifest's canonical content; it names this exact plan."""
        return str(self.manifest[DIGEST_KEY])

    @property
    def config(self) -> Mapping[str, Any]:
        return self.manifest["config"]

    @property
    def n_packs(self) -> int:
        return int(self.arrays["pack_offsets"].shape[0]) - 1

    def pack_slice(self, k: int) -> slice:
        """Rows of the piece arrays that belong to pack ``k``."""
        offsets = self.arrays["pack_offsets"]
        return slice(int(offsets[k]), int(offsets[k + 1]))

    def __reduce__(self) -> tuple[Any, ...]:
        # A worker process maps the arrays itself instead of receiving copies of them.
        return reopen_store, (self.path, self.digest)


def reopen_store(path: Path, digest: str) -> PackStore:
    """The plan at ``path`` read again (fresh memory maps), refused unless its manifest digest is still ``digest``."""
    now = read_store(path, verify=False)
    if now.digest != digest:
        raise ValueError(
            f"plan {path} changed on disk since this node opened it (manifest sha256 {digest[:16]}… then, "
            f"{now.digest[:16]}… now: it was precomputed again); its packs differ: build a new pipeline on the "
            "new plan, as a new run, or restore the old plan"
        )
    return now


def write_store(out_dir: str | os.PathLike[str], arrays: Mapping[str, np.ndarray], manifest: Mapping[str, Any], *,
                overwrite: bool = False) -> None:  # fmt: skip
    """Write ``arrays`` and ``manifest`` (plus array entries and digest) atomically."""
    if sorted(arrays) != sorted(ARRAYS):
        raise ValueError(f"write_store needs exactly the arrays {list(ARRAYS)}, got {sorted(arrays)}")
    with atomic_directory(out_dir, overwrite=overwrite) as tmp:
        entries = {}
        for k, name in enumerate(ARRAYS):
            if k == len(ARRAYS) // 2:
                stall("writing")
            arr = np.ascontiguousarray(arrays[name])
            path = tmp / f"{name}.npy"
            np.save(path, arr, allow_pickle=False)
            entries[name] = {"file": path.name, "dtype": arr.dtype.str, "shape": list(arr.shape),
                             "sha256": file_sums(path)[0]}  # fmt: skip
        write_manifest(tmp, {**manifest, "format": FORMAT, "format_version": FORMAT_VERSION, "arrays": entries})


def read_store(path: str | os.PathLike[str], *, verify: bool = True) -> PackStore:
    """Open a plan directory, checking format, manifest digest and (``verify``) every array's sha256 (reads each
    array once); arrays are memory-mapped. Raises ``ValueError`` naming the file and the fix."""
    root = Path(path)
    if not (root / MANIFEST).is_file():
        interrupted = None if root.exists() else interrupted_write(root)
        if interrupted is not None:
            raise ValueError(f"no precomputed plan at {str(root)!r}: {interrupted}")
        raise ValueError(f"{str(root)!r} is not a precomputed plan directory (no {MANIFEST}); {_RERUN}")
    manifest = read_manifest(root, FORMAT, (FORMAT_VERSION,), _RERUN)
    entries = manifest.get("arrays", {})
    arrays: dict[str, np.ndarray] = {}
    for name in ARRAYS:
        entry = entries.get(name)
        if entry is None:
            raise ValueError(f"{root / MANIFEST} lists no array {name!r}; {_RERUN}")
        file = root / entry["file"]
        if not file.is_file():
            raise ValueError(f"plan array {name!r} is missing: {file} does not exist; {_RERUN}")
        if verify and (digest := file_sums(file)[0]) != entry["sha256"]:
            raise ValueError(
                f"plan array {name!r} is corrupted: {file} hashes to {digest[:16]}… but the manifest "
                f"records {entry['sha256'][:16]}…; {_RERUN}"
            )
        try:
            arr = np.load(file, mmap_mode="r", allow_pickle=False)
        except ValueError as e:
            raise ValueError(f"plan array {name!r} in {file} cannot be read ({e}); {_RERUN}") from None
        if arr.dtype.str != entry["dtype"] or list(arr.shape) != entry["shape"]:
            raise ValueError(
                f"plan array {name!r} in {file} has dtype {arr.dtype.str} shape {list(arr.shape)}, the "
                f"manifest records {entry['dtype']} {entry['shape']}; {_RERUN}"
            )
        arrays[name] = arr
    offsets, n_pieces = arrays["pack_offsets"], arrays["doc_index"].shape[0]
    consistent = (
        offsets.ndim == 1
        and offsets.shape[0] >= 1
        and int(offsets[0]) == 0
        and int(offsets[-1]) == n_pieces
        and bool(np.all(np.diff(offsets) >= 0))
        and all(arrays[k].shape == (n_pieces,) for k in ("continues", "doc_start", "doc_len", "slot_len"))
        and arrays["pack_tokens"].shape[0] == arrays["rank_work"].shape[0] == offsets.shape[0] - 1
    )
    if not consistent:
        raise ValueError(f"plan arrays in {root} are inconsistent with each other; {_RERUN}")
    return PackStore(path=root, manifest=manifest, arrays=arrays)

