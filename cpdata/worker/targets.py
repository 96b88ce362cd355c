"""Labels and loss masks: one meaning in every batch, whatever convention the source uses.

A document carrying ``labels`` or a mask (``loss_mask``, ``assistant_masks``, ``completion_mask``) needs
the caller's ``labels_alignment``: ``"inputs"`` (``labels[i]`` belongs to ``input_ids[i]``; Hugging Face,
TRL, torchtune) or ``"targets"`` (``labels[i]`` is the next token; Megatron-LM, NeMo); nothing is guessed
(docs/labels-and-masks.md). :func:`to_targets` turns such a document into next-token targets, on whole
documents before packing, so a piece cut from one keeps its last token's target; ``loss_mask`` (when a
mask was given) becomes ``labels != -100``. Given labels win over a mask (TRL's rule). O(tokens) numpy
per document with labels or a mask, nothing otherwise."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from cpdata.worker.keys import IGNORE_INDEX, INPUT_IDS, LABELS, LOSS_MASK

__all__ = ["ATTENTION_MASK", "CONVENTION_CHECK", "LABELS_ALIGNMENTS", "LabelsAlignment", "MASK_KEYS",
           "NO_TRAINED_TARGET", "TARGET_KEYS", "UNLABELED", "agreed_alignment", "check_labels_alignment",
           "check_unpadded", "declared_alignment", "first_target", "missing_alignment_message",
           "piece_arrays", "to_targets", "unchecked_alignment"]  # fmt: skip

LabelsAlignment = Literal["inputs", "targets"]
LABELS_ALIGNMENTS: tuple[str, ...] = ("inputs", "targets")
MASK_KEYS: tuple[str, ...] = (LOSS_MASK, "assistant_masks", "completion_mask")
"""Names accepted for a per-token loss mask; the batch calls it ``loss_mask``."""
TARGET_KEYS: tuple[str, ...] = (LABELS, *MASK_KEYS)
"""Per-token keys whose meaning depends on ``labels_alignment``."""

_CHOICES = (
    "labels_alignment='inputs' if labels[i] / mask[i] belong to input_ids[i] itself and the model shifts "
    "(Hugging Face transformers, TRL, torchtune, apply_chat_template's assistant_masks), or "
    "labels_alignment='targets' if labels[i] is already the target of input_ids[i], the next token "
    "(Megatron-LM, NeMo)"
)


def check_labels_alignment(labels_alignment: object) -> LabelsAlignment | None:
    """``labels_alignment`` if it is ``None``, ``"inputs"`` or ``"targets"``; ``ValueError`` otherwise."""
    if labels_alignment is not None and labels_alignment not in LABELS_ALIGNMENTS:
        raise ValueError(f"unknown labels_alignment {labels_alignment!r}; pass {_CHOICES}")
    return labels_alignment  # type: ignore[return-value]


def declared_alignment(owner: str, labels_alignment: object, declared: object, source: object) -> LabelsAlignment | None:
    """``labels_alignment``, or ``declared``, the one ``source`` declares for the masks it makes
    (:func:`cpdata.sources.protocol.declared_labels`); passing the other one is refused."""
    given = check_labels_alignment(labels_alignment)
    declared = check_labels_alignment(declared)
    if declared is None:
        return given
    if given is not None and given != declared:
        raise ValueError(
            f"{owner}: the source ({type(source).__name__}) declares labels_alignment={declared!r} for the labels "
            f"and masks it produces, but labels_alignment={given!r} was passed; drop the argument or pass {declared!r}"
        )
    return declared


def agreed_alignment(owner: str, parts: Sequence[tuple[str, object, bool]], fix: str) -> LabelsAlignment | None:
    """The one labels convention of several sources, ``parts`` as ``(name, declared, may_carry_labels)``: the
    one declared (None when none is). Refused, naming the parts and ``fix``: two different ones, and a part
    that may carry labels or masks but declares none beside declared ones (read under theirs, its labels could
    be one token off; a part known to carry none takes theirs)."""
    groups: dict[str, list[str]] = {}
    for name, declared, _ in parts:
        if (alignment := check_labels_alignment(declared)) is not None:
            groups.setdefault(alignment, []).append(name)
    said = "; ".join(f"{', '.join(names)} declare labels_alignment={a!r}" for a, names in groups.items())
    if len(groups) > 1:
        raise ValueError(f"{owner}: {said}; one pipeline reads every label under one convention: {fix}")
    unsaid = [name for name, declared, labelled in parts if declared is None and labelled]
    if groups and unsaid:
        raise ValueError(f"{owner}: {', '.join(unsaid)} may carry labels or loss masks but declare no "
                         f"labels_alignment, while {said}; read under that convention their labels could be one "
                         f"token off: {fix}")  # fmt: skip
    return next(iter(groups), None)  # type: ignore[return-value]


class _Unchecked(str):
    """A ``labels_alignment`` whose labels are not compared with the other convention (:func:`unchecked_alignment`)."""

    __slots__ = ()


def unchecked_alignment(labels_alignment: LabelsAlignment) -> LabelsAlignment:
    """``labels_alignment`` with the wrong-convention check of :data:`CONVENTION_CHECK` turned off.

    It equals the plain string everywhere else: for labels that really copy the input at the same position
    (declared ``"targets"``) or the next input (declared ``"inputs"``)."""
    return _Unchecked(check_labels_alignment(labels_alignment))  # type: ignore[return-value]


@dataclass(frozen=True, kw_only=True, slots=True)
class _ConventionCheck:
    documents: int = 16
    """Documents checked: those with a source index below this."""
    min_trained: int = 8
    """A document with fewer trained labels is not judged."""
    looks_like: float = 0.9
    """Share of trained labels equal to the other convention's token that refuses the document..."""
    unlike: float = 0.5
    """...when under this share equals the declared convention's token."""


