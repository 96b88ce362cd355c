"""On-disk format of a precomputed plan: ``.npy`` arrays plus a checksummed manifest.

A plan directory holds::

    manifest.json      format + version, configuration, counts, stats,
                       input checksum, and name/dtype/shape/sha256 of every array
    pack_offsets.npy   int64 [n_packs + 1]  CSR offsets into the piece arrays
    doc_index.npy      int64 [n_pieces]     source index of each piece's document
    doc_start.npy      int64 [n_pieces]     offset of the piece inside its document
    doc_len.npy        int64 [n_pieces]     real tokens of the piece
    slot_len.npy       int64 [n_pieces]     slot length (piece + the layout's per-document padding)
    continues.npy      bool  [n_pieces]     another piece of the same document follows (split / concat)
    pack_tokens.npy    int64 [n_packs]      real tokens per pack
    rank_work.npy      int64 [n_packs, cp]  causal document-masked attention work per CP rank

Output is byte-identical for identical inputs: ``np.save`` headers are
deterministic and the manifest is JSON with sorted keys and no timestamps. The
manifest carries a sha256 of its own canonical content (``manifest_sha256``),
so an edited manifest is refused like a corrupted array.

Writes are atomic (:func:`cpdata.sources.atomic.atomic_directory`): everything
goes to a hidden sibling temp directory, the manifest last, and the directory
is renamed into place; a writer killed at any point leaves the complete old
plan, the complete new one, or no plan and a reader error saying that the
next ``cpdata precompute`` restores or completes the swap (it also deletes
the temp directories of dead writers).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cpdata.sources.atomic import atomic_directory, interrupted_write, recover_directory, stall
from cpdata.sources.manifest import DIGEST_KEY as _DIGEST_KEY
from cpdata.sources.manifest import canonical, manifest_digest, sha256_file

__all__ = [
    "ARRAYS",
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "PackStore",
    "check_writable",
    "read_store",
    "write_store",
]

FORMAT = "cpdata.packs"
FORMAT_VERSION = 2
"""2: the input is bound by its identity (:func:`cpdata.sources.fingerprint.source_identity`); 1: by checksums."""
MANIFEST = "manifest.json"
ARRAYS: tuple[str, ...] = (
    "continues",
    "doc_index",
    "doc_len",
    "doc_start",
    "pack_offsets",
    "pack_tokens",
    "rank_work",
    "slot_len",
)
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
        return str(self.manifest[_DIGEST_KEY])

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


def check_writable(out_dir: str | os.PathLike[str], *, overwrite: bool) -> list[str]:
    """Recover dead writers' leftovers, then refuse an existing ``out_dir`` unless ``overwrite``.

    Checked before long work, and again when writing. Returns what the
    recovery did (:func:`~cpdata.sources.atomic.recover_directory`).
    """
    done = recover_directory(out_dir)
    if Path(out_dir).exists() and not overwrite:
        raise ValueError(
            f"output directory {str(out_dir)!r} already exists; pass overwrite=True (--force) or pick another"
        )
    return done


def write_store(
    out_dir: str | os.PathLike[str],
    arrays: Mapping[str, np.ndarray],
    manifest: Mapping[str, Any],
    *,
    overwrite: bool = False,
) -> str:
    """Write ``arrays`` and ``manifest`` (plus array entries and digest) atomically.

    Returns the manifest digest. Refuses an existing ``out_dir`` unless
    ``overwrite``; then the old directory is replaced only after the new one is
    complete.
    """
    out = Path(out_dir)
    if sorted(arrays) != sorted(ARRAYS):
        raise ValueError(f"write_store needs exactly the arrays {list(ARRAYS)}, got {sorted(arrays)}")
    with atomic_directory(out, overwrite=overwrite) as tmp:
        entries = {}
        for k, name in enumerate(ARRAYS):
            if k == len(ARRAYS) // 2:
                stall("writing")
            arr = np.ascontiguousarray(arrays[name])
            path = tmp / f"{name}.npy"
            np.save(path, arr, allow_pickle=False)
            entries[name] = {
                "file": path.name,
                "dtype": arr.dtype.str,
                "shape": list(arr.shape),
                "sha256": sha256_file(path),
            }
        full = {**manifest, "format": FORMAT, "format_version": FORMAT_VERSION, "arrays": entries}
        full[_DIGEST_KEY] = manifest_digest(full)
        with open(tmp / MANIFEST, "wb") as f:
            f.write(canonical(full))
            f.flush()
            os.fsync(f.fileno())
    return str(full[_DIGEST_KEY])


def _load_manifest(path: Path) -> dict[str, Any]:
    mpath = path / MANIFEST
    if not path.is_dir() or not mpath.is_file():
        interrupted = None if path.exists() else interrupted_write(path)
        if interrupted is not None:
            raise ValueError(f"no precomputed plan at {str(path)!r}: {interrupted}")
        raise ValueError(f"{str(path)!r} is not a precomputed plan directory (no {MANIFEST}); {_RERUN}")
    try:
        manifest = json.loads(mpath.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{mpath} is corrupted (not valid JSON: {e}); {_RERUN}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise ValueError(f"{mpath} is not a cpdata plan manifest (format {got!r}, expected {FORMAT!r}); {_RERUN}")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(
            f"{mpath} has format_version {version!r}, this cpdata reads version {FORMAT_VERSION}; "
            f"{_RERUN} with this cpdata, or use the cpdata release that wrote it"
        )
    recorded, actual = manifest.get(_DIGEST_KEY), manifest_digest(manifest)
    if recorded != actual:
        raise ValueError(
            f"{mpath} is corrupted: its content hashes to {actual[:16]}… but it records "
            f"{str(recorded)[:16]}… (the file was edited or damaged); {_RERUN}"
        )
    return manifest


def read_store(path: str | os.PathLike[str], *, verify: bool = True) -> PackStore:
    """Open a plan directory, checking format, manifest digest and (``verify``) every array's sha256.

    Verification reads every array once (a few seconds per GB); arrays are
    then memory-mapped. Raises ``ValueError`` naming the file and the fix.
    """
    root = Path(path)
    manifest = _load_manifest(root)
    entries = manifest.get("arrays", {})
    arrays: dict[str, np.ndarray] = {}
    for name in ARRAYS:
        entry = entries.get(name)
        if entry is None:
            raise ValueError(f"{root / MANIFEST} lists no array {name!r}; {_RERUN}")
        file = root / entry["file"]
        if not file.is_file():
            raise ValueError(f"plan array {name!r} is missing: {file} does not exist; {_RERUN}")
        if verify and (digest := sha256_file(file)) != entry["sha256"]:
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
    _check_structure(root, arrays)
    return PackStore(path=root, manifest=manifest, arrays=arrays)


def _check_structure(root: Path, arrays: Mapping[str, np.ndarray]) -> None:
    offsets = arrays["pack_offsets"]
    n_pieces = arrays["doc_index"].shape[0]
    ok = (
        offsets.ndim == 1
        and offsets.shape[0] >= 1
        and int(offsets[0]) == 0
        and int(offsets[-1]) == n_pieces
        and bool(np.all(np.diff(offsets) >= 0))
        and all(arrays[k].shape == (n_pieces,) for k in ("continues", "doc_start", "doc_len", "slot_len"))
        and arrays["pack_tokens"].shape[0] == offsets.shape[0] - 1
        and arrays["rank_work"].shape[0] == offsets.shape[0] - 1
    )
    if not ok:
        raise ValueError(f"plan arrays in {root} are inconsistent with each other; {_RERUN}")
