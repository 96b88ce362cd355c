"""The one place that chooses how the CP trainers run a Hugging Face model's attention on one rank's shard.

The model's own ``attn_implementation`` decides: at cp > 1 ``"cpdata"`` (no ctx; each layer moves its K/V) or
``"sdpa"`` (inside the sharder's ctx, which gathers K/V); at cp = 1 its own, no ctx (docs/trainers.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch

from cpdata.adapters import hf_model_kwargs
from cpdata.adapters.hf_attention import REGISTERED
from cpdata.nemo.sharder import ContextParallelSharder

__all__ = ["CPModelInputs", "check_attention"]


def check_attention(config: Any, cp_size: int) -> None:
    """Refuse a model whose attention cannot run under CP (``ValueError`` naming the fix)."""
    if cp_size <= 1:
        return
    impl = getattr(config, "_attn_implementation", None)
    if impl == "cpdata" and impl not in REGISTERED:
        raise ValueError(
            "the model's attn_implementation is 'cpdata', which is not registered in this process: call "
            "cpdata.adapters.register_hf_attention() first, on every rank, before set_attn_implementation('cpdata') "
            "or from_pretrained(..., attn_implementation='cpdata') (transformers refuses the name until then: "
            "'Specified `attn_implementation=\"cpdata\"` is not supported')"
        )
    if impl != "sdpa" and impl not in REGISTERED:
        raise ValueError(
            f"the model's attn_implementation is {impl!r}; at cp_size={cp_size} it would attend within this "
            "rank's tokens only. Use cpdata's attention (cpdata.adapters.register_hf_attention(), then "
            "model.set_attn_implementation('cpdata') or from_pretrained(..., attn_implementation='cpdata')), "
            "or attn_implementation='sdpa' (the sharder's SDPA override gathers K/V over the CP group)"
        )


class CPModelInputs:
    """``(context, model kwargs)`` for one :class:`~cpdata.worker.batch.ShardedBatch` on this rank: one
    host-to-device copy of its buffer. ``mesh`` is the ``(dp, cp)`` mesh (None in a single process);
    ``config`` the model or its config, whose sliding windows and layer types the masks follow."""

    def __init__(self, mesh: Any, device: torch.device, attn_implementation: str, config: Any) -> None:
        self.mesh, self.device, self.config = mesh, torch.device(device), config
        self.attn_implementation = attn_implementation
        self._sharder: ContextParallelSharder | None = None

    def __call__(
        self, batch: Any, num_items_in_batch: torch.Tensor | int | None
    ) -> tuple[contextlib.AbstractContextManager, dict[str, Any]]:
        if not isinstance(getattr(batch, "info", None), Mapping):
            raise TypeError(
                f"a CP trainer's inputs are cpdata ShardedBatches from its own CPDataLoader, got "
                f"{type(batch).__name__}; do not replace get_train_dataloader or the data collator"
            )
        factory: Any = contextlib.nullcontext
        if self.mesh is None:
            local = batch.to(self.device, non_blocking=True).tensors()
        else:
            if self._sharder is None:
                self._sharder = ContextParallelSharder(None, self.mesh, batch)
            factory, local = self._sharder.shard(batch)
        impl, given = self.attn_implementation, {"tensors": local, "num_items_in_batch": num_items_in_batch}
        if batch.layout.cp_size == 1:  # the model's own attention, no ctx
            return factory(), hf_model_kwargs(batch, impl, config=self.config, **given)
        if impl in REGISTERED:  # no ctx: the layers gather
            group = self.mesh["cp"].get_group()
            return contextlib.nullcontext(), hf_model_kwargs(batch, impl, group=group, **given)
        with factory(require_calls=False):  # sdpa: the mask over the gathered keys is built inside a ctx
            kwargs = hf_model_kwargs(batch, "sdpa", config=self.config, **given)
        return factory(), kwargs
