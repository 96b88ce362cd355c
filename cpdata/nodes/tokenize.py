"""``Tokenize``: text and chat rows to token documents, on the dataloader workers.

::

    Tokenize(rows, "tokenizer/", append_eos=True, max_length=4096)  ->  Documents -> Pack -> ...
    build_loader(Tokenize(chats, tok, assistant_only=True), capacity=..., ...)

Each row becomes one document through :class:`cpdata.sources.tokenizer.RowTokenizer`
(see its table for ``append_eos``, ``assistant_only``, ``max_length``). Chat
documents with ``assistant_only=True`` carry ``assistant_masks`` aligned with
``input_ids``, exactly as ``apply_chat_template`` returns them: the node
declares ``labels_alignment = "inputs"``, and ``Documents`` shifts the mask to
next-token targets before packing, so the batch's ``labels`` are -100 wherever
the next token is not an assistant token.

Sources and resume, like :class:`~cpdata.nodes.source.Documents`: a sequence
(list, ``datasets.Dataset``) resumes by index in O(1); a re-iterable is
re-iterated and the rows already read are skipped (not tokenized again); a
``BaseNode`` nests its own state. The state also holds the counters
(``stats``), so they are exact after a restore. Cost: the tokenizer's, per
row; nothing is buffered.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from cpdata.nodes.source_kinds import SourceReader
from cpdata.nodes.state_version import check_saved_config, check_state_version
from cpdata.sources.tokenizer import RowTokenizer, TokenizeStats

__all__ = ["Tokenize"]


class Tokenize(BaseNode[dict[str, np.ndarray]]):
    """Emit ``{"input_ids": int64 [n], "assistant_masks"?: int8 [n]}`` per row of ``source``.

    Args:
        source: rows ``{"text": str}`` or ``{"messages": [...]}``: a sequence,
            a re-iterable, or a ``BaseNode``.
        tokenizer: a path (``tokenizer.json`` or a saved folder), a
            ``transformers``/``tokenizers`` tokenizer, or a callable
            ``text -> ids``; or a ready :class:`~cpdata.sources.tokenizer.RowTokenizer`.
        **options: :class:`~cpdata.sources.tokenizer.RowTokenizer`'s keyword arguments
            (``append_eos``, ``eos_token_id``, ``assistant_only``, ``max_length``,
            ``add_special_tokens``, ``chat_template``, ``text_key``, ``messages_key``).

    State: ``{"version", "config", "position", "stats", "source"?}``; a state
    saved under other options is refused.
    """

    VERSION = 1
    VERSION_KEY = "version"
    CONFIG_KEY = "config"
    POSITION_KEY = "position"
    STATS_KEY = "stats"
    SOURCE_KEY = "source"

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
        """``"inputs"`` when the node emits ``assistant_masks`` (they belong to ``input_ids[i]`` itself, as
        ``apply_chat_template`` returns them); ``Documents`` takes it from here."""
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
            check_state_version("Tokenize", initial_state, self.VERSION_KEY, self.VERSION)
            check_saved_config("Tokenize", initial_state[self.CONFIG_KEY], self._config())
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
        state: dict[str, Any] = {
            self.VERSION_KEY: self.VERSION,
            self.CONFIG_KEY: self._config(),
            self.POSITION_KEY: self._position,
            self.STATS_KEY: self.tokenizer.stats.as_dict(),
        }
        if self.reader.kind == "node":
            state[self.SOURCE_KEY] = self.reader.node_state()
        return state

