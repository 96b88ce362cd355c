"""Messages that used to name the wrong fix or none: each says what is wrong and what to do.

| input | message names |
|---|---|
| a device mesh without a dim named ``"cp"``, a batch laid out for cp 2 | the mesh's dims and ``mesh_dim_names`` (not the pipeline's ``cp_size``) |
| a token store without ``offsets.npy`` | the file, "is missing" (not "has None bytes") |
| ``cpdata inspect`` on a token store | "is a token store ... not a plan", the ``precompute`` command |
| ``cpdata precompute text.jsonl`` without ``--tokenizer`` | ``--tokenizer`` |
| ``--capcity`` | "did you mean --capacity?" |
| ``pack-store --help`` | its own ``--vocab-size`` default (no tokenizer) |
| ``open_dataset(...)[:100]`` | a working subset view |
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from dist_utils import run_ranks

from cpdata import build_loader, open_dataset, precompute
from cpdata.cli import main as cli_main
from cpdata.nodes.loader import close_loader
from cpdata.offline import PrecomputedPacks
from cpdata.sources.base import DatasetSlice
from cpdata.sources.tokenstore import TokenStore, write_token_store

PLAN = ["--capacity", "64", "--cp-size", "1", "--layout", "identity"]


def _ids_jsonl(path, n: int = 20):
    rng = np.random.default_rng(0)
    path.write_text("".join(json.dumps({"input_ids": rng.integers(1, 99, int(k)).tolist()}) + "\n"
                            for k in rng.integers(1, 40, n)))  # fmt: skip
    return path


def _mesh_without_cp(rank: int, world: int) -> dict[str, str]:
    from torch.distributed.device_mesh import init_device_mesh

    from cpdata.nemo.sharder import ContextParallelSharder
    from cpdata.nodes.loader import build_node

    docs = [{"input_ids": np.arange(1, 20)}, {"input_ids": np.arange(1, 9)}]
    batch = next(build_node(docs, capacity=32, cp_size=world, cp_rank=rank, layout="thd", prefetch=0))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("context",))  # the CP dim, misnamed
    out = {}
    try:
        ContextParallelSharder(None, mesh, batch).shard(batch)
        out["error"] = "ok"
    except ValueError as err:
        out["error"] = str(err)
    return out


def test_a_mesh_without_a_cp_dim_is_named_not_the_pipeline():
    for r in run_ranks(_mesh_without_cp, 2, timeout=60):
        message = r["error"]
        assert "no dimension named 'cp' (its dims: ('context',))" in message, message
        assert "mesh_dim_names=(..., 'cp')" in message and "build the data pipeline with" not in message


def test_a_store_file_that_is_missing_is_called_missing(tmp_path):
    store = write_token_store([{"input_ids": [1, 2, 3]}], tmp_path / "s")
    (tmp_path / "s" / "offsets.npy").unlink()
    with pytest.raises(ValueError, match=r"offsets.npy is missing \(the manifest records \d+ bytes\)") as err:
        open_dataset(tmp_path / "s")
    assert "None" not in str(err.value)
    with pytest.raises(ValueError, match="offsets.npy was removed since the store was opened"):
        store.check_unchanged()


def test_inspect_on_a_token_store_says_to_plan_it_first(tmp_path, capsys):
    write_token_store([{"input_ids": [1, 2, 3]}], tmp_path / "s")
    assert cli_main(["inspect", str(tmp_path / "s")]) == 1
    err = capsys.readouterr().err
    assert "is a token store" in err and "not a plan" in err and "re-run" not in err
    assert f"cpdata precompute {tmp_path / 's'} --capacity N" in err
    _ids_jsonl(tmp_path / "d.jsonl")
    assert cli_main(["inspect", str(tmp_path / "d.jsonl")]) == 1
    assert "is a file, not a plan" in capsys.readouterr().err


def test_precompute_of_text_rows_names_the_tokenizer_flag(tmp_path, capsys):
    (tmp_path / "text.jsonl").write_text('{"text": "hello"}\n{"text": "world"}\n')
    assert cli_main(["precompute", str(tmp_path / "text.jsonl"), *PLAN, "--out", str(tmp_path / "p"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "line 1" in err and "the rows are text or chat" in err and "--tokenizer PATH" in err


def test_a_misspelt_flag_gets_its_close_match(tmp_path, capsys):
    data = _ids_jsonl(tmp_path / "d.jsonl")
    with pytest.raises(SystemExit) as code:
        cli_main(["precompute", str(data), "--capcity", "64", "--cp-size", "1", "--layout", "identity", "--out",
                  str(tmp_path / "p")])  # fmt: skip
    err = capsys.readouterr().err
    assert code.value.code == 2 and "unrecognized argument --capcity; did you mean --capacity?" in err
    assert "required" not in err
    assert cli_main(["precompute", str(data), "--cap", "64", "--cp-size", "1", "--layout", "identity", "--out",
                     str(tmp_path / "p"), "--quiet"]) == 0  # a prefix is still argparse's abbreviation  # fmt: skip


def test_pack_store_help_states_its_own_vocab_default(capsys):
    with pytest.raises(SystemExit):
        cli_main(["pack-store", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "tokenizer" not in text.split("--vocab-size VOCAB_SIZE ids must be below it")[1]
    assert "default: none: 4 bytes per token" in text and "or a token store to rewrite" in text
    with pytest.raises(SystemExit):
        cli_main(["tokenize", "--help"])
    assert "default: the tokenizer's size" in " ".join(capsys.readouterr().out.split())


def test_a_slice_of_a_dataset_is_a_dataset_of_those_documents(tmp_path):
    data = open_dataset(_ids_jsonl(tmp_path / "d.jsonl", 30))
    part = data[5:25]
    assert isinstance(part, DatasetSlice) and len(part) == 20 and len(data[:100]) == 30 and len(data[::3]) == 10
    np.testing.assert_array_equal(part.lengths, data.lengths[5:25])
    np.testing.assert_array_equal(part[0]["input_ids"], data[5]["input_ids"])
    np.testing.assert_array_equal(part[-1]["input_ids"], data[24]["input_ids"])
    assert part.fingerprint() != data.fingerprint() and part.fingerprint() == open_dataset(data.path)[5:25].fingerprint()
    loader = build_loader(part, capacity=64, cp_size=1, cp_rank=0, layout="identity", restart_on_stop_iteration=False)
    assert sum(b.info["real_tokens"] for b in loader) == int(part.lengths.sum())  # every document, once
    close_loader(loader)
    precompute(part, tmp_path / "plan", capacity=64, cp_size=1, layout="identity")
    served = list(PrecomputedPacks(tmp_path / "plan", open_dataset(data.path)[5:25]))
    assert sorted(p.index for pack in served for p in pack.pieces) == list(range(20))
    with pytest.raises(ValueError, match="hash to"):  # a plan of one slice does not serve another
        PrecomputedPacks(tmp_path / "plan", open_dataset(data.path)[4:24])
    store = write_token_store([data[i] for i in range(30)], tmp_path / "s")
    np.testing.assert_array_equal(TokenStore(tmp_path / "s")[10:][0]["input_ids"], data[10]["input_ids"])
    with pytest.raises(TypeError, match=r"an int index or a slice \(dataset\[:1000\], a view\)"):
        store["a"]
