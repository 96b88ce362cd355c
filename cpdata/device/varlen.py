"""Varlen (flash) attention over cpdata's document-causal mask at any cp: segments, ``cu_seq`` and the key gather.

Each run of a rank's local queries with consecutive global positions inside one document slot
(:func:`cpdata.layout.tiles.query_runs`) is one varlen segment::

    queries  q[first : first + n]                  contiguous in local order: no permutation
    keys     global positions lo .. last           the document's prefix up to the run's last query
             lo = slot start                       (window W: max(slot start, first query - W + 1))
    mask     key j <= i + sk - sq                  causal aligned bottom-right, as FA for sq != sk;
             j >= i + sk - sq - (W - 1)            window_size=(W - 1, 0) (transformers' kv > q - W)

Pad queries (a slot's positions past its real ``end``) attend no real key, and the loss never reads them. A
rank's trailing pad, the suffix of its local order past its last real query, costs the kernel nothing: it is
not run, and its output rows are zeros, what flash itself returns for a query with no key (a world step's deal
counts those tiles at zero). Any other run of pad is cut into segments of at most ``PAD_CHUNK`` (128) queries
over their own keys, one diagonal tile each (:func:`cpdata.layout.tiles.pad_cut_runs`, shared with the tile
counter :func:`~cpdata.layout.tiles.varlen_live_tiles`).

Keys come from those the rank holds through one ``index_select`` (a copy; costs by layout:
docs/layouts-and-kernels.md); the kernel, ``torch.nn.attention.varlen.varlen_attn`` (FA2, CUDA), is looked
up per call so tests can swap in :func:`reference_varlen_attn`.

:func:`reference_varlen_attn` is an exact reference of ``varlen_attn``'s semantics on any device, with the
same call: in each segment query ``i`` of ``sq`` sees key ``j`` of ``sk`` (``d = sk - sq``, bottom-right
aligned) when ``i + d - left <= j <= i + d + right`` (``-1``: no bound; ``(-1, 0)``: causal); a query with
no key gets zeros, as flash. SDPA in a Python loop over segments: for tests, not training.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np
import torch

from cpdata.device.attention_masks import check_window
from cpdata.layout.runs import segments
from cpdata.layout.tiles import kept_queries, pad_cut_runs, query_runs

__all__ = ["KERNELS", "SDPA", "Kernel", "KeyCopiesError", "VarlenPlan", "check_kernel", "choose_kernel",
           "reference_varlen_attn", "segment_mask", "varlen_attention", "varlen_plan"]

log = logging.getLogger(__name__)
SDPA = torch._C._nn.scaled_dot_product_attention
"""torch's own SDPA kernel, whatever is patched on ``torch.nn.functional`` (the CP override patches it)."""
Kernel = Literal["dense", "flex", "varlen"]
KERNELS: tuple[Kernel, ...] = get_args(Kernel)
"""The kernels an attention call runs, by name; ``kernel=`` also takes ``"auto"`` (:func:`choose_kernel`)."""
_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_LOGGED: set[str] = set()
MAX_KEY_COPIES = 4
"""A plan gathering more than this many times the keys the rank holds is refused (:class:`KeyCopiesError`)."""


class KeyCopiesError(ValueError):
    """The segments would gather more than ``MAX_KEY_COPIES`` times the keys the rank holds."""


@dataclass(frozen=True, kw_only=True, slots=True)
class VarlenPlan:
    """One batch's varlen segments over the keys a rank holds, for one window and device."""

    queries: int
    """The leading local queries the kernel runs; the rest, the rank's trailing pad, get zeros."""
    cu_seq_q: torch.Tensor
    """int32 ``[N + 1]``: segment offsets in the local queries, ending at ``queries``."""
    cu_seq_k: torch.Tensor
    """int32 ``[N + 1]``: segment offsets in the gathered keys."""
    max_q: int
    """Longest segment in queries."""
    max_k: int
    """Longest segment in keys."""
    key_index: torch.Tensor
    """int64 ``[Kv]``: each gathered key's row in the keys the rank holds."""
    window_size: tuple[int, int]
    """``(-1, 0)`` causal, ``(W - 1, 0)`` a window of ``W`` keys up to the query."""


