"""docs/layouts-and-kernels.md: every python block runs as written (in order, one namespace) and prints what
the page says it prints."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "layouts-and-kernels.md"


def _blocks(text: str) -> list[tuple[str, str]]:
    return [(m[1], m[2]) for m in re.finditer(r"```(\w*)\n(.*?)```", text, re.S)]


def test_python_blocks_run_and_print_what_the_page_shows(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = _blocks(PAGE.read_text(encoding="utf-8"))
    code = [body for lang, body in blocks if lang == "python"]
    assert len(code) == 2
    namespace: dict = {"__name__": "__docs__"}
    outputs = []
    for i, body in enumerate(code):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(body, f"{PAGE.name}:block{i}", "exec"), namespace)
        outputs.append(out.getvalue())
    shown = [body for lang, body in blocks if lang == ""][0]
    assert outputs[0] == shown, outputs[0]
    assert outputs[1].strip() == "tiled:64 (512,) True"
    assert "prints `tiled:64 (512,) True`" in PAGE.read_text(encoding="utf-8")
