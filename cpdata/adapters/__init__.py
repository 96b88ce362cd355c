"""Model-side adapters: a cpdata batch as a model stack takes it (torch only; transformers and TE never imported).

:func:`hf_model_kwargs` (Hugging Face causal LMs), :func:`register_hf_attention` (the ``"cpdata"``
attention: every layer's window, softcap and sinks at any cp), :func:`te_attention_kwargs` (Transformer
Engine THD), :func:`document_causal_mask` / :func:`flex_block_mask` (masks of local queries over global
keys), :func:`token_loss` / :func:`global_target_count` (a loss whose CP ranks' values sum to the
single-rank loss). Every adapter reads host-side lengths from ``batch.info``, so none needs ``.item()``.
Modules: ``_batch`` (what adapters read from a batch), ``masks``, ``loss``, ``hf``, ``hf_guard`` (every CP
rank on the ``"cpdata"`` attention, or all refuse), ``hf_attention``, ``hf_layers`` (each layer's variant),
``attention_kernels`` (its kernels), ``te``.
"""

from __future__ import annotations

from cpdata.adapters.hf import hf_model_kwargs
from cpdata.adapters.hf_attention import register_hf_attention
from cpdata.adapters.loss import global_target_count, token_loss
from cpdata.adapters.masks import document_causal_mask, flex_block_mask
from cpdata.adapters.te import TEAttentionArgs, te_attention_kwargs, te_forward_kwargs

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
