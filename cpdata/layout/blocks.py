"""Run tables of ``P`` equal-length packs at once (their ``N`` documents back to back, ``counts`` per pack):
the head-tail (``thd``, ``round_robin``) and ``balanced`` builders. Each pack gets, bit for bit, the table it
gets alone; the builders take validated lengths (:func:`cpdata.layout.maps.layout_runs` validates).
"""

from __future__ import annotations

import functools

import numpy as np

from cpdata.layout.runs import RunBlock, _frozen, _per_run, _within_packs

__all__ = ["RunBlock", "balanced_block", "head_tail_block"]


@functools.lru_cache(maxsize=32)
def _head_tail_coefs(cp_size: int, local_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Constants of :func:`head_tail_block`: ``of_c`` int64 ``[4, 1, 2cp]`` (per chunk length: the inverse shift,
    size and end of chunk ``j``; then ``rank * local_len``), ``ranks`` ``[2cp]``, ``picks`` ``[cp, 1, 2]``."""
    cp = cp_size
    j = np.arange(2 * cp, dtype=np.int64)
    ranks = np.minimum(j, 2 * cp - 1 - j)
    of_c = np.stack([(j >= cp) - j, np.ones_like(j), j + 1, ranks * local_len])[:, None, :]
    picks = np.stack([j[:cp], 2 * cp - 1 - j[:cp]], axis=1)[:, None, :]
    _frozen(of_c, ranks, picks)
    return of_c, ranks, picks


def head_tail_block(slot_lens: np.ndarray, counts: np.ndarray | None, cp_size: int, pack_len: int,
                    with_docs: bool = True) -> RunBlock:  # fmt: skip
    """Chunks ``r`` and ``2cp-1-r`` of every slot (``slot_lens`` int64 ``[N]``, multiples of 2cp summing to
    ``pack_len`` per pack). A slot of ``c`` tokens per chunk after ``C`` chunk tokens: chunk ``j`` starts at
    ``2cp*C + j*c`` and sits at ``2C + [j >= cp]*c`` in its rank's row."""
    cp = cp_size
    of_c, ranks, picks = _head_tail_coefs(cp, pack_len // cp)
    g = 2 * cp
    c = slot_lens // g
    before = _within_packs(c[None], counts)[0][0]  # C
    # [4, N, 2cp]: per chunk length, the inverse shift, size and end, then rank * local_len (operands: _per_run)
    table = of_c.take(np.zeros(c.shape[0], dtype=np.intp), axis=1)
    table[:3] *= _per_run(c, g)
    inv, sizes, ends, base = table
    inv += base
    inv += _per_run((2 - 2 * cp) * before, g)
    docs = (ends, slot_lens) if with_docs else (None, None)
    return RunBlock(pack_len, cp, counts, sizes, inv, ranks, picks, None, *docs)


@functools.lru_cache(maxsize=16)
def _balanced_coefs(cp_size: int, local_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Constants of :func:`balanced_block`, ``G = 4cp`` columns per document (heads ``c``, middles ``t``, tails ``i``).

    ``coefs`` int64 ``[7, 2cp*cp, G]``, indexed by ``key = (T % cp) * 2cp + m`` (``T`` tokens dealt before the
    document, ``m`` its remainder): the parts of the inverse shift, size, end and rank not linear in ``q``, ``Q``,
    ``T`` (empty middles end where the real ones do, so a row's runs tile it), then the coefficients of ``q``.
    ``picks`` ``[cp, cp, 4]``: rank ``r``'s head, two middles and tail for each ``T % cp``.
    """
    cp, local = cp_size, local_len
    c = np.arange(cp, dtype=np.int64)
    t = np.arange(2 * cp, dtype=np.int64)
    i = c
    rho = np.repeat(c, 2 * cp)[:, None]  # T % cp of each key
    m = np.tile(t, cp)[:, None]  # remainder of each key
    u = rho + t  # dealt index of each middle minus cp * (T // cp)
    zero = np.zeros((rho.shape[0], cp), dtype=np.int64)
    nonlinear = np.stack([
        np.concatenate([local * c + (c < rho), local * (u % cp) + u // cp - t, local * (cp - 1 - i) + (rho + m + i) // cp - m], axis=1),
        np.concatenate([zero, (t < m).astype(np.int64), zero], axis=1),
        np.concatenate([zero, np.minimum(t, m) + (t < m), m + zero], axis=1),
        np.concatenate([c + zero, u % cp, cp - 1 - i + zero], axis=1),
    ])  # fmt: skip
    of_q = np.stack([
        np.concatenate([-c, np.full(2 * cp, 1 - cp), 1 - cp - i]),
        np.concatenate([np.ones(cp, dtype=np.int64), np.zeros(2 * cp, dtype=np.int64), np.ones(cp, dtype=np.int64)]),
        np.concatenate([c + 1, np.full(2 * cp, cp), cp + i + 1]),
    ])[:, None, :]  # fmt: skip
    k1 = (c[:, None] - c[None, :]) % cp  # [rank, T % cp]: the rank's first middle
    picks = np.stack([np.broadcast_to(c[:, None], (cp, cp)), cp + k1, 2 * cp + k1,
                      np.broadcast_to(4 * cp - 1 - c[:, None], (cp, cp))], axis=2)  # fmt: skip
    coefs = np.concatenate([nonlinear, np.broadcast_to(of_q, (3, *nonlinear.shape[1:]))])
    _frozen(coefs, picks)
    return coefs, picks


def balanced_block(lens: np.ndarray, counts: np.ndarray | None, pack_len: int, cp_size: int) -> RunBlock:
    """``balanced`` of ``P`` packs (``lens`` int64 ``[N]``): ``4cp`` runs per document, then the padding dealt.

    Document ``n = 2cp*q + m`` tokens, ``T`` remainder tokens dealt and ``Q`` head tokens per rank before it:
    rank ``r`` owns head chunk ``r``, the middle tokens ``t < m`` with ``(T + t) % cp == r`` and tail chunk
    ``2cp-1-r``; a middle token ``u = T + t`` sits at ``2Q + q + u // cp`` of its rank's row.
    """
    cp = cp_size
    coefs, picks = _balanced_coefs(cp, pack_len // cp)
    qm = np.empty((2, lens.shape[0]), dtype=np.int64)
    q, m = qm
    np.divmod(lens, 2 * cp, out=(q, m))
    (heads, dealt), totals = _within_packs(qm, counts)  # Q, T
    shift, rho = np.divmod(dealt, cp)
    key = rho * (2 * cp)
    key += m
    g = 4 * cp
    # [7, N, 4cp]: inverse shifts, sizes, ends, ranks (not linear in q), then q's coefficients
    table = coefs.take(key, axis=1)
    linear = table[4:]
    linear *= _per_run(q, g)
    table[:3] += linear
    shift += (2 - 2 * cp) * heads - dealt  # (2 - 2cp) Q - T + T // cp
    table[0] += _per_run(shift, g)
    inv, sizes, ends, ranks = table[:4]
    total_heads, dealts = totals.tolist()
    tails = [pack_len - 2 * cp * h - t for h, t in zip(total_heads, dealts, strict=True)]
    return RunBlock(pack_len, cp, counts, sizes, inv, ranks, picks, pick_key=rho, ends=ends, lens=lens,
                    tails=tails, dealts=dealts)  # fmt: skip
