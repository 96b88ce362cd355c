"""Model-side adapters: a cpdata batch as a model stack takes it (torch only; transformers and TE never imported).

Modules: ``hf`` (:func:`hf_model_kwargs` for Hugging Face causal LMs), ``hf_attention`` (the ``"cpdata"``
attention, every CP rank on it or all refuse; every layer's variant from ``hf_layers``, its kernels in
``attention_kernels``), ``te`` (Transformer Engine THD) and ``loss`` (CP ranks' losses summing to the
single-rank loss); each reads a batch through :func:`cpdata.device.presharded.batch_parts`. The masks for
model code are :mod:`cpdata.device.attention_masks`'.
"""

from __future__ import annotations

from cpdata.adapters.hf import hf_model_kwargs
from cpdata.adapters.hf_attention import register_hf_attention
from cpdata.adapters.loss import global_target_count, token_loss
from cpdata.adapters.te import TEAttentionArgs, te_attention_kwargs, te_forward_kwargs
from cpdata.device.attention_masks import document_causal_mask, flex_block_mask

__all__ = [
    "TEAttentionArgs",
    "document_causal_mask",
    "flex_block_mask",
    "global_target_count",
    "hf_model_kwargs",
    "register_hf_attention",
    "te_attention_kwargs",
    "te_forward_kwargs",
    "token_loss",
]