CONVENTION_CHECK = _ConventionCheck()
"""How :func:`to_targets` refuses labels in the other convention, on a source's first documents.

A declared ``"targets"`` whose trained labels mostly equal the input at the same position, or a declared
``"inputs"`` whose trained labels mostly equal the next input, would train the model to copy its input
or predict two tokens ahead, silently. Labels masked with -100 are not counted."""


def _check_convention(ids: np.ndarray, labels: np.ndarray, index: int, declared: LabelsAlignment) -> None:
    if isinstance(declared, _Unchecked) or index >= CONVENTION_CHECK.documents or ids.shape[0] < 2:
        return
    trained = labels[:-1] != IGNORE_INDEX  # the last token has no next input to compare with
    n = int(trained.sum())
    if n < CONVENTION_CHECK.min_trained:
        return
    same = float((labels[:-1] == ids[:-1])[trained].mean())
    following = float((labels[:-1] == ids[1:])[trained].mean())
    other, mine = (same, following) if declared == "targets" else (following, same)
    if other < CONVENTION_CHECK.looks_like or mine >= CONVENTION_CHECK.unlike:
        return
    other_name = "inputs" if declared == "targets" else "targets"
    looks, convention, learns = _OTHER_CONVENTION[declared]
    raise ValueError(
        f"document {index}: labels_alignment={declared!r} was declared, but {other:.0%} of its {n} trained labels "
        f"equal {looks} (labels_alignment={other_name!r}: {convention}); trained as declared, the model would learn "
        f"{learns}. Pass labels_alignment={other_name!r}; if these labels are meant as they are, pass "
        f"labels_alignment=cpdata.worker.targets.unchecked_alignment({declared!r})"
    )


_OTHER_CONVENTION = {  # declared -> what its labels look like, whose convention that is, what training would learn
    "targets": ("the input at the same position", "Hugging Face / TRL labels, which the model shifts",
                "to copy its input"),
    "inputs": ("the next input", "next-token targets, Megatron-LM / NeMo", "to predict the token two ahead"),
}  # fmt: skip


def missing_alignment_message(where: str, keys: list[str]) -> str:
    """The error for a document with labels or a mask and no ``labels_alignment``."""
    return f"{where} carries {keys} but labels_alignment is not set; pass {_CHOICES}"


def _mask(value: np.ndarray, key: str, index: int) -> np.ndarray:
    if value.dtype.kind not in "biuf":
        raise TypeError(f"document {index}: {key!r} must hold 0/1 values, got dtype {value.dtype}")
    on = value != 0
    bad = np.flatnonzero(on & (value != 1))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"document {index}: {key!r} must hold 0/1 values (a loss mask), got {value[i].item()!r} at position {i}; "
            "pass per-token loss weights under another key (extras travel into the batch unchanged)"
        )
    return on


def _check_labels(labels: np.ndarray, index: int, vocab_size: int | None) -> None:
    bad = np.flatnonzero((labels < 0) & (labels != IGNORE_INDEX))
    if vocab_size is not None:
        bad = np.union1d(bad, np.flatnonzero(labels >= vocab_size))
    if bad.size:
        i = int(bad[0])
        limit = "" if vocab_size is None else f" below vocab_size={vocab_size}"
        raise ValueError(
            f"document {index}: labels[{i}]={int(labels[i])} is neither -100 (ignored) nor a token id{limit}; "
            "mark untrained positions with -100"
        )


