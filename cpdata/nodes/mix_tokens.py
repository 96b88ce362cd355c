"""``cpdata.mix(..., by="tokens")``: weights over tokens drawn, not documents.

Every draw reads from the source furthest behind its token share: the smallest ``tokens_k / w_k``, ties
broken by a seeded order drawn again each epoch. Source ``k``'s document ``c`` occupies
``[before_c / w_k, (before_c + len_c) / w_k)`` on that clock and the mix yields documents in the order
their intervals start, so after any draw every source is within one document of ``w_k * total`` tokens,
exactly, at every prefix (Megatron ``BlendedDataset``'s rule over variable-length documents). Every rank
needs the length of every draw: a sequence's stated ``lengths``, else the item's ``input_ids`` (another
rank's stream items are read and dropped anyway). :func:`token_draw_order` lists an epoch vectorized,
tested equal to the node's stream.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["BY", "TokenClock", "token_draw_order"]

BY: tuple[str, ...] = ("documents", "tokens")
_TAG = 0x70C5  # separates the tie order's random stream from the document draws'


def tie_ranks(seed: int, epoch: int, k: int) -> np.ndarray:
    """int64 ``[k]``: source ``s`` wins a tie against ``t`` in ``epoch`` when ``ranks[s] < ranks[t]``."""
    order = np.random.default_rng([seed, epoch, _TAG]).permutation(k)
    ranks = np.empty(k, dtype=np.int64)
    ranks[order] = np.arange(k)
    return ranks


class TokenClock:
    """The source of the next token-weighted draw over float64 ``[k]`` ``weights`` (module docstring)."""

    def __init__(self, weights: np.ndarray, seed: int) -> None:
        w = np.asarray(weights, dtype=np.float64)
        self.weights = w / w.sum()
        self._w = self.weights.tolist()
        self._seed = int(seed)
        self.tokens = [0] * w.shape[0]  # each source's this epoch, over every DP rank
        self._ranks: list[int] = []

    def start(self, epoch: int, tokens: Sequence[int] | None = None) -> None:
        """Begin ``epoch`` at zero tokens, or at ``tokens`` (a restored state)."""
        self.tokens = [0] * len(self._w) if tokens is None else [int(t) for t in tokens]
        self._ranks = tie_ranks(self._seed, epoch, len(self._w)).tolist()

    def pick(self) -> int:
        """The source furthest behind its share (smallest ``tokens / weight``; ties by this epoch's ranks)."""
        return min(range(len(self._w)), key=lambda s: (self.tokens[s] / self._w[s], self._ranks[s]))

    def add(self, source: int, tokens: int) -> None:
        self.tokens[source] += int(tokens)


def token_draw_order(weights: np.ndarray, ranks: np.ndarray, lengths: Sequence[np.ndarray],
                     stop: str) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """``(source_id int32 [n], index int64 [n])`` of one epoch of a token-weighted mix, vectorized.

    Source ``k``'s draw ``c`` (0-based, over passes) has the key ``(p * T_k + before_k[r]) / w_k`` with
    ``p, r = divmod(c, N_k)``; the node yields draws in ``(key, ranks[k], c)`` order (each source's keys
    never decrease, so the greedy pick is this merge). ``weights``: normalized; ``ranks``: :func:`tie_ranks`.
    """
    totals = [int(x.sum()) for x in lengths]
    run_out = sorted((totals[k] / weights[k], int(ranks[k]), k) for k in range(len(lengths)))
    end_key, end_rank, end = run_out[0] if stop == "first_exhausted" else run_out[-1]
    keys, rank_col, c_col, ids, index = [], [], [], [], []
    for k, arr in enumerate(lengths):
        n = arr.shape[0]
        before = np.concatenate([[0], np.cumsum(arr)[:-1]]).astype(np.int64)
        passes = 1 if stop == "first_exhausted" else int(end_key * weights[k] // totals[k]) + 2
        c = np.arange(passes * n, dtype=np.int64)
        key = (c // n * totals[k] + before[c % n]) / weights[k]
        keep = (key < end_key) | ((key == end_key) & ((ranks[k] < end_rank) | ((k == end) & (c < n))))
        keys.append(key[keep])
        c_col.append(c[keep])
        rank_col.append(np.full(int(keep.sum()), ranks[k], dtype=np.int64))
        ids.append(np.full(int(keep.sum()), k, dtype=np.int32))
        index.append(c[keep] % n)
    order = np.lexsort((np.concatenate(c_col), np.concatenate(rank_col), np.concatenate(keys)))
    return np.concatenate(ids)[order], np.concatenate(index)[order].astype(np.int64)
