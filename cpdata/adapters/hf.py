"""Keyword arguments for a Hugging Face ``transformers`` causal LM on a cpdata batch (torch only).

``model(**hf_model_kwargs(batch, model.config._attn_implementation, config=model))`` runs a packed batch as
one padding-free row ``[1, T]``: ``input_ids``, ``position_ids``, ``labels`` and ``shift_labels`` (both the
batch's next-token labels: ``ForCausalLMLoss`` does not shift ``shift_labels`` again), ``use_cache=False``,
and every document boundary explicit, never guessed from ``position_ids``: the ``"cpdata"`` attention's
state, flash's ``cu_seq_lens_q/k``, or an sdpa / eager / flex ``attention_mask`` (bool / float32
``[1, 1, T, S]`` / ``BlockMask``; table: docs/hugging-face.md), which follows the windows of ``config=``.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch

import cpdata.adapters.hf_attention as hf_attention
from cpdata.adapters.hf_layers import check_config, config_windows, layer_window
from cpdata.adapters.loss import global_target_count
from cpdata.device.cp_attention import AttentionCore, active_contexts
from cpdata.device.presharded import batch_parts, info_int
from cpdata.errors import is_int
from cpdata.worker.keys import DOCUMENT_IDS, INPUT_IDS, LABELS, N_TARGETS, POSITION_IDS

__all__ = ["hf_model_kwargs"]

_MIN_TRANSFORMERS = (4, 50)  # ForCausalLMLoss(shift_labels=...) (huggingface/transformers#36607)
_MASKED = ("sdpa", "eager", "flex_attention")


def _check_transformers() -> None:
    module = sys.modules.get("transformers")
    version = getattr(module, "__version__", None)
    if not version:
        return
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if parts < _MIN_TRANSFORMERS:
        raise ValueError(
            f"transformers {version} ignores shift_labels and would shift cpdata's next-token labels again; "
            f"install transformers>={'.'.join(map(str, _MIN_TRANSFORMERS))} (pip install 'cpdata[hf]')"
        )


def hf_model_kwargs(
    batch: Any,
    attn_implementation: str = "flash_attention_2",
    *,
    tensors: Mapping[str, torch.Tensor] | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
    group: Any = None,
    config: Any = None,
) -> dict[str, Any]:
    """``model(**kwargs)`` for this rank's batch (no device sync); ``tensors``: its device tensors.
    ``num_items_in_batch`` None: HF's mean at cp 1; at cp > 1 ``batch.info["n_targets"]``, else one all-reduce
    over ``group``. ``config``: the model or its ``PretrainedConfig`` (checked when given)."""
    _check_transformers()
    tensors, layout, info = batch_parts(batch, tensors)
    _check_model_supports(config, attn_implementation)
    config = getattr(config, "config", config)  # a model -> its config
    ours = attn_implementation in hf_attention.REGISTERED
    flash = "flash" in attn_implementation
    if attn_implementation == "cpdata" and not ours:
        raise ValueError("attn_implementation='cpdata' is not registered yet: call "
                         "cpdata.adapters.register_hf_attention() first")  # fmt: skip
    if not (ours or flash or attn_implementation in _MASKED):
        raise ValueError(
            f"unknown attn_implementation {attn_implementation!r}; cpdata passes explicit document boundaries "
            f"for 'cpdata' (register_hf_attention), flash_attention_* (cu_seq_lens) and {list(_MASKED)} "
            "(attention_mask)"
        )
    check_config(config)
    if ours:  # before any collective: the CP group, then every rank's model on this attention
        hf_attention.check_reaches_cpdata(attn_implementation, config, layout, group)
    input_ids = tensors[INPUT_IDS]
    if layout.cp_size > 1 and not ours and attn_implementation != "sdpa":
        raise ValueError(
            f"attn_implementation={attn_implementation!r} would attend within this rank's tokens only "
            f"(cp_size={layout.cp_size}); use the 'cpdata' attention (register_hf_attention(), "
            "model.set_attn_implementation('cpdata')), or 'sdpa' inside the ctx ContextParallelSharder.shard "
            "returns, or Transformer Engine"
        )
    if attn_implementation in _MASKED and config is None:
        raise ValueError(
            f"attn_implementation={attn_implementation!r} builds attention_mask from the model's sliding windows "
            "(config.sliding_window, config.layer_types), and without them a sliding-window model would silently "
            "attend past its window: pass config=model (or model.config), or use the 'cpdata' attention, which "
            "reads each layer's window itself (register_hf_attention(), model.set_attn_implementation('cpdata'))"
        )
    if layout.cp_size > 1:
        if input_ids.shape[:-1].numel() != 1:
            raise ValueError(
                f"at cp_size={layout.cp_size} a batch of {tuple(input_ids.shape)} holds one local slice per row; "
                "build the pipeline with qkv_format='thd' or batch_size=1 for a single stream"
            )
        n = input_ids.numel()  # the sdpa masks are over the gathered keys: without the ctx, SDPA fails on shapes
        if not ours and not any(ctx.local_len == n for ctx in active_contexts()):
            raise ValueError(
                f"attn_implementation='sdpa' at cp_size={layout.cp_size} runs only inside the ctx "
                "ContextParallelSharder.shard returns (its SDPA gathers K/V; the mask is over all "
                f"{n * layout.cp_size} keys): build the kwargs inside `with ctx():`, or use the 'cpdata' "
                "attention, which needs no ctx (register_hf_attention(), model.set_attn_implementation('cpdata'))"
            )
        if num_items_in_batch is None:
            num_items_in_batch = _global_targets(batch, tensors, info, group)
    rows = {"input_ids": input_ids, "position_ids": tensors[POSITION_IDS], "labels": tensors[LABELS]}
    kwargs: dict[str, Any] = {name: tensor.reshape(1, -1) for name, tensor in rows.items()}
    kwargs.update(shift_labels=kwargs["labels"], use_cache=False)
    if num_items_in_batch is not None:
        kwargs["num_items_in_batch"] = num_items_in_batch
    if ours:
        state = hf_attention.attention_state(attn_implementation, layout, tensors[DOCUMENT_IDS],
                                             tensors["cu_seqlens_padded"], tensors.get("cu_seqlens"), group)
        if layout.cp_size > 1:
            hf_attention.remember(state)
        kwargs[hf_attention.STATE_KEY] = state
        return kwargs
    if flash:
        cu = tensors["cu_seqlens_padded"]
        max_len = info_int(info, "max_seqlen_padded")
        kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_len, max_length_k=max_len)
        return kwargs
    # one row: at cp 1 the whole stream at positions 0..T-1, at cp > 1 this rank's slice; pads see themselves
    doc_ids = tensors[DOCUMENT_IDS].reshape(1, -1)
    core = AttentionCore(layout=layout, document_ids=doc_ids, cu_seqlens_padded=tensors["cu_seqlens_padded"],
                         cu_seqlens=tensors.get("cu_seqlens"), whole_pack=layout.cp_size == 1)  # fmt: skip
    kind, low = "flex" if attn_implementation == "flex_attention" else "dense", torch.finfo(torch.float32).min
    windows = config_windows(config)
    by_window: dict[int | None, Any] = {}
    for window in (set(windows.values()) if windows is not None else {layer_window(config, None)}):
        # global keys: the ctx's SDPA takes a mask over all S keys (and all-gathers K/V for it), plan or not
        mask = core.mask(kind, window, doc_ids.device, gathered=True)
        if attn_implementation == "eager":
            mask = torch.zeros_like(mask, dtype=torch.float32).masked_fill_(~mask, low)
        by_window[window] = mask
    if windows is None or len(by_window) == 1:
        kwargs["attention_mask"] = next(iter(by_window.values()))
    else:  # transformers models with layer_types pick each layer's mask from a mapping keyed by layer type
        kwargs["attention_mask"] = {layer_type: by_window[w] for layer_type, w in windows.items()}
    return kwargs


_SUPPORT_FLAGS = {"sdpa": "_supports_sdpa", "flex_attention": "_supports_flex_attn"}


def _check_model_supports(model: Any, impl: str) -> None:
    """A model class that declares it cannot run ``impl`` (Gemma 2's softcap, gpt-oss' sinks under SDPA)."""
    flag = _SUPPORT_FLAGS.get(impl)
    if flag is not None and hasattr(model, "config") and getattr(model, flag, True) is False:
        raise ValueError(
            f"{type(model).__name__}.{flag} is False: transformers' {impl} drops a variant this model needs "
            "(logit softcapping, attention sinks); use the 'cpdata' attention (register_hf_attention()) or 'eager'"
        )


def _global_targets(batch: Any, tensors: Mapping[str, torch.Tensor], info: Mapping[str, Any], group: Any) -> Any:
    """The pack's target count at cp > 1: ``info["n_targets"]`` if recorded, else one all-reduce over ``group``."""
    recorded = info.get(N_TARGETS)
    if is_int(recorded):
        return recorded
    try:
        return global_target_count(batch, group, labels=tensors[LABELS])
    except ValueError as e:
        raise ValueError(
            f"at cp_size={batch.layout.cp_size} the HF loss must divide by the pack's global target count, or "
            f"the ranks' losses add up to cp x the loss; pass num_items_in_batch=global_target_count(batch, "
            f"cp_group) or group=cp_group ({e})"
        ) from None