def _host(t: torch.Tensor) -> np.ndarray:
    return t.detach().reshape(-1).cpu().numpy().astype(np.int64)


def _offsets(lengths: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32).to(device)


def varlen_plan(
    start: torch.Tensor,
    pos: torch.Tensor,
    key_pos: torch.Tensor,
    *,
    window: int | None,
    device: torch.device,
    end: torch.Tensor | None = None,
) -> VarlenPlan:
    """The segments of one row of local queries (slot ``start`` / real ``end``, ``pos``: int ``[L]``) over keys
    held at global positions ``key_pos`` (int ``[K]``). With ``end``, the row's trailing pad (the suffix of its
    local order past its last real query) is left out (``queries``: the leading queries run; a row all pad: 0,
    no segment) and other pad runs become segments of at most :data:`~cpdata.layout.tiles.PAD_CHUNK` queries
    over their own keys (:func:`~cpdata.layout.tiles.pad_cut_runs`); without, pads attend their slot.
    ``ValueError`` when a key is not held; :class:`KeyCopiesError` (before any O(Kv) work) past
    ``MAX_KEY_COPIES`` times the keys held."""
    check_window(window)
    start_np, pos_np, keys_np = (_host(t) for t in (start, pos, key_pos))
    queries = pos_np.size
    if end is None:  # no pads: every run attends its slot
        first, q_len = query_runs(pos_np, start_np)
        lo = start_np[first]
    else:  # the trailing pad is not run; other pad runs in PAD_CHUNK pieces over their own keys
        end_np = _host(end)
        queries = kept_queries(pos_np, end_np)
        pos_np = pos_np[:queries]
        first, q_len, lo = pad_cut_runs(pos_np, start_np[:queries], end_np[:queries])
    last = pos_np[first + q_len - 1]
    if window is not None:
        lo = np.maximum(lo, pos_np[first] - (window - 1))
    k_len = last - lo + 1
    total, held = int(k_len.sum()), max(int(keys_np.size), 1)
    if total > MAX_KEY_COPIES * held:
        raise KeyCopiesError(
            f"the layout cuts documents into {first.size} runs on this rank (varlen would gather {total} keys, "
            f"{total / held:.0f}x the {held} held; layout 'tiled' keeps documents together)"
        )
    wanted = segments(lo, k_len)
    inverse = np.full(int(max(keys_np.max(initial=-1), wanted.max(initial=-1))) + 1, -1, dtype=np.int64)
    inverse[keys_np] = np.arange(keys_np.size, dtype=np.int64)
    index = inverse[wanted]
    if (index < 0).any():
        missing = wanted[index < 0]
        raise ValueError(
            f"{missing.size} keys the queries attend (global positions {missing[:8].tolist()}...) are not among "
            f"the {keys_np.size} keys this rank holds; pass this batch's layout (and its exchange plan)"
        )
    return VarlenPlan(queries=queries, cu_seq_q=_offsets(q_len, device), cu_seq_k=_offsets(k_len, device),
                      max_q=int(q_len.max(initial=0)), max_k=int(k_len.max(initial=0)),
                      key_index=torch.as_tensor(index).to(device),
                      window_size=(-1, 0) if window is None else (window - 1, 0))  # fmt: skip


def check_kernel(kernel: str) -> None:
    """``ValueError`` unless ``kernel`` is ``"auto"`` or one of :data:`KERNELS`."""
    if kernel != "auto" and kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}: use one of {['auto', *KERNELS]}")


