"""Model-side adapters: turn a cpdata batch into what a model stack takes (torch only at import).

=====================  ==========================================================================
:func:`hf_model_kwargs`  ``model(**kwargs)`` for Hugging Face ``transformers`` causal LMs
                       (the ``"cpdata"`` attention's state, flash-attn varlen ``cu_seq_lens``, or
                       explicit sdpa/eager/flex masks per layer type)
:func:`register_hf_attention`  ``attn_implementation="cpdata"``: every layer's window, softcap and
                       sinks over the batch's documents, at cp 1 and cp > 1 (no ctx)
:func:`te_attention_kwargs`  Transformer Engine ``DotProductAttention`` THD arguments
                       (:func:`te_forward_kwargs`: the per-step half, no process group)
:func:`document_causal_mask`  dense bool mask of local queries over global keys (SDPA)
:func:`flex_block_mask`  the same as a flex-attention ``BlockMask``
:func:`token_loss`     cross-entropy whose CP ranks' values sum to the single-rank loss
:func:`global_target_count`  the pack's target count (one all-reduce, no host sync)
=====================  ==========================================================================

Every adapter reads host-side lengths from ``batch.info`` (Python ints), so
none needs ``.item()`` after the batch moved to the device. Nothing in
``cpdata`` imports this package; ``transformers`` and Transformer Engine are
never imported here (``register_hf_attention()`` imports transformers when called).

Role: the top of the device half, for model stacks; modules: ``_batch`` (what
every adapter reads from a batch), ``masks`` (document-causal masks), ``loss``
(CP-summable loss), ``hf`` (Hugging Face kwargs), ``hf_guard`` (every CP rank's model on the
``"cpdata"`` attention, or every rank refuses), ``hf_attention`` (the ``"cpdata"``
transformers attention), ``hf_layers`` (each layer's variant from its config),
``attention_kernels`` (dense SDPA and flex kernels behind it), ``te`` (Transformer Engine).
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
