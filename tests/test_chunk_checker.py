"""A token store read that spans three chunks checks every one of them, the middle one included.

The repro: reads first check chunks 0 and 2 (both fine), then the middle
chunk's bytes go bad on disk, then one read covers chunks 0..2. Its two ends
were checked already; the middle one never was, and must be.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cpdata.sources.chunksums import ChunkChecker, ChunkHasher

CHUNK = 16


def _checker(raw: np.ndarray) -> ChunkChecker:
    hasher = ChunkHasher(CHUNK)
    hasher.update(raw.tobytes())
    return ChunkChecker(Path("tokens.bin"), hasher.finish(), raw.size, CHUNK, "rewrite the store", data=raw)


def test_a_read_over_three_chunks_checks_the_unchecked_middle_one():
    raw = np.arange(3 * CHUNK, dtype=np.uint8)
    checker = _checker(raw)
    checker.check(0, 4, document=0)  # chunk 0
    checker.check(2 * CHUNK, 2 * CHUNK + 4, document=2)  # chunk 2
    assert checker.checked == 2
    raw[CHUNK + 3] ^= 1  # chunk 1 edited on disk after the store was written
    with pytest.raises(ValueError, match=r"bytes 16\.\.32 \(chunk 1 of 3\).*while reading document 1"):
        checker.check(2, 2 * CHUNK + 2, document=1)


def test_a_read_over_three_good_chunks_checks_all_three():
    raw = np.arange(3 * CHUNK, dtype=np.uint8)
    checker = _checker(raw)
    checker.check(0, 4, document=0)
    checker.check(2 * CHUNK, 2 * CHUNK + 4, document=2)
    checker.check(2, 2 * CHUNK + 2, document=1)
    assert checker.checked == 3 and checker.complete
