"""Timing and machine description shared by every benchmark section.

Times are medians of repeated runs (``time.perf_counter_ns``), the CUDA device synchronised on both sides of
each run when the work is there.
"""

from __future__ import annotations

import os
import platform
import statistics
import time

import numpy as np
import torch

from cpdata.errors import check_int

__all__ = ["alternating_medians", "bench_device", "describe_machine", "paired_ratio"]


def bench_device() -> torch.device:
    """The device the step benchmarks run on: ``cuda`` when available, else ``cpu``."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def alternating_medians(fns, *, repeats: int, warmup: int = 2,
                        device: torch.device | None = None) -> list[float]:
    """Median seconds of each of ``fns``, one run of each per round after ``warmup`` untimed rounds: a change
    of load weighs on every side of a ratio alike."""
    check_int("repeats", repeats, min=1)
    cuda = device is not None and device.type == "cuda"
    samples: list[list[int]] = [[] for _ in fns]
    for round_ in range(repeats + warmup):
        for fn, out in zip(fns, samples, strict=True):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter_ns()
            fn()
            if cuda:
                torch.cuda.synchronize()
            if round_ >= warmup:
                out.append(time.perf_counter_ns() - t0)
    return [statistics.median(s) / 1e9 for s in samples]


def paired_ratio(ours: list[float], theirs: list[float]) -> float:
    """The median of ``ours[i] / theirs[i]``, round by round (seconds of two sides timed alternately): a change of
    load between rounds divides out, where the ratio of the two medians would carry it (on a loaded 2-core
    machine the two differed by up to half). ``ValueError`` where the rounds differ in number or a time is not
    positive."""
    if len(ours) != len(theirs) or not ours:
        raise ValueError(f"paired rounds need as many times on each side, at least one: got {len(ours)} and "
                         f"{len(theirs)}")  # fmt: skip
    if min(ours) <= 0 or min(theirs) <= 0:
        raise ValueError(f"a round's time is not positive: {min(ours)} s and {min(theirs)} s at least")
    return float(statistics.median(a / b for a, b in zip(ours, theirs, strict=True)))


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe_machine() -> dict[str, object]:
    """What the numbers were measured on: CPU model, cores, library versions, device."""
    device = bench_device()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_model()
    return {
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "torch_version": torch.__version__,
        "numpy_version": np.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "device_name": name,
        "torch_threads": torch.get_num_threads(),
    }
