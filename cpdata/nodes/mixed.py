"""A mix's draw order written out as an indexable dataset: for ``precompute``, ``PrecomputedPacks`` and ``schedule=``.

When every source of a :class:`~cpdata.nodes.mix.Mix` is indexable with known lengths,
:class:`MixedDataset` lists the documents the mix draws, in draw order, epoch after epoch (item ``j`` is
document ``index[j]`` of source ``names[source_id[j]]``): the mix's own draws and stop rule, vectorized
(:func:`draw_order`, :func:`~cpdata.nodes.mix_readers.token_draw_order`; tested equal to the node's
stream), so a plan over it packs what the streaming loader packs. Cost: ~1 us and 12 bytes per document.
A stream source or ``stop="never"`` is refused, naming the fix. Epoch policy: docs/packing-and-mixing.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from cpdata.errors import check_int, naming_parts
from cpdata.nodes.mix_readers import tie_ranks, token_draw_order
from cpdata.sources.base import TokenizedDataset
from cpdata.sources.protocol import Carried, Checked, carried_targets, stated_lengths

if TYPE_CHECKING:
    from cpdata.nodes.mix import Mix

__all__ = ["MixedDataset", "draw_order"]

_WHY = "precompute and a SchedulePlan plan every document's length before training"


def _source_lengths(name: str, source: Any) -> np.ndarray:
    lengths = stated_lengths(source)
    if lengths is not None:
        return lengths
    raise ValueError(
        f"mix source {name!r} ({type(source).__name__}) does not state its documents' lengths, which {_WHY}; open "
        "it with cpdata.open_dataset(path) (or pass a datasets.Dataset or a list), or stream the mix (plan=StreamPlan())"
    )


def draw_order(mixed: Mix, sizes: np.ndarray, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """``(source_id int32 [n], index int64 [n])`` of the documents ``mixed`` yields in ``epoch`` over sources of
    ``sizes`` documents: the node's draw loop, vectorized per block of draws (source ``k``'s
    ``(sizes[k] + 1)``-th draw is where it runs out)."""
    k = sizes.shape[0]
    draws = mixed.draws
    counts = np.zeros(k, dtype=np.int64)
    pending = np.ones(k, dtype=bool)  # not run out yet
    ids_parts, c_parts = [], []
    b = 0
    while True:
        choices, ranks = draws.block_ranks(epoch, b)
        c = counts[choices] + ranks + 1  # 1-based: the draw's count in its source, over blocks
        out = np.flatnonzero(c == sizes[choices] + 1)  # draws where a source runs out
        end = choices.shape[0]  # the block's draws taken: all, unless the stop rule ends the epoch in it
        if mixed.stop == "first_exhausted" and out.size:
            end = int(out[0])
        elif mixed.stop == "all_exhausted":
            for j in out.tolist():
                pending[choices[j]] = False
                if not pending.any():
                    end = j
                    break
        ids_parts.append(choices[:end])
        c_parts.append(c[:end])
        if end < choices.shape[0]:
            break
        counts += np.bincount(choices, minlength=k)
        b += 1
    ids = np.concatenate(ids_parts).astype(np.int32)
    index = (np.concatenate(c_parts) - 1) % sizes[ids]
    return ids, index.astype(np.int64)


class MixedDataset(TokenizedDataset):
    """Epochs ``epoch .. epoch + epochs - 1`` of a mix, in draw order, as a
    :class:`~cpdata.sources.base.TokenizedDataset` (module docstring).

    Attributes:
        source_id: int32 ``[n]`` index into ``mix.names`` of each document's source.
        index: int64 ``[n]`` the document's index in its source.
        epoch_starts: int64 ``[epochs + 1]``: epoch ``epoch + e`` is items ``epoch_starts[e]:epoch_starts[e + 1]``.
        counts: ``{name: {"documents", "tokens"}}`` drawn from each source (``epoch_counts``: per epoch).
    """

    kind = "mix"

    def __init__(self, mixed: Mix, epoch: int = 0, epochs: int = 1) -> None:
        epoch, epochs = check_int("epoch", epoch, min=0), check_int("epochs", epochs, min=1)
        if mixed.stop == "never":
            raise ValueError(
                f"a mix with stop='never' is endless, but {_WHY}; pass stop='first_exhausted' or 'all_exhausted'"
            )
        streams = [f"{n!r} ({r.kind})" for n, r in mixed.readers.items() if r.kind != "sequence"]
        if streams:
            raise ValueError(
                f"mix sources {', '.join(streams)} cannot be addressed by index, which {_WHY}; open them with "
                "cpdata.open_dataset(path) or a datasets.Dataset, or stream the mix (plan=StreamPlan(), no precompute)"
            )
        super().__init__(Path(f"mix({','.join(mixed.names)})"))
        self.mix, self.epoch, self.epochs = mixed, epoch, epochs
        self.labels_alignment = mixed.labels_alignment
        self._sources = [mixed.readers[n].source for n in mixed.names]
        per_source = [_source_lengths(n, s) for n, s in zip(mixed.names, self._sources, strict=True)]
        sizes = np.array([len(s) for s in self._sources], dtype=np.int64)
        orders = [draw_order(mixed, sizes, e) if mixed.clock is None else
                  token_draw_order(mixed.clock.weights, tie_ranks(mixed.seed, e, len(sizes)), per_source, mixed.stop)
                  for e in range(self.epoch, self.epoch + self.epochs)]  # fmt: skip
        self.source_id = np.concatenate([ids for ids, _ in orders])
        self.index = np.concatenate([index for _, index in orders])
        self.epoch_starts = np.concatenate([[0], np.cumsum([ids.shape[0] for ids, _ in orders])]).astype(np.int64)
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])  # of each source's lengths, concatenated
        self._lengths = np.concatenate(per_source)[starts[self.source_id] + self.index]
        self.epoch_counts = [self._counts(slice(int(lo), int(hi)))
                             for lo, hi in zip(self.epoch_starts[:-1], self.epoch_starts[1:], strict=True)]  # fmt: skip
        self.counts = self._counts(slice(None))
        self.serves_tokens = all(s.serves_tokens for s in self._sources if isinstance(s, Carried))
        self.per_token_keys = frozenset().union(*(s.per_token_keys if isinstance(s, Carried) else
                                                  carried_targets(s) or () for s in self._sources))  # fmt: skip

    def _counts(self, rows: slice) -> dict[str, dict[str, int]]:
        ids, lengths = self.source_id[rows], self._lengths[rows]
        return {n: {"documents": int((ids == k).sum()), "tokens": int(lengths[ids == k].sum())}
                for k, n in enumerate(self.mix.names)}  # fmt: skip

    @property
    def lengths(self) -> np.ndarray:
        return self._lengths

    def _read(self, i: int) -> Any:
        return self._sources[int(self.source_id[i])][int(self.index[i])]

    def document_sources(self, items: np.ndarray) -> tuple[list[str], np.ndarray]:
        """``(names, index int64 [n])``: the source and the index there of each of ``items``."""
        items = np.asarray(items, dtype=np.int64)
        names = self.mix.names
        return [names[k] for k in self.source_id[items].tolist()], self.index[items]

    def describe_document(self, i: int) -> str | None:
        """Where item ``i`` came from: ``"document 3 of mix source 'b' (source 1 of ['a', 'b'], draw 7 of epoch 0)"``."""
        if not 0 <= i < self.index.shape[0]:
            return None
        k, e = int(self.source_id[i]), int(np.searchsorted(self.epoch_starts, i, side="right")) - 1
        return (f"document {int(self.index[i])} of mix source {self.mix.names[k]!r} (source {k} of "
                f"{self.mix.names}, draw {i - int(self.epoch_starts[e])} of epoch {self.epoch + e})")  # fmt: skip

    def check_token_ids(self, vocab_size: int | None = None) -> None:
        """Each source checks its own ids (lists are checked when read); an error names the source."""
        naming_parts(self._checked(), lambda source: source.check_token_ids(vocab_size))

    def verify_content(self) -> None:
        """Every source checks its stored bytes; errors name the source."""
        naming_parts(self._checked(), lambda source: source.verify_content())

    def _checked(self) -> list[tuple[str, Checked]]:
        """``(how errors name it, source)`` of every source that checks its own content."""
        names = self.mix.names
        return [(f"mix source {n!r} (source {k} of {names})", s)
                for k, (n, s) in enumerate(zip(names, self._sources, strict=True)) if isinstance(s, Checked)]  # fmt: skip

    def fingerprint(self) -> str:
        return f"{self.mix.fingerprint()}:{self.epoch}" + ("" if self.epochs == 1 else f"+{self.epochs}")

    def check_unchanged(self) -> None:
        self.mix.check_unchanged()

