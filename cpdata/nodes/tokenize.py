"""``Tokenize``: text and chat rows to token documents, on the dataloader workers.

::

    build_loader(Tokenize(chats, tok, assistant_only=True), capacity=..., ...)

Each row becomes one document through :class:`cpdata.sources.tokenizer.RowTokenizer`. With
``assistant_only=True`` documents carry ``assistant_masks`` aligned with ``input_ids`` (as
``apply_chat_template`` returns them), so the node declares ``labels_alignment = "inputs"``. Sources and
resume as for ``Documents``; the state holds the counters (``stats``) too. Nothing is buffered.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from cpdata.nodes.source_kinds import SourceReader
from cpdata.nodes.state_version import VersionedState
from cpdata.sources.tokenizer import ASSISTANT_MASKS, RowTokenizer, TokenizeStats

__all__ = ["Tokenize"]


class Tokenize(VersionedState, BaseNode[dict[str, np.ndarray]]):
    """Emit ``{"input_ids": int64 [n], "assistant_masks"?: int8 [n]}`` per row (``{"text": str}`` or
    ``{"messages": [...]}``) of ``source``.

    ``tokenizer``: a path, a ``transformers``/``tokenizers`` tokenizer, a callable ``text -> ids``, or a
    ready :class:`~cpdata.sources.tokenizer.RowTokenizer` (``options`` are its keywords otherwise).
    State: ``{"version", "config", "position", "stats", "source"?}``; one saved under other options is refused.
    """

    VERSION = 1
    POSITION_KEY = "position"
    STATS_KEY = "stats"

    def __init__(self, source: Sequence[Any] | Iterable[Any] | BaseNode, tokenizer: Any, **options: Any) -> None:
        super().__init__()
        if isinstance(tokenizer, RowTokenizer):
            if options:
                raise TypeError(f"pass options to the RowTokenizer or to Tokenize, not both (got {sorted(options)})")
            self.tokenizer = tokenizer
        else:
            self.tokenizer = RowTokenizer(tokenizer, **options)
        self.reader = SourceReader(source, "of the rows", "rows")
        self.labels_alignment: str | None = "inputs" if self.tokenizer.assistant_only else None
        self.serves_tokens = True
        self.per_token_keys = frozenset({ASSISTANT_MASKS} if self.tokenizer.assistant_only else ())
        """What each document carries besides ``input_ids``, known before tokenizing (the
        :class:`~cpdata.sources.protocol.Carried` protocol): a mix beside a declared source knows plain text
        carries no labels."""
        self.source = source
        self._position = 0

    @property
    def stats(self) -> TokenizeStats:
        """Counters since the start of the epoch (restored with the state)."""
        return self.tokenizer.stats

    def _config(self) -> dict[str, Any]:
        t = self.tokenizer
        return {
            "append_eos": t.append_eos,
            "assistant_only": t.assistant_only,
            "eos_token_id": None if t.eos_token_id is None else int(t.eos_token_id),
            "max_length": t.max_length,
            "source_length": len(self.source) if self.reader.kind == "sequence" else None,
        }

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._position, nested = 0, None
        self.tokenizer.stats = TokenizeStats()
        if initial_state is not None:
            self.check_saved(initial_state, self._config())
            self._position = int(initial_state[self.POSITION_KEY])
            self.tokenizer.stats = TokenizeStats(**initial_state[self.STATS_KEY])
            nested = initial_state.get(self.SOURCE_KEY)
        self.reader.open(self._position, nested)

    def next(self) -> dict[str, np.ndarray]:
        index = self._position
        row = self.reader.next(index)
        self._position = index + 1
        return self.tokenizer(row, index)

    def get_state(self) -> dict[str, Any]:
        state = {**self.state_header(self._config()), self.POSITION_KEY: self._position,
                 self.STATS_KEY: self.tokenizer.stats.as_dict()}  # fmt: skip
        if self.reader.kind == "node":
            state[self.SOURCE_KEY] = self.reader.node_state()
        return state

