"""Validating source items into :class:`~cpdata.worker.plan.Document`: one item, or a window of items at once.

:func:`to_window` checks a window as :func:`to_document` checks each item, the id values of all items in
one pass (one ``concatenate``, kept as the window's token buffer, and one ``max`` read as unsigned, so a
negative id is above any vocabulary). When anything is wrong the window is checked again item by item, so
the error raised is :func:`to_document`'s for the first bad item.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import repeat
from operator import attrgetter
from typing import Any

import numpy as np
import torch

from cpdata.nodes.window import DocumentWindow
from cpdata.worker.keys import INPUT_IDS, LABELS
from cpdata.worker.plan import Document
from cpdata.worker.targets import (
    ATTENTION_MASK,
    TARGET_KEYS,
    UNLABELED,
    LabelsAlignment,
    check_unpadded,
    first_target,
    to_targets,
)
from cpdata.worker.token_buffer import BufferPool, concatenate_spaced

__all__ = ["document_ids", "plain_ids", "to_document", "to_window"]

_INTEGER_KEYS = (INPUT_IDS, LABELS)
_INT64_MAX = np.iinfo(np.int64).max
_INT64 = np.dtype(np.int64)
_NDIM, _DTYPE = attrgetter("ndim"), attrgetter("dtype")


def _to_array(value: Any) -> np.ndarray | None:
    """A numeric numpy array for per-token data, or None for metadata."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        arr = value
    elif isinstance(value, (list, tuple)):
        try:
            arr = np.asarray(value)
        except ValueError:  # ragged nested lists: not per-token data
            return None
        if arr.size == 0:
            arr = arr.astype(np.int64)
    else:
        return None
    if arr.ndim == 0 or arr.dtype.kind not in "biuf":
        return None
    return arr


def _integer_ids(arr: np.ndarray, key: str, index: int) -> np.ndarray:
    if arr.size and (arr.dtype.kind not in "iu"):
        raise TypeError(
            f"document {index}: {key!r} must hold integers, got dtype {arr.dtype} "
            f"(first values {arr.reshape(-1)[:4].tolist()}); convert token ids to an integer type"
        )
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > _INT64_MAX:
        raise ValueError(
            f"document {index}: {key!r} value {int(arr.max())} at position {int(arr.argmax())} does not fit "
            "an int64 token id; check the tokenizer or vocab_size"
        )
    return arr.astype(np.int64, copy=False)


def document_ids(item: Any, index: int) -> np.ndarray:
    """The item's ``input_ids`` as int64 ``[n]``, structure checked (values are not: :func:`_check_ids`)."""
    if type(item) is dict:  # the usual item: a dict holding a 1-D int64 array, returned as is
        ids = item.get(INPUT_IDS)
        if type(ids) is np.ndarray and ids.dtype == _INT64 and ids.ndim == 1:
            return ids
    if not isinstance(item, Mapping):
        raise TypeError(
            f"document {index}: expected a dict with {INPUT_IDS!r}, got {type(item).__name__}; "
            "map your source to dicts such as {'input_ids': [...]} first"
        )
    if INPUT_IDS not in item:
        raise ValueError(f"document {index} has no {INPUT_IDS!r}; its keys are {sorted(map(str, item))}")
    ids = _to_array(item[INPUT_IDS])
    if ids is None:
        raise TypeError(
            f"document {index}: {INPUT_IDS!r} must be a 1-D list, numpy array or tensor of integers, "
            f"got {type(item[INPUT_IDS]).__name__}"
        )
    if ids.ndim != 1:
        raise ValueError(
            f"document {index}: {INPUT_IDS!r} must be 1-D, got shape {tuple(ids.shape)}; pass one document per "
            "item (split a [batch, seq] array into one dict per row)"
        )
    return _integer_ids(ids, INPUT_IDS, index)


def plain_ids(items: Sequence[Any]) -> tuple[list[np.ndarray], np.ndarray] | None:
    """Every item's ``input_ids`` and their lengths (int64 ``[n]``) when each item is a dict holding a 1-D
    int64 array there (the usual case), else None; each condition is one C-level pass over the window."""
    n = len(items)
    if list(map(type, items)).count(dict) != n:
        return None
    ids = list(map(dict.get, items, repeat(INPUT_IDS, n)))
    if (list(map(type, ids)).count(np.ndarray) != n or list(map(_NDIM, ids)).count(1) != n
            or list(map(_DTYPE, ids)).count(_INT64) != n):  # fmt: skip
        return None
    return ids, np.fromiter(map(len, ids), dtype=np.int64, count=n)


def _check_ids(ids: np.ndarray, index: int, vocab_size: int | None) -> None:
    """Raise ``ValueError`` for a negative id or one ``>= vocab_size`` in int64 ``[n]`` ``ids``."""
    if not ids.size:
        return
    if ids.min() < 0:
        low = int(ids.argmin())
        raise ValueError(
            f"document {index}: {INPUT_IDS!r} must be >= 0, got {int(ids[low])} at position {low}; token ids "
            "index the vocabulary: do not pre-pad with negative ids (cpdata pads with padding_token_id) and "
            "put ignored targets (-100) in 'labels'"
        )
    if vocab_size is not None and ids.max() >= vocab_size:
        high = int(ids.argmax())
        raise ValueError(
            f"document {index}: {INPUT_IDS}[{high}]={int(ids[high])} is >= vocab_size={vocab_size}; "
            "check the tokenizer or vocab_size"
        )


