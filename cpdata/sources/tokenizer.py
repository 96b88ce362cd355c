"""Text and chat rows to token documents: the pure function behind ``Tokenize`` and ``cpdata tokenize``.

:class:`RowTokenizer` turns ``{"text": ...}`` into ``{"input_ids": int64 [n]}`` and ``{"messages": [...]}``
into ``input_ids`` plus, with ``assistant_only``, ``assistant_masks`` (int8, aligned with the inputs: the
template's ``{% generation %}`` tokens; text rows get all ones). ``append_eos`` ends text rows with EOS;
``max_length`` keeps a document's first tokens (counted in ``stats``). The tokenizer is a path (loaded
locally), a ``transformers`` or ``tokenizers`` tokenizer, or a callable ``text -> ids`` (text rows only).
No tokenizer library is imported at import time; a :class:`RowTokenizer` pickles (a path-loaded tokenizer
is loaded again).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence, Sized
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from cpdata.errors import check_int

__all__ = ["ASSISTANT_MASKS", "RowTokenizer", "TokenizeStats", "load_tokenizer"]

ASSISTANT_MASKS = "assistant_masks"
"""Key of the per-token assistant mask (``apply_chat_template``'s name), aligned with ``input_ids``."""


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """A ``transformers`` fast tokenizer from a ``tokenizer.json`` file or a saved folder (local files only), or a
    ``tokenizers.Tokenizer`` when ``transformers`` is not installed."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"tokenizer {str(p)!r} does not exist; pass a tokenizer.json file or a saved tokenizer folder")
    try:
        import transformers
    except ImportError:
        if p.is_dir():
            raise ValueError(f"loading the tokenizer folder {p} needs transformers: pip install 'cpdata[hf]'") from None
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(p))
    if p.is_dir():
        return transformers.AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(p))


@dataclass(slots=True)
class TokenizeStats:
    """Counters of a tokenizing run (exact, restored with the node's state): rows turned into ``documents``, of
    which ``chat`` rows; ``tokens`` emitted after truncation; text rows ending with an appended EOS
    (``eos_appended``; one that ``max_length`` cut off is not counted); documents ``truncated`` at
    ``max_length`` and the ``truncated_tokens`` cut."""

    documents: int = 0
    chat: int = 0
    tokens: int = 0
    eos_appended: int = 0
    truncated: int = 0
    truncated_tokens: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: int(getattr(self, f.name)) for f in fields(self)}


@runtime_checkable
class _ChatTokenizer(Protocol):
    """A ``transformers`` tokenizer: ``tok(text, add_special_tokens=...)["input_ids"]``, chat templates."""

    def apply_chat_template(self, conversation: list, **options: Any) -> Mapping[str, Any]: ...

    def convert_tokens_to_ids(self, tokens: Any) -> Any: ...


@runtime_checkable
class _Encoder(Protocol):
    """A tokenizer object with ``encode`` (a ``tokenizers.Tokenizer``: ``encode(text, ...).ids``)."""

    def encode(self, text: str, **options: Any) -> Any: ...


class RowTokenizer:
    """One row -> one document (module docstring); ``stats`` counts every call.

    ``eos_token_id`` defaults to the tokenizer's; ``add_special_tokens`` goes to the tokenizer for text rows;
    ``chat_template`` overrides the tokenizer's; ``text_key``/``messages_key`` name the row fields."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        append_eos: bool = False,
        eos_token_id: int | None = None,
        assistant_only: bool = False,
        max_length: int | None = None,
        add_special_tokens: bool = True,
        chat_template: str | None = None,
        text_key: str = "text",
        messages_key: str = "messages",
    ) -> None:
        self.source = tokenizer
        self._tok = load_tokenizer(tokenizer) if isinstance(tokenizer, (str, os.PathLike)) else tokenizer
        check_int("max_length", max_length, min=1, optional=True)
        if eos_token_id is None:
            eos_token_id = getattr(self._tok, "eos_token_id", None)
        if append_eos and eos_token_id is None:
            raise ValueError(
                f"append_eos=True needs an EOS id but the tokenizer ({type(self._tok).__name__}) defines none; "
                "pass eos_token_id="
            )
        if not callable(self._tok) and not isinstance(self._tok, _Encoder):
            raise TypeError(
                f"tokenizer must be a path, a transformers tokenizer, a tokenizers.Tokenizer or a callable "
                f"text -> token ids, got {type(self._tok).__name__}"
            )
        self.append_eos, self.eos_token_id = bool(append_eos), eos_token_id
        self.assistant_only, self.max_length = bool(assistant_only), max_length
        self.add_special_tokens, self.chat_template = add_special_tokens, chat_template
        self.text_key, self.messages_key = text_key, messages_key
        self._chat_ok = isinstance(self._tok, _ChatTokenizer)  # decided once: rows then take one branch
        self._library = not self._chat_ok and type(self._tok).__module__.startswith("tokenizers")
        self.stats = TokenizeStats()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if isinstance(self.source, (str, os.PathLike)):
            state["_tok"] = None  # reloaded from the path: smaller, and safe across processes
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self._tok is None:
            self._tok = load_tokenizer(self.source)

    @property
    def vocab_size(self) -> int | None:
        """``len(tokenizer)`` (added tokens included) when the tokenizer has a length, else None (a callable)."""
        return len(self._tok) if isinstance(self._tok, Sized) else None

    def _encode(self, text: str) -> Sequence[int]:
        tok = self._tok
        if self._chat_ok:
            return tok(text, add_special_tokens=self.add_special_tokens)["input_ids"]
        if self._library:
            return tok.encode(text, add_special_tokens=self.add_special_tokens).ids
        return tok(text)

    def _chat(self, messages: Any, where: str) -> tuple[Sequence[int], Sequence[int] | None]:
        if not self._chat_ok:
            raise TypeError(
                f"{where}: chat rows need a transformers tokenizer with a chat template, got "
                f"{type(self._tok).__name__}; load one with cpdata.sources.tokenizer.load_tokenizer(path)"
            )
        if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
            raise TypeError(f"{where}: {self.messages_key!r} must be a list of {{'role', 'content'}} dicts")
        out = self._tok.apply_chat_template(
            list(messages), tokenize=True, return_dict=True, chat_template=self.chat_template,
            return_assistant_tokens_mask=self.assistant_only,
        )  # fmt: skip
        mask = out[ASSISTANT_MASKS] if self.assistant_only else None
        if mask is not None and not any(mask) and any(
            isinstance(m, Mapping) and m.get("role") == "assistant" for m in messages
        ):
            raise ValueError(
                f"{where}: assistant_only=True but the chat template marks no assistant token; wrap the assistant "
                "content in {% generation %} ... {% endgeneration %} in the template (or pass chat_template=)"
            )
        return out["input_ids"], mask

    def __call__(self, row: Mapping[str, Any], index: int | str = "?") -> dict[str, np.ndarray]:
        """The document of ``row`` (``index`` only names it in errors)."""
        where = f"row {index}"
        if not isinstance(row, Mapping):
            raise TypeError(f"{where}: expected a dict with {self.text_key!r} or {self.messages_key!r}, got "
                            f"{type(row).__name__}")  # fmt: skip
        chat = self.messages_key in row
        if chat:
            ids, mask = self._chat(row[self.messages_key], where)
        elif self.text_key in row:
            text = row[self.text_key]
            if not isinstance(text, str):
                raise TypeError(f"{where}: {self.text_key!r} must be a string, got {type(text).__name__}")
            ids = np.asarray(self._encode(text), dtype=np.int64).reshape(-1)
            if self.append_eos:
                ids = np.append(ids, np.int64(self.eos_token_id))
            # text rows train every token; one key set for every document of a batch
            mask = np.ones(ids.shape[0], dtype=np.int8) if self.assistant_only else None
        else:
            raise ValueError(
                f"{where} has keys {sorted(map(str, row))}: expected {self.text_key!r} (text) or "
                f"{self.messages_key!r} (chat); set text_key=/messages_key= for other names"
            )
        out = {"input_ids": np.asarray(ids, dtype=np.int64).reshape(-1)}
        if mask is not None:
            out[ASSISTANT_MASKS] = np.asarray(mask, dtype=np.int8).reshape(-1)
        eos = self.append_eos and not chat
        n = out["input_ids"].shape[0]
        if self.max_length is not None and n > self.max_length:
            out = {k: v[: self.max_length] for k, v in out.items()}
            self.stats.truncated += 1
            self.stats.truncated_tokens += n - self.max_length
            eos = False  # the appended EOS was the last token: cut
        self.stats.eos_appended += eos
        self.stats.documents += 1
        self.stats.chat += chat
        self.stats.tokens += out["input_ids"].shape[0]
        return out
