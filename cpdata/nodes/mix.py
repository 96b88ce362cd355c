"""``cpdata.mix``: several named sources drawn by weight into one stream of documents.

::

    mixed = cpdata.mix({"web": open_dataset("web.jsonl"), "chat": chat_rows},
                       {"web": 0.7, "chat": 0.3}, seed=0, stop="all_exhausted")

Draw ``j`` of epoch ``e`` picks a source with probability ``weight / sum(weights)``, a pure function of
``(seed, e, j)`` (:class:`~cpdata.nodes.mix_readers.Draws`); ``by="tokens"`` shares out tokens instead
(:mod:`cpdata.nodes.mix_readers`). Draw ``j`` goes to DP rank ``j % dp_size``; every CP rank of a DP group
computes the same draws (unlike torchdata's ``MultiNodeWeightedSampler``, seeded by the global rank), and a
rank never reads another rank's documents from a sequence. Stop policies (:data:`STOP_POLICIES`), counters,
errors naming a document by its source and the state: docs/packing-and-mixing.md.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from cpdata.errors import check_choice, check_int, naming_parts
from cpdata.nodes.epochs import EpochNode
from cpdata.nodes.mix_readers import (
    BLOCK,
    BY,
    Draws,
    MixSource,
    TokenClock,
    check_weights,
    document_tokens,
    mix_alignment,
)
from cpdata.nodes.mixed import MixedDataset
from cpdata.nodes.state_version import VersionedState
from cpdata.sources.fingerprint import check_source_unchanged, source_fingerprint
from cpdata.sources.protocol import stated_lengths

__all__ = ["STOP_POLICIES", "Mix", "check_weights", "mix"]

STOP_POLICIES: tuple[str, ...] = ("first_exhausted", "all_exhausted", "never")


class Mix(VersionedState, EpochNode[dict]):
    """Documents of several sources, drawn by weight (the module docstring); :func:`cpdata.mix` builds it.

    Args:
        sources: ``{name: source}``, each anything ``build_loader`` takes; a sequence must not be empty.
        weights: ``{name: weight}`` with exactly the keys of ``sources``; finite, > 0, relative.
        stop: one of :data:`STOP_POLICIES`.
        by: what the weights share out: ``"documents"`` or ``"tokens"``.

    The mix declares a ``labels_alignment`` only when every source declares the same one.
    """

    VERSION = 1
    EPOCH_KEY = "epoch"
    DRAWS_KEY = "draws"
    DONE_KEY = "done"
    EXHAUSTED_KEY = "exhausted"
    READERS_KEY = "readers"
    COUNTS_KEY = "counts"
    TOKENS_KEY = "tokens_drawn"

    def __init__(self, sources: Mapping[str, Any], weights: Mapping[str, Any], *, seed: int = 0,
                 stop: str = "first_exhausted", by: str = "documents") -> None:  # fmt: skip
        super().__init__()
        self.weights = check_weights(sources, weights)
        check_choice("stop policy", stop, STOP_POLICIES)
        if by not in BY:
            raise ValueError(f"by must be one of {list(BY)} (what the weights share out), got {by!r}")
        self.seed, self.stop, self.by = check_int("seed", seed, min=0), stop, by
        self.names = list(self.weights)  # sorted: the draws do not depend on the dicts' order
        self.readers = {name: MixSource(name, sources[name]) for name in self.names}
        self.labels_alignment = mix_alignment(self.readers)
        self.draws = Draws(np.array([self.weights[n] for n in self.names]), self.seed)
        self.clock = TokenClock(np.array([self.weights[n] for n in self.names]), self.seed) if by == "tokens" else None
        """By tokens: the tokens each source gave this epoch and the pick (None by documents)."""
        self._lengths = {n: stated_lengths(r.source) if r.kind == "sequence" else None for n, r in self.readers.items()}
        for name, lengths in self._lengths.items():
            if self.clock is not None and lengths is not None and not int(lengths.sum()):
                raise ValueError(f"mix source {name!r} holds no tokens (every document is empty); by='tokens' "
                                 "cannot give it a share of tokens: leave it out of the mix")  # fmt: skip
        self._recent = np.full((BLOCK if by == "tokens" else 0, 3), -1, dtype=np.int64)  # (source, index, pass)
        if by == "tokens":  # draws follow the tokens read, not (seed, epoch, draw): batches name no source live
            self.document_sources = None  # type: ignore[assignment]
        self._pass_tokens: dict[str, int] = {}
        self._drawn, self._done = 0, False
        self._exhausted: set[str] = set()
        self._counts = {name: [0, 0] for name in self.names}
        self._fingerprints: dict[str, str | None] | None = None
        self.last_source = -1  # index into names of the last draw's source

    @property
    def config(self) -> dict[str, Any]:
        config = {"names": list(self.names), "weights": [self.weights[n] for n in self.names], "seed": self.seed,
                  "stop": self.stop}  # fmt: skip
        return config if self.by == "documents" else {**config, "by": self.by}  # a documents mix's states as before

    @property
    def counts(self) -> dict[str, dict[str, int]]:
        """``{name: {"documents": n, "tokens": t}}`` drawn this epoch by this DP rank (a fresh dict)."""
        return {n: {"documents": d, "tokens": t} for n, (d, t) in self._counts.items()}

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        state = initial_state
        if state is None:
            self.epoch_clock.start()  # Documents keeps the mix on its epoch (set_epoch)
            state = {self.DRAWS_KEY: 0, self.DONE_KEY: False, self.EXHAUSTED_KEY: [],
                     self.COUNTS_KEY: dict.fromkeys(self.names, (0, 0)), self.READERS_KEY: dict.fromkeys(self.names)}
        else:
            self.check_saved(state, self.config)
            self.epoch_clock.restore(state[self.EPOCH_KEY])
        self._drawn, self._done = int(state[self.DRAWS_KEY]), bool(state[self.DONE_KEY])
        self._exhausted = set(state[self.EXHAUSTED_KEY])
        self._counts = {n: list(map(int, state[self.COUNTS_KEY][n])) for n in self.names}
        for name, reader in self.readers.items():
            reader.restart(state[self.READERS_KEY][name])
        if self.clock is not None:
            tokens = None if initial_state is None else [state[self.TOKENS_KEY][n] for n in self.names]
            self.clock.start(self.epoch, tokens)
        self._recent[:] = -1
        self._pass_tokens = {}

    def _advance(self, read: bool) -> Any:
        if self._done:
            raise StopIteration
        clock = self.clock
        k = self.draws(self.epoch, self._drawn) if clock is None else clock.pick()
        name, self.last_source = self.names[k], k
        self._drawn += 1
        reader = self.readers[name]
        lengths = self._lengths[name]
        fetch = read or (clock is not None and lengths is None)  # a length no index states is counted
        try:
            index, item = reader.take(fetch)
        except StopIteration:
            self._exhausted.add(name)
            every = len(self._exhausted) == len(self.names)
            if self.stop == "first_exhausted" or (self.stop == "all_exhausted" and every):
                self._done = True
                raise
            if clock is not None:  # by tokens, a source of empty documents would be drawn forever
                if self._pass_tokens.get(name) == clock.tokens[k]:
                    raise ValueError(f"mix source {name!r} gave no tokens on pass {reader.passes}; by='tokens' "
                                     "would draw it forever: leave a source of empty documents out of the "
                                     "mix") from None  # fmt: skip
                self._pass_tokens[name] = clock.tokens[k]
            reader.new_pass()
            try:
                index, item = reader.take(fetch)
            except StopIteration:
                raise ValueError(
                    f"mix source {name!r} gave no document on pass {reader.passes}; with stop={self.stop!r} a "
                    "source is read again when it runs out, so it must not be empty"
                ) from None
        if clock is not None:
            clock.tokens[k] += int(lengths[index]) if lengths is not None else document_tokens(item)
            self._recent[(self._drawn - 1) % BLOCK] = (k, index, reader.passes)
        if read:
            counts = self._counts[name]
            counts[0] += 1
            counts[1] += document_tokens(item)
        return item

    def next(self) -> dict:
        return self._advance(read=True)

    def skip_unread(self) -> None:
        """Draw the next document without reading it when its source is indexable (another DP rank's)."""
        if not self.epoch_clock.started:
            self.reset()
        self._advance(read=False)

    def get_state(self) -> dict[str, Any]:
        return {
            **self.state_header(self.config),
            self.EPOCH_KEY: self.epoch,
            self.DRAWS_KEY: self._drawn,
            self.DONE_KEY: self._done,
            self.EXHAUSTED_KEY: sorted(self._exhausted),
            self.COUNTS_KEY: {n: list(c) for n, c in self._counts.items()},
            self.READERS_KEY: {name: reader.state() for name, reader in self.readers.items()},
            **({} if self.clock is None else {self.TOKENS_KEY: dict(zip(self.names, self.clock.tokens, strict=True))}),
        }

    def describe_document(self, j: int) -> str:
        """Where draw ``j`` of the current epoch came from: ``"document 3 of mix source 'b' (source 1 of
        ['a', 'b'], draw 7 of epoch 0)"`` (:mod:`cpdata.nodes.source_kinds`); by tokens, the last 4096 draws."""
        j = int(j)
        if self.clock is not None:
            k, index, passes = self._recent[j % BLOCK].tolist() if 0 <= j < self._drawn else (-1, -1, -1)
            if k < 0 or j < self._drawn - BLOCK:
                return (f"a document of the mix {self.names} (draw {j} of epoch {self.epoch}, by tokens: its source "
                        f"is known for the last {BLOCK} draws since the last start or restore)")  # fmt: skip
        else:
            k, c = (int(x[0]) for x in self.draws.locate_many(self.epoch, np.array([j])))
            reader = self.readers[self.names[k]]
            if reader.size is None and reader.passes:  # a stream read again since a resume from an older state
                return (f"a document of mix source {self.names[k]!r} (source {k} of {self.names}, draw {j} of epoch "
                        f"{self.epoch}; its index in the source is unknown)")  # fmt: skip
            passes, index = divmod(c, reader.size) if reader.size else (0, c)
        again = f", pass {passes} over it" if passes else ""
        return (f"document {index} of mix source {self.names[k]!r} (source {k} of {self.names}, draw {j} of epoch "
                f"{self.epoch}{again})")  # fmt: skip

    def document_sources(self, js: np.ndarray) -> tuple[list[str], np.ndarray]:
        """``(names, index int64 [n])`` of draws ``js`` of the current epoch: each one's source and its index
        there (-1 where a stream's index is unknown): the batches' ``info["doc_source"]`` / ``info["doc_index"]``.
        None by tokens (each draw depends on the tokens read before it)."""
        k, c = self.draws.locate_many(self.epoch, js)
        size = np.asarray([self.readers[n].size or 0 for n in self.names], dtype=np.int64)[k]
        index = np.where(size > 0, c % np.maximum(size, 1), c)  # an index per pass where the size is known
        unknown = np.array([self.readers[n].size is None and self.readers[n].passes > 0 for n in self.names])
        index[unknown[k]] = -1
        return [self.names[i] for i in k.tolist()], index

    def _source_fingerprints(self) -> dict[str, str | None]:
        if self._fingerprints is None:
            self._fingerprints = {n: source_fingerprint(r.source) for n, r in self.readers.items()}
        return self._fingerprints

    def fingerprint(self) -> str:
        """The configuration and every source's fingerprint (a source without one: its kind and length)."""
        parts = [fp if fp is not None else f"{r.kind}:{len(r.source) if r.kind == 'sequence' else '?'}"
                 for fp, r in zip(self._source_fingerprints().values(), self.readers.values(), strict=True)]
        digest = hashlib.blake2b(json.dumps([self.config, parts]).encode(), digest_size=16).hexdigest()
        return f"mix:{digest}"

    def listed(self, epochs: int = 1) -> MixedDataset:
        """Epochs ``0 .. epochs - 1`` of this mix's draws as an indexed dataset with lengths (:class:`MixedDataset`)."""
        return MixedDataset(self, epochs=epochs)

    def check_unchanged(self) -> None:
        """Raise ``ValueError`` naming the source if any source changed since the mix first read it."""
        named = [(f"mix source {n!r}", (self.readers[n].source, fp)) for n, fp in self._source_fingerprints().items()]
        naming_parts(named, lambda source_fp: check_source_unchanged(*source_fp))


mix = Mix
"""``cpdata.mix(sources, weights, *, seed=0, stop="first_exhausted", by="documents")``: a :class:`Mix`."""
