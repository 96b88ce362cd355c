"""docs/text-to-packs.md runs as written (its commands and its Python blocks)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from cpdata.cli import main as cli_main
from tests.tokenizer_fixture import CORPUS, chat_tokenizer, conversations

PAGE = Path(__file__).resolve().parents[1] / "docs" / "text-to-packs.md"




def test_from_text_to_packs_runs_as_written(tmp_path, monkeypatch):
    section = PAGE.read_text()
    blocks = re.findall(r"```(\w*)\n(.*?)```", section, flags=re.S)
    python = [body for lang, body in blocks if lang == "python"]
    shell = [body for lang, body in blocks if lang == ""]
    assert len(python) == 2 and len(shell) == 1

    chat_tokenizer().save_pretrained(tmp_path / "tokenizer")
    rows = [{"text": t} for t in CORPUS] + [{"messages": m} for m in conversations()]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.chdir(tmp_path)

    first: dict = {}
    exec(compile(python[0], "docs/text-to-packs.md:1", "exec"), first)  # noqa: S102
    assert first["trained"] > 0  # what "trained" means is checked in test_tokenize.py::test_assistant_only_trains_only_the_replies_end_to_end

    commands = [line for line in shell[0].splitlines() if line.startswith("cpdata ")]
    assert [c.split()[1] for c in commands] == ["tokenize", "precompute"]
    for line in commands:
        assert cli_main(shlex.split(line)[1:]) == 0, line

    second: dict = {}
    exec(compile(python[1], "docs/text-to-packs.md:2", "exec"), second)  # noqa: S102
    assert len(second["batches"]) == len(second["dataset"]) > 0
    assert len(second["tokens"]) == len(rows) and second["tokens"].labels_alignment == "inputs"
    assert second["dataset"].plans.labels_alignment == "inputs"