def choose_kernel(
    requested: str,
    *,
    softcap: float | None,
    sinks: torch.Tensor | None,
    device: torch.device,
    dtype: torch.dtype,
    plan: Callable[[], VarlenPlan] | None = None,
) -> Kernel:
    """The kernel one attention call runs: ``"dense"`` and ``"flex"`` stand; ``"auto"`` and ``"varlen"`` run
    varlen where the layer allows it (no softcap or sinks, CUDA in fp16 / bf16, ``plan()`` not raising
    :class:`KeyCopiesError`), else flex on CUDA and dense elsewhere, each reason logged once per process."""
    check_kernel(requested)
    if requested in ("dense", "flex"):
        return requested
    cuda = torch.device(device).type == "cuda"
    if requested == "auto" and not cuda:
        return "dense"
    if softcap is not None:
        kind, reason = "softcap", "logit softcap (varlen_attn has no score modifier)"
    elif sinks is not None:
        kind, reason = "sinks", "attention sinks (varlen_attn has no sink logits)"
    elif cuda and dtype not in _FLASH_DTYPES:
        kind, reason = "dtype", f"{dtype} on CUDA (flash takes float16 / bfloat16)"
    else:
        try:
            if plan is not None:
                plan()
            return "varlen"
        except KeyCopiesError as e:
            kind, reason = "copies", str(e)
    fallback: Kernel = "flex" if cuda else "dense"
    if kind not in _LOGGED:
        _LOGGED.add(kind)
        log.warning("cpdata attention: %s, so these layers run %s instead of varlen", reason, fallback)
    return fallback


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: VarlenPlan, *, scale: float
) -> torch.Tensor:
    """``out [1, H, L, Ev]`` of local queries ``q [1, H, L, E]`` over the keys ``k [1, Hkv, K, E]``,
    ``v [1, Hkv, K, Ev]`` the rank holds (differentiable: the key gather's backward sums over segments). Only
    the leading ``plan.queries`` queries go to the kernel (none: it is not called, and the zeros still depend on
    ``q``, ``k``, ``v``, so backward runs the same collectives on every rank); the trailing pad's rows are zeros,
    and their ``q`` gets a zero gradient."""
    import torch.nn.attention.varlen as torch_varlen

    if q.shape[0] != 1 or k.shape[0] != 1:
        raise ValueError(f"varlen attention takes one row of queries and keys, got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}")  # fmt: skip
    groups, heads, rows = q.shape[1] // k.shape[1], q.shape[1], q.shape[2]
    q_t = q[0, :, : plan.queries].transpose(0, 1).contiguous()  # [Q, H, E]
    k_t = k[0].transpose(0, 1).index_select(0, plan.key_index)  # [Kv, Hkv, E]
    v_t = v[0].transpose(0, 1).index_select(0, plan.key_index)
    if plan.queries:
        out = torch_varlen.varlen_attn(q_t, k_t, v_t, plan.cu_seq_q, plan.cu_seq_k, plan.max_q, plan.max_k,
                                       scale=scale, window_size=plan.window_size, enable_gqa=groups > 1)  # fmt: skip
    else:  # all pad, no kernel call; the empty rows keep q, k, v on the graph, so this rank's backward runs
        # the collectives that brought its keys (the all-gather's reduce-scatter) as every other rank's does
        out = torch.cat([t.reshape(0, heads, v.shape[-1]) for t in (q_t, k_t, v_t)])
    if plan.queries < rows:  # the trailing pad's rows [P, H, Ev]
        out = torch.cat([out, out.new_zeros((rows - plan.queries, heads, out.shape[-1]))])
    return out.transpose(0, 1).unsqueeze(0)


def segment_mask(sq: int, sk: int, window_size: tuple[int, int], device: torch.device | str = "cpu") -> torch.Tensor:
    """Bool ``[sq, sk]``: which key each query of one segment sees (bottom-right aligned, see the module)."""
    left, right = window_size
    i = torch.arange(sq, device=device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=device)[None, :]
    return ((j <= i + right) | (right < 0)) & ((j >= i - left) | (left < 0))  # a bound of -1: none that side


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
        o = SDPA(q, k, v, attn_mask=keep | ~seen[:, None], scale=scale, enable_gqa=enable_gqa)[0].transpose(0, 1)
        parts.append(torch.where(seen[:, None, None], o, torch.zeros_like(o)))
    return torch.cat(parts)
