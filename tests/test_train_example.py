"""The CP training demo, launched the way users launch it: torchrun on gloo ranks.

Each test is one or a few real ``torchrun`` jobs (subprocesses, bounded by a
timeout) on a tiny model: parity against a cp_size=1 reference for every
layout valid at cp 2, a 4-rank dp 2 x cp 2 job, and exact resume.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from dist_utils import run_ranks

from cpdata.nodes.options import StreamPlan

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_cp.py"
sys.path.insert(0, str(ROOT / "examples"))
TINY = ["--capacity", "256", "--layers", "1", "--d-model", "32"]  # the default tiled: cp x 128
SUMMARY_KEYS = {"steps", "cp_size", "layout", "final_loss", "max_abs_loss_diff", "tokens_per_s",
                "data_wait_fraction", "padding_pct", "imbalance"}
STEP_LINE = re.compile(r"^step\s+(\d+) \| loss (\S+) .*\| docs\s+(\d+)", re.M)


def torchrun(nproc: int, *args: str, timeout: float = 150) -> str:
    """Run the demo on ``nproc`` local ranks; return rank 0's stdout, failing with both streams."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(SCRIPT), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"torchrun timed out after {timeout}s\nstdout:\n{e.stdout}\nstderr:\n{e.stderr}")
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-8000:]}"
    return proc.stdout


def step_losses(stdout: str) -> dict[int, str]:
    return {int(m[1]): m[2] for m in STEP_LINE.finditer(stdout)}


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory) -> Path:
    """Short documents of varied length, so packs hold several documents (the mask matters)."""
    rng = np.random.default_rng(0)
    words = ["def", "return", "self", "import", "class", "for", "in", "if", "None", "(x)", ":", "\n"]
    path = tmp_path_factory.mktemp("data") / "docs.jsonl"
    with open(path, "w") as f:
        for _ in range(400):
            n = int(rng.integers(2, 40))
            f.write(json.dumps({"text": " ".join(rng.choice(words, n))}) + "\n")
    return path


def read_summary(path: Path) -> dict:
    summary = json.loads(path.read_text())
    assert set(summary) == SUMMARY_KEYS
    return summary


def test_parity_for_every_layout_at_cp2(tmp_path, jsonl):
    layouts = ["contiguous", "round_robin", "thd", "balanced"]
    out = torchrun(2, *TINY, "--steps", "4", "--data", str(jsonl), "--check-parity", "--layout", ",".join(layouts),
                   "--summary-json", str(tmp_path / "{layout}.json"))
    assert out.count("parity OK") == len(layouts), out
    per_layout = out.split("layout=")[1:]
    assert len(per_layout) == len(layouts)
    for layout, text in zip(layouts, per_layout, strict=True):
        s = read_summary(tmp_path / f"{layout}.json")
        assert (s["layout"], s["cp_size"], s["steps"]) == (layout, 2, 4)
        assert s["max_abs_loss_diff"] is not None and s["max_abs_loss_diff"] <= 1e-5
        assert math.isfinite(s["final_loss"]) and s["tokens_per_s"] > 0
        steps = re.findall(STEP_LINE, text)
        assert [int(n) for n, _, _ in steps] == [1, 2, 3, 4]
        assert len({loss for _, loss, _ in steps}) > 1, "losses did not change: nothing was trained"
        assert max(int(docs) for _, _, docs in steps) > 1, "no pack held several documents"
    thd, balanced = (read_summary(tmp_path / f"{x}.json") for x in ("thd", "balanced"))
    assert thd["padding_pct"] > balanced["padding_pct"], "thd pads every document to 2*cp, balanced does not"


def test_tiled_layout_trains_with_parity_and_the_imbalance_counts_tiles(tmp_path, jsonl):
    out = torchrun(2, "--capacity", "256", "--layers", "1", "--d-model", "32", "--steps", "3", "--data", str(jsonl),
                   "--check-parity", "--layout", "tiled,balanced", "--tile", "64",
                   "--summary-json", str(tmp_path / "{layout}.json"))  # fmt: skip
    assert out.count("parity OK") == 2, out
    assert out.count("busiest CP rank's live 64x64 attention tiles") == 2, out
    tiled, balanced = read_summary(tmp_path / "tiled:64.json"), read_summary(tmp_path / "balanced.json")
    assert (tiled["layout"], tiled["max_abs_loss_diff"] <= 1e-5) == ("tiled:64", True)
    assert 1.0 <= tiled["imbalance"] < balanced["imbalance"], (tiled["imbalance"], balanced["imbalance"])


def test_dp2_cp2_on_four_ranks(tmp_path):
    out = torchrun(4, *TINY, "--dp-size", "2", "--cp-size", "2", "--steps", "3", "--check-parity",
                   "--summary-json", str(tmp_path / "s.json"))
    assert "dp=2 cp=2" in out and out.count("parity OK") == 1, out
    s = read_summary(tmp_path / "s.json")
    assert s["cp_size"] == 2 and s["max_abs_loss_diff"] <= 1e-5


def test_dp2_cp2_balanced_schedule(tmp_path, jsonl):
    out = torchrun(4, *TINY, "--dp-size", "2", "--cp-size", "2", "--schedule", "balanced", "--steps", "3",
                   "--data", str(jsonl), "--check-parity", "--summary-json", str(tmp_path / "s.json"))
    assert "dp=2 cp=2" in out and out.count("parity OK") == 1, out
    assert [int(n) for n, _, _ in re.findall(STEP_LINE, out)] == [1, 2, 3]
    s = read_summary(tmp_path / "s.json")
    assert s["cp_size"] == 2 and s["max_abs_loss_diff"] <= 1e-5


