"""The kernels behind the ``"cpdata"`` attention: dense masked SDPA (any device), flex (CUDA) and varlen.

For local queries ``q [B, H, L, E]`` over keys/values ``k [B, Hkv, S, E]``, ``v [B, Hkv, S, Ev]`` (GQA
query head ``h`` reads key head ``h // (H / Hkv)``, as transformers' ``repeat_kv``)::

    s = scale * q k^T                          [B, H, L, S]
    s = softcap * tanh(s / softcap)            (logit softcapping, Gemma 2)
    s = s where keep else -inf                 (document, causal, window)
    p = softmax([s, sink_h])[..., :S]          (attention sinks, gpt-oss: an extra logit per head, no value)
    out = dropout(p) v                         [B, H, L, Ev]

Memory per kernel: docs/hf-attention.md. :func:`attend` is the one place a new kernel plugs in, with the
mask form it takes (``HFAttentionState.mask``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from cpdata.adapters.hf_layers import LayerVariant
from cpdata.device.varlen import SDPA, Kernel, varlen_attention

__all__ = ["attend", "dense_attention", "flex_attention_call"]


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keep: torch.Tensor,
    *,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """``out [B, H, L, Ev]`` with a dense bool ``keep`` mask ``[B|1, 1, L, S]``: one SDPA call, or with softcap
    or sinks explicit scores in ``q``'s dtype and a softmax in at least float32."""
    groups = q.shape[1] // k.shape[1]
    if softcap is None and sinks is None:
        return SDPA(q, k, v, attn_mask=keep, dropout_p=dropout, scale=scale, enable_gqa=groups > 1)
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    dtype = torch.promote_types(scores.dtype, torch.float32)
    scores = scores.to(dtype).masked_fill(~keep, float("-inf"))
    if sinks is not None:
        sink = sinks.to(dtype).reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
        probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]
    else:
        probs = scores.softmax(dim=-1)
    probs = F.dropout(probs, p=dropout, training=dropout > 0).to(v.dtype)
    return torch.matmul(probs, v)


@functools.cache
def _compiled_flex() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_attention_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: Any,
    *,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out [B, H, L, Ev]`` through ``flex_attention`` (compiled once on CUDA, eager elsewhere; no dropout):
    softcap is a ``score_mod``, sinks rescale the output by ``sigmoid(lse - sink)``."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    fn = _compiled_flex() if q.is_cuda else flex_attention
    score_mod = None
    if softcap is not None:
        cap = float(softcap)

        def score_mod(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202 (flex's signature)
            return torch.tanh(score / cap) * cap

    groups = q.shape[1] // k.shape[1]
    kwargs: dict[str, Any] = {"score_mod": score_mod, "block_mask": block_mask, "scale": scale,
                              "enable_gqa": groups > 1}  # fmt: skip
    if sinks is None:
        return fn(q, k, v, **kwargs)
    out, aux = fn(q, k, v, return_aux=AuxRequest(lse=True), **kwargs)
    # softmax over [s, sink] = softmax(s) * Z / (Z + e^sink), Z = e^lse
    dtype = torch.promote_types(aux.lse.dtype, torch.float32)
    keep = torch.sigmoid(aux.lse.to(dtype) - sinks.to(dtype).reshape(1, -1, 1))
    return out * keep.unsqueeze(-1).to(out.dtype)


def attend(
    kernel: Kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, variant: LayerVariant
) -> Any:
    """``out [B, H, L, Ev]`` of the kernel ``kernel`` (chosen by :func:`cpdata.device.varlen.choose_kernel`)
    with its ``mask`` (each kernel takes the mask of the same name)."""
    if kernel == "dense":
        return dense_attention(q, k, v, mask, scale=variant.scale, softcap=variant.softcap, sinks=variant.sinks,
                               dropout=variant.dropout)  # fmt: skip
    if variant.dropout > 0:
        call = "flex_attention" if kernel == "flex" else "cpdata's varlen call"
        raise ValueError(
            f"attention dropout {variant.dropout} on the {kernel} kernel: {call} has no dropout; set "
            "config.attention_dropout=0 or register_hf_attention(kernel='dense')"
        )
    if kernel == "flex":
        return flex_attention_call(q, k, v, mask, scale=variant.scale, softcap=variant.softcap, sinks=variant.sinks)
    return varlen_attention(q, k, v, mask, scale=variant.scale)
