"""What a forked test rank needs before it builds a Trainer: the torchrun variables, a fresh accelerate state.

``run_ranks`` forks ranks that already share a gloo group; accelerate finds it
through ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` (as under torchrun) and does not
initialize another. A ``TrainingArguments`` built in the parent process (any
earlier test) leaves accelerate's process-wide state behind, which a forked
child would inherit as "one process": it is cleared first.
"""

from __future__ import annotations

import os

import numpy as np
import torch

__all__ = ["launch_env", "relative", "weights"]


def launch_env(rank: int, world: int) -> None:
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # a state inherited from the parent, if any
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    if world == 1:
        for name in names:
            os.environ.pop(name, None)
        return
    os.environ.update(dict(zip(names, map(str, (rank, world, rank, world)), strict=True)))


def weights(model: torch.nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()


def relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))
