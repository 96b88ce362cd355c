"""Every code block of README.md and docs/*.md runs as written.

A page's blocks run in order, in one namespace, in a fresh folder that holds a
``data.jsonl`` of 120 ``{"input_ids": [...]}`` rows (what the pages call "your
data"):

- a ```` ```python ```` block is executed; a ```` ```text ```` block right after it is
  what it must print, exactly;
- a ```` ```python cp=N ```` block is a program for N ranks: it runs as N processes
  with torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...), and
  every rank must exit 0;
- in a shell block (```` ```bash ```` or unlabeled), every line that starts with
  ``cpdata `` runs through the command line's ``main`` and must return 0. Other
  shell lines (``make``, ``torchrun examples/...``) are run by the tests of what
  they launch (tests/test_train_example.py, tests/test_hf_cp_example.py) and by CI.

A page whose blocks need more than that folder (a trained tokenizer, a chat
corpus) is run by its own test, named in ``OWN_TEST``; this test checks that
the named test reads that page.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from cpdata.cli import main as cli_main
from tests.dist_utils import free_port

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))
OWN_TEST = {
    "docs/text-to-packs.md": "tests/test_docs_text_to_packs.py",
    "docs/packing-and-mixing.md": "tests/test_mix.py",
    "docs/labels-and-masks.md": "tests/test_docs.py",
    "docs/bring-your-data.md": "tests/test_docs_bring_your_data.py",
    "docs/trainers.md": "tests/test_docs_trainers.py",
    "docs/hf-attention.md": "tests/test_hf_attention_docs.py",
    "docs/torchtitan.md": "tests/test_torchtitan.py",
}
_FENCE = re.compile(r"^```(\w*)([^\n]*)\n(.*?)^```", flags=re.S | re.M)


def blocks(page: str) -> list[tuple[str, str, str]]:
    """``(language, info, body)`` of every fenced block of ``page``, in order."""
    return [(lang, info.strip(), body) for lang, info, body in _FENCE.findall((ROOT / page).read_text("utf-8"))]


def write_data(folder: Path, n: int = 120, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(folder / "data.jsonl", "w") as f:
        for _ in range(n):
            f.write(json.dumps({"input_ids": [rng.randint(1, 999) for _ in range(rng.randint(20, 1500))]}) + "\n")


DONE = "__block_done__"
"""Printed after a rank's block: a rank that printed it and then aborted with only torch's teardown message
(gloo's static destructors at interpreter exit, seen ~1 run in 30 without cpdata too) ran the block."""
TEARDOWN = "terminate called without an active exception"


def _ran(returncode: int, output: str) -> bool:
    if returncode == 0:
        return True
    head, done, tail = output.rpartition(DONE + "\n")
    return bool(done) and returncode == -6 and tail.strip() == TEARDOWN


def run_ranks_program(body: str, world: int, folder: Path, name: str) -> list[str]:
    """Run ``body`` as ``world`` gloo ranks (torchrun's environment) in ``folder``; every rank must run it
    (:func:`_ran`). Returns each rank's output up to the block's end (the sentinel and any teardown after it cut)."""
    script = folder / f"{name}.py"
    script.write_text(body + f"\nprint({DONE!r}, flush=True)\n")
    port = free_port()
    env_base = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_"))}
    env_base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                    LOCAL_WORLD_SIZE=str(world), PYTHONPATH=os.pathsep.join([str(ROOT), env_base.get("PYTHONPATH", "")]))  # fmt: skip
    procs = [
        subprocess.Popen([sys.executable, str(script)], cwd=folder, env={**env_base, "RANK": str(r), "LOCAL_RANK": str(r)},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
        for r in range(world)
    ]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=180)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"{name}: ranks did not finish within 180 s") from None
    failed = [(r, o) for r, (p, o) in enumerate(zip(procs, outs, strict=True)) if not _ran(p.returncode, o)]
    assert not failed, f"{name}: rank {failed[0][0]} failed:\n{failed[0][1][-3000:]}"
    return [o.rpartition(DONE + "\n")[0] for o in outs]


def run_page(page: str, folder: Path, given: dict | None = None) -> int:
    """Run every block of ``page`` in ``folder`` (``given``: names the page says it assumes); blocks run."""
    namespace: dict = {"__name__": "__docs__", **(given or {})}
    items = blocks(page)
    ran = 0
    for i, (lang, info, body) in enumerate(items):
        where = f"{page}:block{i}"
        if lang == "python" and not info:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(body, where, "exec"), namespace)  # noqa: S102
            following = items[i + 1] if i + 1 < len(items) else None
            if following and following[0] == "text":
                assert out.getvalue() == following[2], f"{where} printed:\n{out.getvalue()}\nthe page says:\n{following[2]}"
            ran += 1
        elif lang == "python":
            match = re.fullmatch(r"cp=(\d+)", info)
            assert match, f"{where}: unknown block info {info!r} (use ```python or ```python cp=N)"
            run_ranks_program(body, int(match.group(1)), folder, f"block{i}")
            ran += 1
        elif lang in ("bash", "sh", ""):
            for line in body.splitlines():
                if line.startswith("cpdata "):
                    with contextlib.redirect_stdout(io.StringIO()):
                        assert cli_main(shlex.split(line, comments=True)[1:]) == 0, f"{where}: {line}"
                    ran += 1
    return ran


@pytest.mark.parametrize("page", PAGES)
def test_page_runs_as_written(page, tmp_path, monkeypatch):
    if page in OWN_TEST:
        own = (ROOT / OWN_TEST[page]).read_text("utf-8")
        assert Path(page).name in own, f"{OWN_TEST[page]} must run {page}"
        return
    write_data(tmp_path)
    monkeypatch.chdir(tmp_path)
    ran = run_page(page, tmp_path)
    runnable = [b for b in blocks(page) if b[0] == "python"]
    assert ran >= len(runnable), f"{page}: {ran} blocks ran of {len(runnable)} python blocks"


def test_readme_is_a_landing_page():
    text = (ROOT / "README.md").read_text("utf-8")
    assert len(text.splitlines()) <= 300
    first = blocks("README.md")[0]
    assert [line.split()[:2] for line in first[2].splitlines()] == [["make", "demo"], ["make", "test"]]
    linked = set(re.findall(r"\]\((docs/[\w-]+\.md)\)", text))
    assert linked == {p for p in PAGES if p.startswith("docs/")}, "the guides table lists every page in docs/"


def test_labels_and_masks_page_runs_with_a_chat_tokenizer_and_a_model(tmp_path, monkeypatch):
    """docs/labels-and-masks.md assumes ``tok`` (a chat tokenizer), ``chats`` and ``model``: real ones here."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tests.tokenizer_fixture import chat_tokenizer, conversations

    tok = chat_tokenizer()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")  # fmt: skip
    given = {"tok": tok, "chats": conversations(), "model": transformers.LlamaForCausalLM(config)}
    monkeypatch.chdir(tmp_path)
    assert run_page("docs/labels-and-masks.md", tmp_path, given) == 2


def test_only_torchs_teardown_abort_after_a_finished_block_counts_as_ran():
    finished = f"rank output\n{DONE}\n{TEARDOWN}\n"
    assert _ran(0, "anything") and _ran(-6, finished)
    assert not _ran(-6, f"{TEARDOWN}\n"), "aborted before the block's end"
    assert not _ran(1, finished) and not _ran(-6, f"{DONE}\nTraceback: boom\n{TEARDOWN}\n")