@pytest.mark.parametrize("source", ["jsonl", "precomputed"])
def test_resume_gives_identical_losses(tmp_path, jsonl, source):
    """2N steps straight == N steps, checkpoint, then a fresh job resuming for N more (same printed losses)."""
    if source == "jsonl":
        data = ["--data", str(jsonl), "--layout", "thd"]
    else:  # a `cpdata precompute` plan directory over token-id rows (the reader resumes by pack index)
        ids = tmp_path / "ids.jsonl"
        ids.write_text("".join(json.dumps({"input_ids": list(json.loads(line)["text"].encode())}) + "\n"
                               for line in jsonl.read_text().splitlines()))
        from cpdata.offline.precompute_plan import precompute

        precompute(ids, tmp_path / "plan", capacity=128, cp_size=2, layout="balanced", plan=StreamPlan(overflow="split"))
        data = ["--data", str(tmp_path / "plan"), "--documents", str(ids)]
    common = [*TINY, *data]
    straight = torchrun(2, *common, "--steps", "6", "--summary-json", str(tmp_path / "a.json"))
    ckpt = ["--ckpt-dir", str(tmp_path / "ckpt")]
    first = torchrun(2, *common, "--steps", "3", "--save-every", "3", *ckpt)
    resumed = torchrun(2, *common, "--steps", "6", "--resume", *ckpt, "--summary-json", str(tmp_path / "b.json"))
    assert "resumed from" in resumed and "at step 3" in resumed
    a, b, c = step_losses(straight), step_losses(first), step_losses(resumed)
    assert sorted(a) == list(range(1, 7)) and sorted(b) == [1, 2, 3] and sorted(c) == [4, 5, 6]
    assert {k: a[k] for k in b} == b
    assert {k: a[k] for k in c} == c
    assert len(set(a.values())) > 1
    assert read_summary(tmp_path / "a.json")["final_loss"] == read_summary(tmp_path / "b.json")["final_loss"]


def test_stdlib_corpus_is_the_sorted_py_files_as_bytes(tmp_path):
    from corpus import StdlibCorpus, load_jsonl

    (tmp_path / "pkg").mkdir()
    for name, text in [("b.py", "x = 1\n"), ("pkg/a.py", "é"), ("a.py", "import os\n"), ("empty.py", ""),
                       ("notes.txt", "no")]:
        (tmp_path / name).write_text(text, encoding="utf-8")
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "c.py").write_text("skipped")
    corpus = StdlibCorpus(tmp_path)
    assert [p.relative_to(tmp_path).as_posix() for p in corpus.files] == ["a.py", "b.py", "pkg/a.py"]
    assert corpus[2]["input_ids"].tolist() == list("é".encode())
    assert len(StdlibCorpus()) > 100  # the running interpreter's own standard library
    (tmp_path / "d.jsonl").write_text('{"text": "hi"}\n\n{"input_ids": [1, 2], "labels": [2, -100]}\n')
    docs = load_jsonl(tmp_path / "d.jsonl")
    assert [d["input_ids"].tolist() for d in docs] == [[104, 105], [1, 2]] and docs[1]["labels"].tolist() == [2, -100]


def _grad_contract_rank(rank: int, world: int, docs: list) -> dict[str, float]:
    """Gradients of the CP model on one pack vs the full-pack reference, two loss conventions."""
    import torch.distributed as dist
    from cp_model import CPTransformer, ModelConfig, TokenView

    from cpdata.adapters import token_loss
    from cpdata.gather import gather_token_tensor
    from cpdata.nodes.options import Delivery
    from cpdata.recipes import balanced_allgather

    torch.set_default_dtype(torch.float64)
    batch = next(iter(balanced_allgather.build(docs, capacity=96, cp_size=world, cp_rank=rank,
                                               delivery=Delivery(prefetch=0))))
    layout, keys = batch.layout, ("input_ids", "position_ids", "document_ids", "cu_seqlens_padded")
    full = {k: gather_token_tensor(batch[k], layout, seq_dim=1) for k in (*keys[:3], "labels")}
    full["cu_seqlens_padded"] = batch["cu_seqlens_padded"]
    n_targets = full["labels"].ne(-100).sum()

    def grads(model) -> torch.Tensor:
        g = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        model.zero_grad()
        return g

    torch.manual_seed(0)
    model = CPTransformer(ModelConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64))
    reference_loss = token_loss(model(*(full[k] for k in keys), TokenView.full()), full)
    reference_loss.backward()
    reference = grads(model)

    view = TokenView.from_layout(layout)
    logits = model(*(batch[k] for k in keys), view)
    token_loss(logits, batch).backward(retain_graph=True)  # the script's convention: counts the pack's targets
    local = grads(model)
    dist.all_reduce(local)
    replicated_loss = token_loss(view.gather(logits), full, num_targets=n_targets)  # same value on every rank
    replicated_loss.backward()
    replicated = grads(model)
    dist.all_reduce(replicated)
    return {
        "docs": batch.info["n_documents"],
        "local": ((local - reference).norm() / reference.norm()).item(),
        "replicated": ((replicated - world * reference).norm() / reference.norm()).item(),
    }


def test_local_loss_gradients_sum_to_the_single_rank_gradient():
    """Local-token loss over the global count, grads summed over CP: exactly the cp=1 gradient.

    A loss replicated on every CP rank (computed from gathered logits) instead
    gives cp x that gradient, through the gather's reduce-scatter backward.
    """
    rng = np.random.default_rng(0)
    docs = [{"input_ids": rng.integers(0, 256, int(n))} for n in rng.integers(5, 40, 12)]
    results = run_ranks(_grad_contract_rank, 2, docs)
    assert results[0]["docs"] > 1, "the pack should hold several documents"
    for r in results:
        assert r["local"] < 1e-12 and r["replicated"] < 1e-12, r
