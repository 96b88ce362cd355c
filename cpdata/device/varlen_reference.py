"""An exact reference of ``torch.nn.attention.varlen.varlen_attn``'s semantics, on any device (SDPA per segment).

Same call as torch's. In each segment query ``i`` of ``sq`` sees key ``j`` of ``sk`` (``d = sk - sq``,
bottom-right aligned) when ``i + d - left <= j <= i + d + right`` (``-1``: no bound; ``(-1, 0)``: causal);
a query with no key gets zeros, as flash. A Python loop over segments: for tests, not training.
"""

from __future__ import annotations

import torch

__all__ = ["reference_varlen_attn", "segment_mask"]

_SDPA = torch._C._nn.scaled_dot_product_attention  # torch's kernel, never a patched F attribute


def segment_mask(sq: int, sk: int, window_size: tuple[int, int], device: torch.device | str = "cpu") -> torch.Tensor:
    """Bool ``[sq, sk]``: which key each query of one segment sees (bottom-right aligned, see the module)."""
    left, right = window_size
    i = torch.arange(sq, device=device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=device)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if right >= 0:
        keep &= j <= i + right
    if left >= 0:
        keep &= j >= i - left
    return keep


def reference_varlen_attn(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``out [Tq, H, Ev]`` segment by segment; ``ValueError`` where torch's kernel would refuse the call."""
    if not enable_gqa and query.shape[1] != key.shape[1]:
        raise ValueError(f"query has {query.shape[1]} heads, key {key.shape[1]}: pass enable_gqa=True for GQA")
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"query heads {query.shape[1]} are not a multiple of key heads {key.shape[1]}")
    cq, ck = cu_seq_q.tolist(), cu_seq_k.tolist()
    if len(cq) != len(ck) or cq[0] != 0 or ck[0] != 0 or cq[-1] != query.shape[0] or ck[-1] != key.shape[0]:
        raise ValueError(f"cu_seq_q {cq[:4]}..{cq[-1:]} / cu_seq_k {ck[:4]}..{ck[-1:]} must start at 0 and end "
                         f"at the {query.shape[0]} queries / {key.shape[0]} keys")  # fmt: skip
    if bool((cu_seq_q.diff() < 0).any()) or bool((cu_seq_k.diff() < 0).any()):
        raise ValueError("cu_seq_q / cu_seq_k must be non-decreasing")
    parts = [query.new_zeros((0, query.shape[1], value.shape[-1]))]
    for q0, q1, k0, k1 in zip(cq[:-1], cq[1:], ck[:-1], ck[1:], strict=True):
        sq, sk = q1 - q0, k1 - k0
        if sq > max_q or sk > max_k:
            raise ValueError(f"a segment of {sq} queries / {sk} keys exceeds max_q={max_q} / max_k={max_k}")
        if sq == 0:
            continue
        keep = segment_mask(sq, sk, window_size, query.device)
        seen = keep.any(dim=1)  # rows with no key: zeros, as flash (SDPA would give NaN)
        q, k, v = (t.transpose(0, 1)[None] for t in (query[q0:q1], key[k0:k1], value[k0:k1]))
        o = _SDPA(q, k, v, attn_mask=keep | ~seen[:, None], scale=scale, enable_gqa=enable_gqa)[0].transpose(0, 1)
        parts.append(torch.where(seen[:, None, None], o, torch.zeros_like(o)))
    return torch.cat(parts)
