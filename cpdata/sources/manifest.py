"""Manifests of cpdata's on-disk formats: canonical JSON, and the digest (``manifest_sha256``) of every other
field, computed in one place so a writer and every reader agree byte for byte.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["DIGEST_KEY", "canonical", "manifest_digest", "sha256_file"]

DIGEST_KEY = "manifest_sha256"


def canonical(obj: Mapping[str, Any]) -> bytes:
    """``obj`` as sorted, indented JSON (NaN refused), newline-terminated: the bytes a digest covers."""
    return (json.dumps(obj, sort_keys=True, indent=2, allow_nan=False) + "\n").encode()


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def manifest_digest(manifest: Mapping[str, Any]) -> str:
    """Hex sha256 of the canonical JSON of ``manifest`` without its own digest field."""
    body = {k: v for k, v in manifest.items() if k != DIGEST_KEY}
    return hashlib.sha256(canonical(body)).hexdigest()
