"""A user's own corpus for the benchmarks: its documents' lengths in tokens, read from a file.

``cpdata bench --sections world --lengths PATH`` runs the world section on it, cpdata's deals beside
Megatron-core's scheduler, instead of the bench's distributions: what the busiest rank of a world micro-batch
costs on the documents a user will train on, before training.

The file holds one length per document, in tokens (after the chat template and the tokenizer, before
packing):

- ``.npy``: a one-dimensional integer array (``np.save(path, lengths)``);
- anything else: text, integers separated by white space or commas; ``#`` starts a comment.

Every length must be a positive integer: a file with a zero, a negative, a fraction or a word is refused,
naming the first such entry and how many there are, rather than any document being dropped. The bench draws a
stream from the corpus epoch by epoch, each epoch one permutation of its documents drawn with the bench's
``--seed``, as a shuffling loader reads a dataset: a corpus smaller than the stream is read more than once.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

__all__ = ["Corpus", "read_corpus"]


@dataclasses.dataclass(frozen=True, eq=False)
class Corpus:
    """A corpus's document lengths (int64 ``[D]``, every one positive), its name (the file's stem) and the path
    it was read from."""

    name: str
    lengths: np.ndarray
    source: str

    def draw(self, n: int, seed: int) -> np.ndarray:
        """int64 ``[n]``: the documents' lengths, epoch after epoch, each epoch the corpus in the order of a
        permutation drawn from ``seed`` (the same ``(n, seed)``, the same stream)."""
        rng = np.random.default_rng(seed)
        epochs = -(-n // self.lengths.shape[0])
        return np.concatenate([self.lengths[rng.permutation(self.lengths.shape[0])] for _ in range(epochs)])[:n]

    def describe(self) -> dict:
        """What a results file records of the corpus: its name, path, documents and tokens."""
        return {"name": self.name, "source": self.source, "documents": int(self.lengths.shape[0]),
                "tokens": int(self.lengths.sum())}  # fmt: skip


def read_corpus(path: str | Path) -> Corpus:
    """The corpus in ``path`` (the module docstring's formats). ``ValueError`` naming the file and the entry
    where the file cannot be read as lengths, holds none, or holds one that is not a positive integer;
    ``OSError`` where it cannot be opened."""
    path = Path(path)
    if path.suffix == ".npy":
        values = np.load(path, allow_pickle=False)
        if values.ndim != 1 or not np.issubdtype(values.dtype, np.integer):
            raise ValueError(f"{path}: an .npy corpus is a one-dimensional integer array of document lengths, got "
                             f"{values.dtype} of shape {values.shape}; save it as np.save(path, "
                             "np.asarray(lengths, dtype=np.int64))")  # fmt: skip
        values, lines = values.astype(np.int64), None
    else:
        values, lines = _read_text(path)
    if not values.shape[0]:
        raise ValueError(f"{path}: no document lengths in the file; write one length in tokens per document")
    bad = np.flatnonzero(values <= 0)
    if bad.size:
        at = f"entry {bad[0]}" if lines is None else f"line {lines[bad[0]]}"
        raise ValueError(f"{path}: {bad.size} document length(s) not positive, the first {int(values[bad[0]])} at "
                         f"{at}; every document holds at least one token: remove the empty ones before "
                         "measuring")  # fmt: skip
    return Corpus(name=path.stem, lengths=values, source=str(path))


def _read_text(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """The integers of a text corpus, and the line each was on (int64 ``[D]`` each)."""
    values, lines = [], []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        for token in line.split("#", 1)[0].replace(",", " ").split():
            try:
                values.append(int(token))
            except ValueError:
                raise ValueError(f"{path}: {token!r} on line {number} is not a whole number of tokens; write one "
                                 "integer length per document") from None  # fmt: skip
            lines.append(number)
    try:
        return np.asarray(values, dtype=np.int64), np.asarray(lines, dtype=np.int64)
    except OverflowError:
        big = next(i for i, v in enumerate(values) if not -(2**63) <= v < 2**63)
        raise ValueError(f"{path}: {values[big]} on line {lines[big]} is past an int64 of tokens") from None
