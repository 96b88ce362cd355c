"""What each attention layer of a Hugging Face model computes, read from its config (no transformers import).

``config.layer_types[i]`` (``"full_attention"`` / ``"sliding_attention"``; other types refused),
``config.sliding_window`` (of sliding layers, or of every layer without ``layer_types``: Mistral), per-call
``softcap`` (Gemma 2) and ``s_aux`` sinks (gpt-oss); bidirectional and chunked attention are refused (the
table: docs/hf-attention.md). A window ``W`` keeps the ``W`` keys up to and including the query
(``kv_idx > q_idx - W``, transformers' ``sliding_window_overlay``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from cpdata.errors import check_int

__all__ = ["KNOWN_LAYER_TYPES", "LayerVariant", "check_config", "config_windows", "layer_variant", "layer_window"]

KNOWN_LAYER_TYPES = ("full_attention", "sliding_attention")
# per-call kwargs that change the scores in ways neither kernel computes
_REFUSED_KWARGS = ("position_bias", "alibi", "attention_chunk_size", "chunk_size")


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerVariant:
    """One attention call's variant."""

    window: int | None
    """Sliding window in keys (None: the whole causal document prefix)."""
    scale: float
    """Score scale (``scaling``; default ``head_dim ** -0.5``)."""
    softcap: float | None = None
    """Logit softcap (``softcap * tanh(s / softcap)``)."""
    sinks: torch.Tensor | None = None
    """Per-head sink logits ``[H]`` (``s_aux``)."""
    dropout: float = 0.0
    """Attention dropout probability for this call."""


def check_config(config: Any) -> None:
    """``ValueError`` naming the config field when a model's attention is a variant cpdata does not compute."""
    if config is None:
        return
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(
            "config.use_bidirectional_attention=True: cpdata's document masks are causal; train the model "
            "with use_bidirectional_attention=False"
        )
    if getattr(config, "attention_chunk_size", None) is not None:
        raise ValueError(
            f"config.attention_chunk_size={config.attention_chunk_size}: chunked attention is not computed "
            "by cpdata's masks; set it to None or train without cpdata's attention"
        )
    types = getattr(config, "layer_types", None)
    if types is None:
        return
    unknown = sorted({t for t in types if t not in KNOWN_LAYER_TYPES})
    if unknown:
        raise ValueError(
            f"config.layer_types holds {unknown}: cpdata computes {list(KNOWN_LAYER_TYPES)} only "
            "(a sliding window on positions within each document); other layer types are refused"
        )
    if "sliding_attention" in types:
        layer_window(config, "sliding_attention")


def layer_window(config: Any, layer_type: str | None) -> int | None:
    """The window of a layer of ``layer_type`` (None: full attention); a layer without a type takes
    ``config.sliding_window`` if set (Mistral), a sliding one must have it."""
    window = None if layer_type == "full_attention" else getattr(config, "sliding_window", None)
    if window is None and layer_type != "sliding_attention":
        return None
    return check_int("config.sliding_window", window, min=1, fix=" (sliding layers need a window)")


def config_windows(config: Any) -> dict[str, int | None] | None:
    """``{layer_type: window}`` for each type in ``config.layer_types``; None without ``layer_types``."""
    types = getattr(config, "layer_types", None)
    return None if types is None else {t: layer_window(config, t) for t in dict.fromkeys(types)}


def layer_variant(module: Any, query: torch.Tensor, kwargs: Mapping[str, Any]) -> LayerVariant:
    """The variant of one call of an HF attention function; ``ValueError`` (naming the config field) for a
    non-causal layer, an unknown layer type, a ``sliding_window`` the config disagrees with, or a score
    modifier cpdata does not compute (``position_bias``, ``alibi``, chunked attention)."""
    config = getattr(module, "config", None)
    check_config(config)
    for name in _REFUSED_KWARGS:
        if kwargs.get(name) is not None:
            raise ValueError(
                f"{type(module).__name__} passes {name}= to its attention: a score modifier cpdata's attention "
                "does not compute; train this model with another attn_implementation"
            )
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    if not is_causal:
        raise ValueError(
            f"{type(module).__name__} attends bidirectionally (is_causal=False, config."
            "use_bidirectional_attention): cpdata's document masks are causal"
        )
    layer_type = getattr(module, "layer_type", None)
    types = getattr(config, "layer_types", None)
    idx = getattr(module, "layer_idx", None)
    if layer_type is None and types is not None and isinstance(idx, int) and 0 <= idx < len(types):
        layer_type = types[idx]
    if layer_type is not None and layer_type not in KNOWN_LAYER_TYPES:
        raise ValueError(
            f"config.layer_types[{idx}]={layer_type!r} ({type(module).__name__}): cpdata's attention "
            f"computes {list(KNOWN_LAYER_TYPES)} only; other layer types are refused"
        )
    expected = layer_window(config, layer_type)
    window = kwargs.get("sliding_window", expected)
    if window != expected:
        raise ValueError(
            f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}, layer type {layer_type!r}) "
            f"passes sliding_window={window!r} but its config gives {expected!r} (config.sliding_window / "
            "config.layer_types); the model's own masks and its kernels would disagree, so cpdata refuses"
        )
    scale = kwargs.get("scaling")
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    sinks = kwargs.get("s_aux")
    if sinks is not None and sinks.numel() != query.shape[1]:
        raise ValueError(f"s_aux (attention sinks) has {sinks.numel()} values for {query.shape[1]} query heads")
    softcap = kwargs.get("softcap")
    return LayerVariant(window=window, scale=float(scale), softcap=None if softcap is None else float(softcap),
                        sinks=sinks, dropout=float(kwargs.get("dropout", 0.0) or 0.0))  # fmt: skip
