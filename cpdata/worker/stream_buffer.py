"""The token buffer a batch's ranks gather from: the packing window's, or the batch's pieces concatenated.

Plans that share one window buffer (:class:`~cpdata.worker.plan.PieceColumns` ``buffer``) holding the
batch's labels and extra keys in the pieces' promoted dtypes gather from it as is; any other batch
concatenates its pieces (:func:`~cpdata.worker.token_buffer.concatenate_arrays`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from cpdata.worker.keys import INPUT_IDS, LABELS, LOSS_MASK
from cpdata.worker.plan import PackPlan
from cpdata.worker.token_buffer import TokenBuffer, concatenate_arrays

__all__ = ["BatchTokens", "batch_tokens"]


@dataclass(frozen=True, slots=True)
class BatchTokens:
    """Where the ``n`` pieces of a batch (plan after plan) lie.

    Attributes:
        at: int64 ``[n]`` index of each piece's first token in ``buffer``.
        keys: the batch's extra per-token keys, sorted, ``loss_mask`` last.
        no_mask: bool ``[n]``: pieces without a loss mask of their own when some piece has one; else None.
    """

    buffer: TokenBuffer
    at: np.ndarray
    keys: list[str]
    no_mask: np.ndarray | None


def batch_tokens(plans: Sequence[PackPlan]) -> BatchTokens:
    """The :class:`BatchTokens` of ``plans``.

    Raises:
        ValueError: a piece lacks an extra array other pieces of the batch carry (``loss_mask`` excepted).
    """
    cols = [p.piece_columns for p in plans]
    sources = cols[0].sources if len(cols) == 1 else tuple(src for c in cols for src in c.sources)
    # every source one key, input_ids alone (no labels, no extras); a sum of key counts is cheaper than a max
    plain = sum(map(len, sources)) == len(sources) and all(sources)
    keys = [] if plain else _extra_keys(sources, cols)
    no_mask = None
    if LOSS_MASK in keys and not all(LOSS_MASK in src for src in sources):
        no_mask = np.fromiter((LOSS_MASK not in src for src in sources), dtype=bool, count=len(sources))
    buffer = cols[0].buffer
    if buffer is not None and all(c.buffer is buffer for c in cols[1:]) and _holds(buffer, sources, keys, plain):
        at = cols[0].at if len(cols) == 1 else np.concatenate([c.at for c in cols])
        return BatchTokens(buffer, at, keys, no_mask)
    table = _column(cols, "table")
    offsets, lengths = _column(cols, "offsets").tolist(), table[:, 2]
    arrays = [{k: a[o : o + n] for k, a in src.items()}
              for src, o, n in zip(sources, offsets, lengths.tolist(), strict=True)]  # fmt: skip
    at = lengths.cumsum()
    at += np.arange(lengths.shape[0], dtype=np.int64)
    at -= lengths
    return BatchTokens(concatenate_arrays(arrays, lengths, np.ascontiguousarray(table[:, 3])), at, keys, no_mask)


def _column(cols: list, name: str) -> np.ndarray:
    return getattr(cols[0], name) if len(cols) == 1 else np.concatenate([getattr(c, name) for c in cols])


def _holds(buffer: TokenBuffer, sources: Sequence[Mapping[str, np.ndarray]], keys: list[str], plain: bool) -> bool:
    """Whether ``buffer`` holds labels where pieces have them and ``keys`` in the pieces' promoted dtypes."""
    if plain:
        return True
    if buffer.labels is None and any(LABELS in src for src in sources):
        return False
    for key in keys:
        held = buffer.extras.get(key)
        if held is None or held.dtype != np.result_type(*[src[key].dtype for src in sources if key in src]):
            return False
    return True


def _extra_keys(sources: Sequence[Mapping[str, np.ndarray]], cols: list) -> list[str]:
    """The pieces' per-token keys beside ``input_ids`` and ``labels``, sorted, ``loss_mask`` last."""
    if sources and all(src.keys() == sources[0].keys() for src in sources):  # the usual case
        keys = sorted(set(sources[0]) - {INPUT_IDS, LABELS})
    else:
        keys = sorted(set().union(*(src.keys() for src in sources)) - {INPUT_IDS, LABELS}) if sources else []
    for key in keys:
        if key == LOSS_MASK:  # derived from the labels where missing
            continue
        missing = [i for i, src in zip(_column(cols, "table")[:, 0].tolist(), sources, strict=True) if key not in src]
        if missing:
            raise ValueError(
                f"per-token array {key!r} is missing from the pieces of documents {missing[:8]}; "
                "every document of a batch must carry the same extra arrays"
            )
    return sorted(keys, key=lambda k: k == LOSS_MASK)
