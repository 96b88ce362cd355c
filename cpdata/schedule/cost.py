"""The compute cost of a pack: ``cost(L) = a * L + b * L**2`` summed over its pieces (``a``: everything linear in
tokens, ``b``: attention inside one document). Only ``b / a`` changes a schedule; the FlexSP 7B default has the
two terms equal at ~36K tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cpdata.errors import check_int, check_number

__all__ = ["FLEXSP_7B", "CostModel"]

_DEFAULT_FLOPS = 2.2e14
"""Effective training FLOP/s per device of :meth:`CostModel.from_model` when none is given: the rate at
which a 7B model (6.7e9 parameters) runs at ``a = 0.1839576`` ms per token."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CostModel:
    """``cost(L) = a * L + b * L**2`` per document piece of ``L`` tokens (milliseconds by convention)."""

    a: float = 0.1839576
    """Cost per token."""
    b: float = 5.128e-6
    """Cost per token squared (causal attention inside one document)."""

    def __post_init__(self) -> None:
        for name in ("a", "b"):
            check_number(f"CostModel.{name}", getattr(self, name), positive=False)
        if self.a == 0 and self.b == 0:
            raise ValueError("CostModel needs a > 0 or b > 0; with both 0 every pack costs nothing")

    @classmethod
    def from_model(
        cls, num_layers: int, hidden_size: int, num_params: float, *, flops_per_second: float = _DEFAULT_FLOPS
    ) -> CostModel:
        """Cost from training FLOPs of a decoder-only transformer, in ms at ``flops_per_second``: ``6 *
        num_params`` per token and ``6 * num_layers * hidden_size * L**2`` for causal attention over ``L``
        tokens (FlexSP's measured 7B ``b / a`` is 2.8e-5 against 2.0e-5 from FLOPs)."""
        check_int("num_layers", num_layers, min=1)
        check_int("hidden_size", hidden_size, min=1)
        check_number("num_params", num_params)
        check_number("flops_per_second", flops_per_second)
        per_ms = float(flops_per_second) / 1e3
        return cls(a=6.0 * float(num_params) / per_ms, b=6.0 * num_layers * hidden_size / per_ms)

    def __call__(self, lengths: np.ndarray | int) -> np.ndarray:
        """float64 cost of each piece length (same shape as ``lengths``)."""
        n = np.asarray(lengths, dtype=np.float64)
        return self.a * n + self.b * n * n


FLEXSP_7B = CostModel()
"""The published FlexSP 7B profile (the default)."""
