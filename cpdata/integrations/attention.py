"""How the CP trainers run a Hugging Face model on one rank's shard: the one place that chooses the attention.

:data:`ATTENTION` names the path; everything else in :mod:`cpdata.integrations`
calls :class:`CPModelInputs` and never branches on it:

==========  ====================================================================================
``"ctx"``   today's path. The model runs with ``attn_implementation="sdpa"`` inside the ctx
            ``ContextParallelSharder.shard`` returns: its SDPA override gathers K/V from the CP
            group (one collective per layer, backward a reduce-scatter) and
            ``hf_model_kwargs(batch, "sdpa", config=model, ...)`` passes the mask of this
            rank's queries over the gathered global keys (``[1, 1, L, cp*L]`` bool; document-causal,
            within the window of a sliding-window model).
``"cpdata"``  the transformers attention registered as ``"cpdata"``
            (``cpdata.adapters.register_hf_attention``, being built): the layout travels as a
            model kwarg and every layer's own variant (sliding window, sinks) is honoured. Not on
            this branch yet; selecting it raises ``ValueError`` naming what is missing.
==========  ====================================================================================

Switching is the one line ``ATTENTION = "cpdata"`` once that adapter lands.

At cp = 1 there is nothing to gather: the model keeps its own implementation
(flash varlen ``cu_seq_lens``, sdpa/eager masks or flex, all from
:func:`cpdata.adapters.hf_model_kwargs`, the masks from the model's config) and no context is entered.

Cost of the ctx path per layer at cp > 1: one all-gather of ``cat(K, V)``
(``cp * L`` tokens) and an ``L x cp*L`` boolean mask built once per batch; SDPA
then runs with an explicit mask (no flash kernel). It is the correctness path,
not the fastest one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, Literal

import torch

from cpdata.adapters import hf_model_kwargs
from cpdata.device.sharder import ContextParallelSharder

__all__ = ["ATTENTION", "CPModelInputs", "check_attention"]

ATTENTION: Literal["ctx", "cpdata"] = "ctx"
"""The attention path of every CP trainer at cp > 1 (see the module docstring)."""


def check_attention(config: Any, cp_size: int) -> None:
    """Refuse a model whose attention the chosen path cannot run under CP (``ValueError`` naming the fix)."""
    if cp_size <= 1:
        return
    if ATTENTION != "ctx":
        raise ValueError(
            f"ATTENTION={ATTENTION!r} needs cpdata.adapters.register_hf_attention, which this cpdata does not "
            "have yet; keep ATTENTION='ctx'"
        )
    impl = getattr(config, "_attn_implementation", None)
    if impl != "sdpa":
        raise ValueError(
            f"the model's attn_implementation is {impl!r}; at cp_size={cp_size} cpdata runs attention through "
            "the sharder's SDPA override, which gathers K/V over the CP group. Load the model with "
            "attn_implementation='sdpa' (or call model.set_attn_implementation('sdpa'))"
        )


class CPModelInputs:
    """``(context, model kwargs)`` for one :class:`~cpdata.worker.batch.ShardedBatch` on this rank.

    Args:
        mesh: the ``(dp, cp)`` device mesh, or None in a single process (cp = 1, no process group).
        device: where the batch goes (the Trainer's ``args.device``).
        attn_implementation: the model's own (``config._attn_implementation``), used at cp = 1.
        config: the model (or its config), whose sliding windows and layer types the masks follow
            (``hf_model_kwargs(config=...)``).

    The sharder is resolved from the first batch and reused; each call is one
    host-to-device copy of the batch's buffer (its tokens were sharded on the
    dataloader worker) and, at cp > 1, the ctx factory of that batch.
    """

    def __init__(self, mesh: Any, device: torch.device, attn_implementation: str, config: Any) -> None:
        self.mesh = mesh
        self.device = torch.device(device)
        self.attn_implementation = attn_implementation
        self.config = config
        self._sharder: ContextParallelSharder | None = None

    def __call__(
        self, batch: Any, num_items_in_batch: torch.Tensor | int | None
    ) -> tuple[contextlib.AbstractContextManager, dict[str, Any]]:
        if not isinstance(getattr(batch, "info", None), Mapping):
            raise TypeError(
                f"a CP trainer's inputs are cpdata ShardedBatches from its own CPDataLoader, got "
                f"{type(batch).__name__}; do not replace get_train_dataloader or the data collator"
            )
        if self.mesh is None:
            local = batch.to(self.device, non_blocking=True).tensors()
            ctx: contextlib.AbstractContextManager = contextlib.nullcontext()
            impl = self.attn_implementation
        else:
            if self._sharder is None:
                self._sharder = ContextParallelSharder(None, self.mesh, batch)
            factory, local = self._sharder.shard(batch)
            if batch.layout.cp_size > 1:
                # sdpa kwargs at cp > 1 are built inside the ctx (their mask is over the gathered keys); the step
                # then runs in a fresh one (the SDPA override, K/V gathered)
                with factory(require_calls=False):
                    kwargs = hf_model_kwargs(batch, "sdpa", tensors=local, num_items_in_batch=num_items_in_batch,
                                             config=self.config)  # fmt: skip
                return factory(), kwargs
            ctx = factory()  # cp = 1: nullcontext
            impl = self.attn_implementation
        return ctx, hf_model_kwargs(batch, impl, tensors=local, num_items_in_batch=num_items_in_batch,
                                    config=self.config)  # fmt: skip
