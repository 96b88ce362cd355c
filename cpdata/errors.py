"""Exception types that are both what NeMo Automodel raises and what cpdata promises (``ValueError``).

Code written against NeMo's sharder catches ``KeyError`` (a THD batch without
``seq_lens``) and ``NotImplementedError`` (token verbs of a data-dependent
layout before the first shard, ``trim=True`` with nothing to trim to); code
written against cpdata catches ``ValueError``. These subclasses satisfy both.
"""

from __future__ import annotations

__all__ = ["MissingBatchKeyError", "NotAvailableYetError"]


class MissingBatchKeyError(KeyError, ValueError):
    """A required batch key is absent: ``KeyError(key)`` as NeMo raises, and a ``ValueError`` naming the fix."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(key)
        self.key = key
        self.message = message

    def __str__(self) -> str:
        return f"{self.key!r}: {self.message}"


class NotAvailableYetError(NotImplementedError, ValueError):
    """A token verb cannot run on what the sharder knows yet (no layout, nothing to trim to)."""
