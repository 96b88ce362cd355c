"""Progress for long offline runs: tqdm when installed, else one stderr line per 10 %; silent for ``delay`` s."""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any, TextIO

__all__ = ["Progress"]


class Progress:
    """``with Progress(total, "planning") as bar: bar.update(n)``; silent when ``enabled`` is False."""

    def __init__(self, total: int, desc: str, *, unit: str = "it", enabled: bool = True, delay: float = 1.0,
                 file: TextIO | None = None) -> None:  # fmt: skip
        self.total, self.desc, self.unit, self.enabled = max(int(total), 0), desc, unit, enabled
        self.file = file if file is not None else sys.stderr
        self.done = 0
        self._step = -1
        self._show_after = time.monotonic() + delay
        self._bar: Any = None
        if enabled:
            with contextlib.suppress(ImportError):  # no tqdm: the stderr lines
                from tqdm import tqdm

                self._bar = tqdm(total=self.total, desc=desc, unit=unit, file=self.file, unit_scale=True, delay=delay)

    def update(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.enabled and time.monotonic() >= self._show_after:
            step = 10 if self.total == 0 else min(10, self.done * 10 // self.total)
            if step > self._step:
                self._step = step
                print(f"{self.desc}: {step * 10:3d}% ({self.done}/{self.total} {self.unit})", file=self.file, flush=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.close()
