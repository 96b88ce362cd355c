"""docs/hf-attention.md runs as written.

Its ```python blocks run in order in one namespace, in a fresh folder; a ```text block right after one is what it
must print, exactly. A ```python cp=N block runs as N processes with torchrun's environment (gloo), every rank
must run it (``tests.test_docs.run_ranks_program``: gloo's teardown abort after the block counts as ran), and the ```text block after it is what rank 0 prints (the cp 2 program prints the cp 1 losses).
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

from tests.test_docs import run_ranks_program

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "hf-attention.md"
_FENCE = re.compile(r"^```(\w*)([^\n]*)\n(.*?)^```", flags=re.S | re.M)


def test_page_runs_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = _FENCE.findall(PAGE.read_text(encoding="utf-8"))
    namespace: dict = {"__name__": "__docs__"}
    ran = 0
    for i, (lang, info, body) in enumerate(blocks):
        if lang != "python":
            continue
        ranks = re.search(r"cp=(\d+)", info)
        if ranks:
            outs = run_ranks_program(body, int(ranks.group(1)), tmp_path, f"block{i}")
            after = blocks[i + 1] if i + 1 < len(blocks) else None
            assert after is not None and after[0] == "text" and outs[0] == after[2], outs[0]
            assert not any(outs[1:]), "only rank 0 prints"
        else:
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                exec(compile(body, f"{PAGE.name}:block{i}", "exec"), namespace)
            after = blocks[i + 1] if i + 1 < len(blocks) else None
            if after is not None and after[0] == "text":
                assert printed.getvalue() == after[2]
        ran += 1
    assert ran == 2, "the page's cp 1 and cp 2 programs"
