"""torchtitan jobs on one process group under the CPU test shim (the ``torchrun`` entry point of the tests).

``python -m torch.distributed.run --nproc-per-node N tests/torchtitan_run.py JOBS.json`` applies
:mod:`torchtitan_cpu_shim`, initializes one gloo group (torchtitan then reuses it) and runs each job
of ``JOBS.json`` in turn, as ``torchtitan.train`` would run its flags: parse, build the trainer,
train, close. One process pays torch's and torchtitan's imports once for every job.

A job is ``{"record": PATH, "args": [torchtitan flags], "kind": "train"}``. Every rank appends JSON
lines to ``PATH.rank{r}``: per training step the logged loss and gradient norm (the metrics call every
rank makes; torchtitan sums the norm's squares in float32: 3e-5 to 6e-5 relative off), every parameter's
gradient norm in float64 (from the full gradient, before clipping) and, per batch the step consumed,
its plan digest, its documents (``doc_index`` and ``doc_start`` per slot), its local token count, how
many contiguous runs of global positions the rank holds (1: its keys sit in global order) and the
kind of mask the attention got. Other kinds:
``"seed"`` saves torchtitan's seed checkpoint (step 0, model only; what ``--checkpoint.create_seed_checkpoint``
does in ``torchtitan.train``) so that runs at different world sizes start from the same weights;
``"error"`` must raise, and records one line ``{"error": "..."}`` with the message (tyro prints a
config's ``ValueError`` and exits: its output is the message then).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torchtitan_cpu_shim  # noqa: E402

torchtitan_cpu_shim.apply()

import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torchtitan.components.metrics import MetricsProcessor  # noqa: E402
from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.distributed import utils as dist_utils  # noqa: E402

from cpdata.integrations.torchtitan import BATCH_KEY, CPTitanTrainer  # noqa: E402

_record = {"path": "", "batches": [], "grad_norms": []}


def _write(line: dict) -> None:
    with open(f"{_record['path']}.rank{dist.get_rank()}", "a") as f:
        f.write(json.dumps(line) + "\n")


def _install_recorders() -> None:
    log, post, clip = MetricsProcessor.log, CPTitanTrainer.post_dataloading_process, dist_utils.clip_grad_norm_

    def log_and_record(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        _write({"step": step, "loss": float(global_avg_loss), "grad_norm": float(grad_norm),
                "grad_norms": _record["grad_norms"], "batches": _record["batches"]})  # fmt: skip
        _record["batches"], _record["grad_norms"] = [], []
        return log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra_metrics)

    def post_and_record(self, input_dict, labels):
        batch = input_dict[BATCH_KEY]
        info, positions = batch.info, batch.layout.local_token_global_indices
        inputs, labels, kwargs = post(self, input_dict, labels)
        _record["batches"].append({
            "digest": int(info["digest"]), "docs": [list(map(int, info["doc_index"])), list(map(int, info["doc_start"]))],
            "tokens": labels.numel(), "runs": int((positions[1:] - positions[:-1] != 1).sum()) + 1,
            "mask": type(kwargs["attention_masks"]).__name__,
        })  # fmt: skip
        return inputs, labels, kwargs

    def record_and_clip(parameters, *args, **kwargs):
        parameters = list(parameters)
        for p in parameters:  # every rank joins each full_tensor's all-gather, in the same order
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            _record["grad_norms"].append(float(grad.double().norm()))
        return clip(parameters, *args, **kwargs)

    MetricsProcessor.log = log_and_record
    dist_utils.clip_grad_norm_ = record_and_clip
    CPTitanTrainer.post_dataloading_process = post_and_record


def _run(args: list[str], kind: str) -> None:
    trainer = ConfigManager().parse_args(args).build()
    try:
        if kind == "seed":
            trainer.checkpointer.save(curr_step=0, last_step=True)
        else:
            trainer.train()
    finally:
        trainer.close()


def _expect_error(args: list[str]) -> None:
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            _run(args, "train")
    except SystemExit:
        _write({"error": out.getvalue()})
    except Exception as e:  # noqa: BLE001 - the message is what the test reads
        _write({"error": f"{type(e).__name__}: {e}"})
    else:
        _write({"error": None})


def main(jobs_path: str) -> None:
    with open(jobs_path) as f:
        jobs = json.load(f)
    _install_recorders()
    dist.init_process_group("gloo")
    try:
        for job in jobs:
            _record["path"], _record["batches"] = job["record"], []
            if job["kind"] == "error":
                _expect_error(job["args"])
            else:
                _run(job["args"], job["kind"])
    finally:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main(sys.argv[1])
        code = 0
    except BaseException:  # noqa: BLE001 - printed, then the exit status says it failed
        import traceback

        traceback.print_exc()
        code = 1
    # gloo can abort in a static destructor at interpreter exit ("terminate called without an active exception",
    # ~1 run in 30 on torch 2.13 CPU) after the group was destroyed cleanly: leave without those destructors, as
    # the examples do, once the output is flushed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
