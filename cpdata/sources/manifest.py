"""Manifests of cpdata's on-disk formats: canonical JSON, and the digest (``manifest_sha256``) of every other
field, written and checked in one place so a writer and every reader agree byte for byte.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["DIGEST_KEY", "MANIFEST", "canonical", "manifest_digest", "read_manifest", "write_manifest"]

DIGEST_KEY = "manifest_sha256"
MANIFEST = "manifest.json"


def canonical(obj: Mapping[str, Any]) -> bytes:
    """``obj`` as sorted, indented JSON (NaN refused), newline-terminated: the bytes a digest covers."""
    return (json.dumps(obj, sort_keys=True, indent=2, allow_nan=False) + "\n").encode()


def manifest_digest(manifest: Mapping[str, Any]) -> str:
    """Hex sha256 of the canonical JSON of ``manifest`` without its own digest field."""
    return hashlib.sha256(canonical({k: v for k, v in manifest.items() if k != DIGEST_KEY})).hexdigest()


def write_manifest(directory: Path, manifest: Mapping[str, Any]) -> dict[str, Any]:
    """Write ``manifest`` with its digest as ``directory/manifest.json`` (fsynced); returns what was written."""
    full = {**manifest, DIGEST_KEY: manifest_digest(manifest)}
    with open(directory / MANIFEST, "wb") as f:
        f.write(canonical(full))
        f.flush()
        os.fsync(f.fileno())
    return full


def read_manifest(directory: Path, fmt: str, versions: Iterable[int], fix: str) -> dict[str, Any]:
    """``directory/manifest.json``, refused (``ValueError`` ending in ``fix``) unless it parses, is of format
    ``fmt`` and one of ``versions``, and matches its own digest."""
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is corrupted (not valid JSON, or unreadable: {e}); {fix}") from None
    got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
    if got != fmt:
        raise ValueError(f"{path} is not a {fmt} manifest (format {got!r}); {fix}")
    version, versions = manifest.get("format_version"), list(versions)
    if version not in versions:
        raise ValueError(f"{path} has format_version {version!r}, this cpdata reads version "
                         f"{' and '.join(map(str, versions))}; {fix} with this cpdata, or use the cpdata release "
                         "that wrote it")  # fmt: skip
    recorded, actual = manifest.get(DIGEST_KEY), manifest_digest(manifest)
    if recorded != actual:
        raise ValueError(f"{path} is corrupted: its content hashes to {actual[:16]}… but it records "
                         f"{str(recorded)[:16]}… (the file was edited or damaged); {fix}")  # fmt: skip
    return manifest
