"""GPU check part ``linear_per_position``: what one token position costs a layer's linear layers, forward and
backward, for the world deal's cost model (:attr:`~cpdata.layout.world_cost.WorldCost.per_position_seconds`).

A position runs the layer's projections and MLP whatever it holds (a cpdata rank computes its whole local row,
pad included), so a step's predicted time has a term in positions beside the attention tiles. The part times the
linear layers of the shape the model's defaults describe (hidden 4096: Q ``4096 x 4096``, K and V ``4096 x 1024``,
O ``4096 x 4096``, a SwiGLU MLP of 14,336; bf16) on ``[positions, hidden]`` inputs of a few lengths, and fits
``seconds = intercept + per_position * positions`` by least squares (:func:`~cpdata.bench.gpu_attention.fit_line`):
the slope goes to ``calibration.json`` beside the attention part's tile (:func:`cpdata.bench.gpu_check.main`), the
intercept (launches, the weights' reads) is reported. Trade-off: a GEMM of a few thousand rows runs near its peak,
so the slope is the cost of a position inside a long row; short calls, as Megatron's per-sub-sample passes, pay more
a position than it says.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from cpdata.bench.gpu_attention import fit_line, time_step

__all__ = ["HIDDEN", "KV_DIM", "MLP", "POSITIONS", "REPEATS", "linear_layers", "run"]

HIDDEN, KV_DIM, MLP = 4096, 8 * 128, 14336
"""The layer the cost model's defaults describe: 32 query heads and 8 K/V heads of dim 128, a SwiGLU MLP."""
POSITIONS: tuple[int, ...] = (2048, 4096, 8192, 16384)
"""The rows timed: a rank's local row at 4K and 8K, and either side."""
REPEATS = 5


class _Linear(torch.nn.Module):
    """A layer's linear layers: Q, K, V, O projections and a SwiGLU MLP (attention itself left out)."""

    def __init__(self, hidden: int, kv_dim: int, mlp: int) -> None:
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(hidden, d, bias=False) for d in (hidden, kv_dim, kv_dim))
        self.o = torch.nn.Linear(hidden, hidden, bias=False)
        self.gate, self.up = (torch.nn.Linear(hidden, mlp, bias=False) for _ in range(2))
        self.down = torch.nn.Linear(mlp, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[positions, hidden]`` -> ``[positions, hidden]``; K and V enter the output so backward runs them."""
        h = self.o(self.q(x)) + (self.k(x).sum(-1, keepdim=True) + self.v(x).sum(-1, keepdim=True))
        return self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))


def linear_layers(hidden: int = HIDDEN, kv_dim: int = KV_DIM, mlp: int = MLP, *, device: str | torch.device = "cuda",
                  dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:  # fmt: skip
    """The timed module, on ``device`` in ``dtype``."""
    return _Linear(hidden, kv_dim, mlp).to(device=device, dtype=dtype)


def run(*, positions: Sequence[int] = POSITIONS, repeats: int = REPEATS, hidden: int = HIDDEN, kv_dim: int = KV_DIM,
        mlp: int = MLP, device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> dict:  # fmt: skip
    """``{"rows": [{"positions", "seconds", "us_per_position"}], "per_position_seconds", "intercept_seconds", "r2",
    "points", "shape"}``: each row the median of ``repeats`` forward + backward passes after a warm-up; the fit
    over the rows (None figures below two distinct lengths)."""
    layer = linear_layers(hidden, kv_dim, mlp, device=device, dtype=dtype)
    rows = []
    for n in positions:
        x = torch.randn(n, hidden, device=device, dtype=dtype, requires_grad=True)
        grad = torch.randn(n, hidden, device=device, dtype=dtype)
        seconds = time_step(lambda x=x, grad=grad: layer(x).backward(grad), repeats)
        rows.append({"positions": int(n), "seconds": seconds, "us_per_position": seconds / n * 1e6})
    fit = fit_line(np.array([r["positions"] for r in rows]), np.array([r["seconds"] for r in rows]), per="position")
    return {"rows": rows, "per_position_seconds": fit["per_position_seconds"],
            "intercept_seconds": fit["intercept_seconds"], "r2": fit["r2"], "points": fit["points"],
            "shape": f"hidden {hidden}, K/V {kv_dim}, SwiGLU {mlp}, {str(dtype).removeprefix('torch.')}"}  # fmt: skip
