"""Every ```python block of docs/trainers.md runs as written, in order, in one namespace, in a scratch folder."""

from __future__ import annotations

import re
from pathlib import Path

import torch

DOC = Path(__file__).resolve().parents[1] / "docs" / "trainers.md"


def test_trainers_page_blocks_run(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) == 3, "the HF Trainer block, its resume, the TRL block"
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only contend on a shared 2-core machine (2-10x slower)
    namespace: dict = {}
    try:
        for i, block in enumerate(blocks):
            exec(compile(block, f"{DOC.name}:block{i}", "exec"), namespace)
    finally:
        torch.set_num_threads(threads)
    assert namespace["last"]["cp_tiles_max_over_ideal"] >= 1.0 and namespace["last"]["step"] == 4
    assert (tmp_path / "out" / "hf" / "checkpoint-2" / "cpdata_loader_rank0.pt").is_file()
    losses = [h["loss"] for h in namespace["sft"].state.log_history if "loss" in h]
    assert len(losses) == 3 and all(loss > 0 for loss in losses)
