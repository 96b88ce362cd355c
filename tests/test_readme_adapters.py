"""README's "Use with ..." sections run as written, and print what README says they print."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
SECTIONS = ["Use with Hugging Face", "Use with Transformer Engine", "Use with flex attention"]


def _section(title: str) -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def _blocks(section: str) -> list[tuple[str, str]]:
    return re.findall(r"```(\w+)\n(.*?)```", section, flags=re.S)


@pytest.mark.parametrize("title", SECTIONS)
def test_readme_snippet_runs(title, capsys):
    blocks = _blocks(_section(title))
    code = [body for lang, body in blocks if lang == "python"]
    assert len(code) == 1, f"section {title!r} should hold exactly one python snippet"
    exec(compile(code[0], f"README:{title}", "exec"), {"__name__": "__readme__"})
    printed = capsys.readouterr().out
    assert printed.strip(), "the snippet prints its result"
    expected = [body for lang, body in blocks if lang == "text"]
    if expected:
        assert printed == expected[0]
