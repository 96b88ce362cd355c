"""``examples/hf_cp_train.py``, the HF + CP recipe: parity with cp 1 under torchrun, and exact resume.

The parity job is launched as a user launches it (``torchrun``, 2 gloo ranks,
a dataloader worker); it exits non-zero unless every step's loss and the final
weights match the cp 1 reference. The resume check calls the example's
``train`` on ranks forked from this process (transformers is imported once
here): 4 steps straight, then a fresh pair of processes resuming from the
step-2 checkpoint prints the same losses for steps 3 and 4 (in-process
loader there: the forked test ranks are daemons and cannot start workers; the
torchrun job runs one worker per rank).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from dist_utils import run_ranks

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "hf_cp_train.py"
TINY = ["--files", "10", "--capacity", "256", "--steps", "4"]
STEP = re.compile(r"^step\s+(\d+) \| loss (\S+) .*\| docs\s+(\d+)", re.M)


@pytest.mark.parametrize("path", [[], ["--attention", "sdpa", "--layout", "balanced", "--no-kv-exchange"]],
                         ids=["cpdata-tiled-exchange", "sdpa-ctx-balanced"])  # fmt: skip
def test_parity_with_cp1_under_torchrun(tmp_path, path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT),
           *TINY, *path, "--check-parity", "--ckpt-dir", str(tmp_path)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert "dp=1 cp=2" in proc.stdout and "parity OK" in proc.stdout, proc.stdout
    steps = STEP.findall(proc.stdout)
    assert [int(n) for n, _, _ in steps] == [1, 2, 3, 4]
    assert len({loss for _, loss, _ in steps}) == 4, "the loss moved"
    assert max(int(docs) for _, _, docs in steps) > 1, "a pack with several documents (the mask matters)"


def _train(rank: int, world: int, argv: list[str]) -> dict:
    sys.path.insert(0, str(ROOT / "examples"))
    import hf_cp_train

    return hf_cp_train.train(hf_cp_train.parse_args(argv))


def test_resume_continues_with_the_same_batches(tmp_path):
    ckpt = ["--ckpt-dir", str(tmp_path / "ckpt"), "--workers", "0"]  # forked test ranks are daemons: no workers
    straight = run_ranks(_train, 2, [*TINY, "--save-every", "2", *ckpt], timeout=180)[0]["losses"]
    shutil.rmtree(tmp_path / "ckpt" / "step_000004")  # resume from step 2
    resumed = run_ranks(_train, 2, [*TINY, "--resume", *ckpt], timeout=180)[0]["losses"]
    assert sorted(straight) == [1, 2, 3, 4] and sorted(resumed) == [3, 4]
    assert resumed == {k: straight[k] for k in (3, 4)}
    assert len(set(straight.values())) == 4
    with pytest.raises(AssertionError, match="ValueError: --cp-size 3 must divide the world size 2"):
        run_ranks(_train, 2, [*TINY, "--cp-size", "3"], timeout=60)
