"""``python -m cpdata.bench.gpu_check --out DIR`` (``make gpu-check``): what only a CUDA GPU can show, in one
call.

The parts (:data:`PARTS`; each is described in docs/benchmarks.md, "GPU check") run in order; one that cannot
run says why and the next goes on. Writes ``DIR/gpu_check.json`` (every part's status, figures, seconds, the
machine), ``DIR/gpu_check.md`` and, when the attention part ran, ``DIR/calibration.json``
(:mod:`cpdata.bench.gpu_attention`, with the position's cost from :mod:`cpdata.bench.gpu_linear`). Without
CUDA every part is skipped, named, and the exit status is 0; a
part that fails or misses its tolerance makes it 1. ``--attention-seconds`` (default 210) caps the attention
part.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from cpdata.bench import gpu_attention, gpu_exchange, gpu_linear, gpu_steps
from cpdata.bench.table import format_value, markdown_table
from cpdata.errors import check_choice

__all__ = ["PARTS", "calibration_of", "main", "render_markdown", "run_parts"]

PARTS: dict[str, Callable[[float], dict]] = {
    "pinned_batches": lambda _: gpu_steps.pinned_batches(),
    "copy_overlap": lambda _: gpu_steps.copy_overlap(),
    "attention_per_rank": lambda seconds: gpu_attention.run(deadline=time.monotonic() + seconds),
    "linear_per_position": lambda _: gpu_linear.run(),
    "hf_step_compiled": lambda _: gpu_steps.hf_step(),
    "autocast_cp2_vs_cp1": lambda _: gpu_steps.autocast_cp2(),
    "exchange_vs_all_gather": lambda _: gpu_exchange.run(),
}
"""Part -> ``run(attention_seconds) -> figures``, in run order."""


def _missing(part: str) -> str | None:
    """Why ``part`` cannot run on this machine (None: it can)."""
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    if part in ("hf_step_compiled", "autocast_cp2_vs_cp1"):
        try:
            import transformers  # noqa: F401
        except ImportError:
            return "transformers is not installed (pip install 'cpdata[hf]')"
    if part == "exchange_vs_all_gather" and torch.cuda.device_count() < 2:
        return f"needs >= 2 GPUs for NCCL ranks, found {torch.cuda.device_count()}"
    return None


def run_parts(parts: Sequence[str] = tuple(PARTS), *, attention_seconds: float = 210.0,
              log: Callable[[str], None] = print) -> dict:  # fmt: skip
    """``{part: {"status", "seconds", "reason" | "error" | "result"}}``: ``skipped`` (with the reason),
    ``ok``, ``mismatch`` (ran, missed a tolerance) or ``failed`` (raised; the traceback's tail)."""
    for part in parts:  # every name before any part spends device time
        check_choice("part", part, PARTS)
    out = {}
    for part in parts:
        reason = _missing(part)
        if reason is not None:
            out[part] = {"status": "skipped", "reason": reason, "seconds": 0.0}
            log(f"[gpu-check] {part}: skipped: {reason}")
            continue
        t0 = time.monotonic()
        try:
            result = PARTS[part](attention_seconds)
            status = "ok" if result.get("ok", True) else "mismatch"
            out[part] = {"status": status, "result": result}
        except Exception as e:  # noqa: BLE001 (every part's failure is reported and the next part runs)
            out[part] = {"status": "failed", "error": f"{type(e).__name__}: {e}",
                         "traceback": traceback.format_exc()[-4000:]}  # fmt: skip
        out[part]["seconds"] = time.monotonic() - t0
        log(f"[gpu-check] {part}: {out[part]['status']} ({out[part]['seconds']:.1f} s)")
    return out


def render_markdown(report: dict) -> str:
    """The report as markdown: the parts, then the attention rows and fits, then the exchange rows."""
    machine, parts = report["machine"], report["parts"]
    text = [f"# cpdata GPU check\n\n{machine['device']}, torch {machine['torch']}, {machine['gpus']} GPU(s)\n"]
    notes = []
    for name, part in parts.items():
        note = part.get("reason") or part.get("error") or ""
        if part["status"] in ("ok", "mismatch"):
            note = ", ".join(f"{k} {format_value(v)}" for k, v in part["result"].items()
                             if isinstance(v, (int, float, bool, str)) and k != "ok")  # fmt: skip
        notes.append((name, part["status"], round(part["seconds"], 1), note))
    text.append(markdown_table(("part", "status", "seconds", "figures / reason"), notes))
    attention = parts.get("attention_per_rank", {}).get("result")
    if attention:
        cols = ("distribution", "capacity", "cp_size", "layout", "kernel", "busiest_ms", "time_max_over_mean",
                "tiles_max_over_mean", "busiest_tiles", "note")  # fmt: skip
        text.append("\n## Attention per rank (forward + backward, bf16, 32 / 8 heads, dim 128)\n")
        rows = [[r[c] if r[c] is not None else "-" for c in cols] for r in attention["rows"]]
        text.append(markdown_table(cols, rows))
        text.append("\n## Seconds per live tile (least squares over every rank)\n")
        fit_cols = ("per_tile_seconds", "intercept_seconds", "r2", "points")
        fits = [[k, *("-" if f[c] is None else f[c] for c in fit_cols)] for k, f in attention["fits"].items()]
        text.append(markdown_table(("kernel", *fit_cols), fits))
        if attention["skipped"]:
            text.append("\nLeft out (time budget): " + "; ".join(attention["skipped"]))
    exchange = parts.get("exchange_vs_all_gather", {}).get("result")
    if exchange:
        cols = ("distribution", "cp_size", "exchange_ms", "all_gather_ms", "exchange_recv_bytes",
                "all_gather_recv_bytes")  # fmt: skip
        text.append("\n## K/V exchange vs all-gather on NCCL (busiest rank, forward + backward)\n")
        text.append(markdown_table(cols, [[r[c] for c in cols] for r in exchange["rows"]]))
    return "\n".join(text) + "\n"


def calibration_of(parts: dict) -> dict | None:
    """``calibration.json``'s object from the parts that ran: the attention part's (its tile, this head shape's
    bytes per key), with the linear part's ``per_position_seconds`` where it measured one; None without a measured
    tile (a :meth:`~cpdata.layout.world_cost.WorldCost.from_json` file needs it)."""
    attention = parts.get("attention_per_rank", {}).get("result")
    if not attention or attention["calibration"]["per_tile_seconds"] is None:
        return None
    out = dict(attention["calibration"])
    linear = parts.get("linear_per_position", {}).get("result")
    if linear and linear["per_position_seconds"] is not None and linear["per_position_seconds"] > 0:
        out["per_position_seconds"] = linear["per_position_seconds"]
        out["source"] += f"; linear layers: {linear['shape']}, forward + backward"
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cpdata.bench.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu-check", help="folder for gpu_check.json, gpu_check.md, calibration.json")
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS, help="parts to run (default: all)")
    parser.add_argument("--attention-seconds", type=float, default=210.0,
                        help="budget of the attention part: no new pack starts after it (default 210)")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    cuda = torch.cuda.is_available()
    machine = {"device": torch.cuda.get_device_name() if cuda else "cpu (no CUDA)", "gpus": torch.cuda.device_count(),
               "torch": torch.__version__, "python": platform.python_version(), "host": platform.node()}  # fmt: skip
    parts = run_parts(args.parts, attention_seconds=args.attention_seconds)
    report = {"machine": machine, "parts": parts, "seconds": time.monotonic() - t0}
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "gpu_check.md").write_text(render_markdown(report))
    calibration = calibration_of(parts)
    if calibration is not None:
        (out / "calibration.json").write_text(json.dumps(calibration, indent=1))
    print(render_markdown(report))
    print(f"[gpu-check] wrote {out} ({report['seconds']:.0f} s)")
    return 1 if any(p["status"] in ("failed", "mismatch") for p in parts.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
