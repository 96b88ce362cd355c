"""How the CP trainers run a Hugging Face model on one rank's shard: the one place that chooses the attention.

The model's own ``attn_implementation`` decides; everything else in
:mod:`cpdata.integrations` calls :class:`CPModelInputs` and never branches on it.
At cp > 1 two are accepted (anything else is refused by :func:`check_attention`,
naming both):

=============  ====================================================================================
``"cpdata"``   the transformers attention cpdata registers (``cpdata.adapters.register_hf_attention``,
               ``model.set_attn_implementation("cpdata")``): the batch's layout travels as a model
               kwarg, every layer's own variant (sliding window, softcap, sinks) is honoured, and K/V
               cross ranks in one collective per layer (an all-gather, or the all-to-all of the
               batch's exchange plan with ``kv_exchange=True``). No ctx; the flex kernel on CUDA.
               The path for sliding-window and softcapped models.
``"sdpa"``     the older path: the model runs inside the ctx ``ContextParallelSharder.shard``
               returns, whose SDPA override gathers K/V from the CP group (one all-gather per layer,
               backward a reduce-scatter), and ``hf_model_kwargs(batch, "sdpa", config=model, ...)``
               passes the mask of this rank's queries over the gathered global keys (``[1, 1, L,
               cp*L]`` bool; document-causal, within the window of a sliding-window model). SDPA then
               runs with an explicit mask (no flash kernel): the correctness path, not the fastest.
=============  ====================================================================================

At cp = 1 there is nothing to gather: the model keeps its own implementation
("cpdata", flash varlen ``cu_seq_lens``, sdpa/eager masks or flex, all from
:func:`cpdata.adapters.hf_model_kwargs`, the masks from the model's config) and no context is entered.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch

from cpdata.adapters import hf_model_kwargs
from cpdata.adapters.hf_attention import registered_options
from cpdata.nemo.sharder import ContextParallelSharder

__all__ = ["CPModelInputs", "check_attention"]


def _registered(impl: Any) -> bool:
    return isinstance(impl, str) and registered_options(impl) is not None


def check_attention(config: Any, cp_size: int) -> None:
    """Refuse a model whose attention cannot run under CP (``ValueError`` naming the fix)."""
    if cp_size <= 1:
        return
    impl = getattr(config, "_attn_implementation", None)
    if impl != "sdpa" and not _registered(impl):
        raise ValueError(
            f"the model's attn_implementation is {impl!r}; at cp_size={cp_size} it would attend within this "
            "rank's tokens only. Use cpdata's attention (cpdata.adapters.register_hf_attention(), then "
            "model.set_attn_implementation('cpdata') or from_pretrained(..., attn_implementation='cpdata')), "
            "or attn_implementation='sdpa' (the sharder's SDPA override gathers K/V over the CP group)"
        )


class CPModelInputs:
    """``(context, model kwargs)`` for one :class:`~cpdata.worker.batch.ShardedBatch` on this rank.

    Args:
        mesh: the ``(dp, cp)`` device mesh, or None in a single process (cp = 1, no process group).
        device: where the batch goes (the Trainer's ``args.device``).
        attn_implementation: the model's own (``config._attn_implementation``): at cp > 1 a name
            registered by ``register_hf_attention`` (``"cpdata"``) or ``"sdpa"`` (the ctx).
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
            if batch.layout.cp_size > 1 and _registered(self.attn_implementation):  # no ctx: the layers gather
                return contextlib.nullcontext(), hf_model_kwargs(
                    batch, self.attn_implementation, tensors=local, num_items_in_batch=num_items_in_batch,
                    group=self.mesh["cp"].get_group())  # fmt: skip
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
