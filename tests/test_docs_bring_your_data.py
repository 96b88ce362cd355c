"""docs/bring-your-data.md runs as written: its Python blocks in order in one namespace, and its commands."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import numpy as np

from cpdata.cli import main as cli_main
from tests.tokenizer_fixture import CORPUS, chat_tokenizer

PAGE = Path(__file__).resolve().parents[1] / "docs" / "bring-your-data.md"


def test_every_block_runs_as_written(tmp_path, monkeypatch, capsys):
    blocks = re.findall(r"```(\w*)\n(.*?)```", PAGE.read_text(), flags=re.S)
    python = [body for lang, body in blocks if lang == "python"]
    commands = [line for lang, body in blocks if lang == "bash" for line in body.splitlines() if line.startswith("cpdata ")]
    assert len(python) == 4 and len(commands) == 1
    chat_tokenizer().save_pretrained(tmp_path / "tokenizer")
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in CORPUS))
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    for k, code in enumerate(python):
        exec(compile(code, f"{PAGE.name}:python-{k}", "exec"), namespace)  # noqa: S102
    out = capsys.readouterr().out
    assert "MegatronIndexed('web_text_document', documents=300, dtype=uint16, sequences=300)" in out
    assert f"megatron {namespace['plan'].manifest['counts']['packs']} packs" in out and "megatron 117 packs" in out
    assert len(list(namespace["packs"])) == len(list(namespace["served"])) == 117  # one plan, two ways in
    assert "{'web': 0.7, 'chat': 0.3}" in out
    for command in commands:
        assert cli_main(shlex.split(command)[1:] + ["--quiet"]) == 0
    from cpdata import open_dataset

    meg = open_dataset("corpus_text_document")
    tok = chat_tokenizer()
    for i, text in enumerate(CORPUS):
        np.testing.assert_array_equal(meg[i]["input_ids"], tok(text)["input_ids"] + [tok.eos_token_id])
