"""A Megatron pair edited where only a partial last block holds the change, and ids at the vocabulary's edge.

Files are sized so that ``.bin`` and ``.idx`` end in a partial 4 KiB block;
one token (or index byte) there is changed in place, same size. A fresh open
must not serve the edit under the old fingerprint, and a dataset opened before
the edit must refuse it. ``check_token_ids(vocab_size)`` must refuse an id equal
to ``vocab_size`` (the first id outside the vocabulary), naming the document.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from cpdata.sources.megatron import MegatronIndexed
from cpdata.sources.megatron_writer import write_megatron

BLOCK = 4096


def _pair(tmp_path, n_docs: int = 300, tokens: int = 3 * BLOCK // 4 + 25):
    """int32 tokens: the .bin is 3 blocks + 100 bytes; 300 sequences make a .idx of several blocks + a tail."""
    rng = np.random.default_rng(0)
    cuts = np.sort(rng.choice(np.arange(1, tokens), n_docs - 1, replace=False))
    ids = rng.integers(0, 1000, tokens)
    docs = [{"input_ids": part} for part in np.split(ids, cuts)]
    ds = write_megatron(docs, tmp_path / "d", dtype=np.int32)
    for path in (ds.bin_path, ds.idx_path):
        assert os.path.getsize(path) % BLOCK and os.path.getsize(path) > BLOCK, path  # a partial last block
    return ds


def _edit_last_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a moved mtime, whatever the clock's grain


def test_an_edit_in_the_partial_last_block_of_the_bin_changes_the_fingerprint_and_is_refused(tmp_path):
    opened = _pair(tmp_path)
    before = opened.fingerprint()
    last = opened[len(opened) - 1]["input_ids"]
    _edit_last_byte(opened.bin_path)
    fresh = MegatronIndexed(tmp_path / "d")
    assert fresh[len(fresh) - 1]["input_ids"][-1] != last[-1]  # the edit is in the data served
    assert fresh.fingerprint() != before
    with pytest.raises(ValueError, match="rewritten since it was opened"):
        opened.check_unchanged()


def test_an_edit_in_the_partial_last_block_of_the_idx_is_refused(tmp_path):
    opened = _pair(tmp_path)
    _edit_last_byte(opened.idx_path)
    with pytest.raises(ValueError, match="rewritten since it was opened"):
        opened.check_unchanged()


@pytest.mark.parametrize("offset", [0, 1])
def test_the_token_scan_refuses_the_first_id_outside_the_vocabulary(tmp_path, offset):
    vocab = 1000
    docs = [{"input_ids": np.arange(5) + 10 * i} for i in range(20)]
    docs[13] = {"input_ids": np.array([1, 2, vocab + offset, 3])}
    ds = write_megatron(docs, tmp_path / "v", dtype=np.int32)
    with pytest.raises(ValueError, match=rf"document 13 has token id {vocab + offset} at position 2, >= vocab_size"):
        ds.check_token_ids(vocab)
    ds.check_token_ids(vocab + offset + 1)  # the same data inside a larger vocabulary passes