def _arrays(item: Mapping[str, Any], ids: np.ndarray, index: int) -> dict[str, np.ndarray]:
    """``ids`` and the item's other per-token arrays (``[n]`` each); metadata values are left out, and so is
    an all-ones ``attention_mask`` (one with a 0 is refused)."""
    arrays = {INPUT_IDS: ids}
    for key, value in item.items():
        if key == INPUT_IDS:
            continue
        arr = _to_array(value)
        if arr is None:
            if key in TARGET_KEYS:
                shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
                raise TypeError(
                    f"document {index}: {key!r} must be a flat list, numpy array or tensor of "
                    f"{'integers' if key == LABELS else '0/1 values'} with one entry per token, got "
                    f"{type(value).__name__} {shown}; drop the key to train on every next token"
                )
            continue
        if arr.ndim != 1:
            raise ValueError(
                f"document {index}: {key!r} must be 1-D with one entry per token, got shape {tuple(arr.shape)}; "
                "split per-token vectors into separate 1-D keys"
            )
        if arr.shape[0] != ids.shape[0]:
            raise ValueError(
                f"document {index}: {key!r} has {arr.shape[0]} entries but {INPUT_IDS!r} has {ids.shape[0]}; "
                "per-token arrays must have one entry per token"
            )
        if key == ATTENTION_MASK:
            check_unpadded(arr, f"document {index}")
            continue
        arrays[key] = _integer_ids(arr, key, index) if key in _INTEGER_KEYS else arr
    return arrays


def to_document(
    item: Any, index: int, vocab_size: int | None = None, labels_alignment: LabelsAlignment | None = None
) -> Document:
    """Validate one source item into a :class:`~cpdata.worker.plan.Document`, ``labels`` and masks turned
    into next-token targets under ``labels_alignment`` (:func:`cpdata.worker.targets.to_targets`).

    Raises:
        TypeError: not a dict, ids not integers, ``labels`` or a mask not a flat numeric list.
        ValueError: missing or non-1-D ``input_ids``, ids negative or ``>= vocab_size``, a per-token array
            of another length, an ``attention_mask`` with a 0, labels or a mask without ``labels_alignment``.
    """
    ids = document_ids(item, index)
    _check_ids(ids, index, vocab_size)
    arrays = _arrays(item, ids, index)
    return Document(index=index, arrays=to_targets(arrays, index, labels_alignment, vocab_size))


def to_window(
    items: Sequence[Any],
    indices: Sequence[int],
    ids: Sequence[np.ndarray],
    vocab_size: int | None = None,
    labels_alignment: LabelsAlignment | None = None,
    scratch: BufferPool | None = None,
    room: int = 0,
    lengths: np.ndarray | None = None,
) -> DocumentWindow:
    """:func:`to_document` of every item of a window, the id values checked in one pass, as columns.

    ``ids``: :func:`document_ids` of every item (``lengths``: theirs, if counted); they are concatenated
    into an array of ``scratch`` (the window's ``ids``, ``room`` elements to spare). Items holding
    ``input_ids`` alone cost one dict of cpdata's own each. Raises what :func:`to_document` raises for the
    first bad item.
    """
    try:
        n = len(ids)
        if lengths is None:
            lengths = np.fromiter(map(len, ids), dtype=np.int64, count=n)
        total = int(lengths.sum()) + n  # each document's ids and one element after it (0 here)
        size = total + room + 2
        buffer = scratch.take(size) if scratch is not None else np.empty(size, dtype=np.int64)
        flat = buffer[:total]
        concatenate_spaced(ids, flat)
        # one pass for both bounds: a negative id read as uint64 is above any vocabulary
        if flat.size and int(flat.view(np.uint64).max()) > (_INT64_MAX if vocab_size is None else int(vocab_size) - 1):
            raise ValueError("an id is out of range")  # replaced below by the first bad item's own error
        index_array = np.fromiter(indices, dtype=np.int64, count=n)
        if max(map(len, items), default=1) == 1:  # input_ids alone: nothing else to check or derive
            return DocumentWindow(index_array, lengths, np.full(n, UNLABELED, dtype=np.int64),
                                  [{INPUT_IDS: i} for i in ids], buffer, plain=True)  # fmt: skip
        arrays = [_arrays(item, i_ids, index) for item, i_ids, index in zip(items, ids, indices, strict=True)]
        arrays = [a if len(a) == 1 else to_targets(a, index, labels_alignment, vocab_size)
                  for a, index in zip(arrays, indices, strict=True)]  # fmt: skip
        firsts = np.fromiter(map(first_target, arrays), dtype=np.int64, count=n)
        return DocumentWindow(index_array, lengths, firsts, arrays, buffer)
    except Exception:
        for item, index in zip(items, indices, strict=True):
            to_document(item, index, vocab_size, labels_alignment)
        raise