def to_targets(
    arrays: Mapping[str, np.ndarray],
    index: int,
    labels_alignment: LabelsAlignment | None,
    vocab_size: int | None = None,
) -> dict[str, np.ndarray]:
    """One document's per-token arrays with ``labels`` as next-token targets.

    ``arrays``: validated 1-D arrays, ``input_ids`` int64 ``[n]`` and the others ``[n]``; ``index``: the
    source index (for errors); ``labels_alignment`` is required when ``arrays`` holds any of
    :data:`TARGET_KEYS`; labels ``>= vocab_size`` are refused when it is given. Returns ``arrays`` as is
    without labels or mask, else a copy with ``labels`` int64 ``[n]`` (targets), ``loss_mask`` (the given
    mask's dtype) when a mask was given, and no mask synonyms."""
    present = [k for k in TARGET_KEYS if k in arrays]
    if not present or arrays[INPUT_IDS].shape[0] == 0:  # an empty document is skipped anyway
        return arrays if isinstance(arrays, dict) else dict(arrays)
    if labels_alignment is None:
        raise ValueError(missing_alignment_message(f"document {index}", present))
    masks = [k for k in MASK_KEYS if k in arrays]
    if len(masks) > 1:
        raise ValueError(f"document {index} carries several loss masks {masks}; pass one of them")
    ids = arrays[INPUT_IDS]
    targets = np.full(ids.shape[0], IGNORE_INDEX, dtype=np.int64)
    if LABELS in arrays:
        labels = arrays[LABELS]
        _check_labels(labels, index, vocab_size)
        _check_convention(ids, labels, index, labels_alignment)
        shift = int(labels_alignment == "inputs")  # "inputs": input i's target is labels[i + 1]
        targets[: targets.shape[0] - shift] = labels[shift:]
    out = {k: v for k, v in arrays.items() if k not in TARGET_KEYS}
    out[LABELS] = targets
    if masks:
        given = np.asarray(arrays[masks[0]])
        mask = _mask(given, masks[0], index)
        if LABELS not in arrays:  # given labels win over a mask
            trained = mask[1:] if labels_alignment == "inputs" else mask[:-1]
            targets[:-1] = np.where(trained, ids[1:], IGNORE_INDEX)
        out[LOSS_MASK] = (targets != IGNORE_INDEX).astype(given.dtype)
    return out


UNLABELED = -2
""":func:`first_target` of a document without labels: packed whatever its length (targets derived in collate)."""

NO_TRAINED_TARGET = -1
""":func:`first_target` of a labelled document none of whose targets is trained (every label -100)."""


def first_target(arrays: Mapping[str, np.ndarray]) -> int:
    """Position of the first trained target of a document in target form; :data:`NO_TRAINED_TARGET`
    if none, :data:`UNLABELED` without ``labels`` (never left out)."""
    labels = arrays.get(LABELS)
    if labels is None:
        return UNLABELED
    trained = np.flatnonzero(np.asarray(labels) != IGNORE_INDEX)
    return int(trained[0]) if trained.size else NO_TRAINED_TARGET


def piece_arrays(arrays: Mapping[str, np.ndarray], start: int, length: int, continues: bool) -> Mapping[str, np.ndarray]:
    """Tokens ``start:start + length`` of a document's arrays, as a packed piece carries them.

    A piece ending before its document without continuing was truncated: its last ``labels`` entry becomes
    -100 (and ``loss_mask`` 0). The whole document is returned as is."""
    n = int(arrays[INPUT_IDS].shape[0])
    if start == 0 and length == n:
        return arrays
    out = {k: a[start : start + length] for k, a in arrays.items()}
    if not continues and start + length < n and length and LABELS in out:
        for key, untrained in ((LABELS, IGNORE_INDEX), (LOSS_MASK, 0)):
            if key in out:
                out[key] = out[key].copy()
                out[key][-1] = untrained
    return out


ATTENTION_MASK = "attention_mask"
"""A tokenizer's padding mask: all ones on an unpadded row (dropped), a 0 marks a pad."""


def check_unpadded(mask: np.ndarray, where: str) -> None:
    """Refuse an ``attention_mask`` ``[n]`` with a 0: the row ``where`` was padded before packing.

    Packing builds masks from document bounds and pads packs itself; a pre-padded row's pads would be
    trained on as text."""
    zeros = np.flatnonzero(np.asarray(mask) == 0)
    if zeros.size:
        raise ValueError(
            f"{where}: {ATTENTION_MASK!r} is 0 at {zeros.size} positions (first {int(zeros[0])}), so the row "
            f"holds padding; tokenize without padding (cpdata pads packs itself), or keep only "
            "input_ids[attention_mask == 1] (and the same positions of every per-token array)"
        )
