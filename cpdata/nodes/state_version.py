"""The checks every stateful stage runs before it restores a state."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["check_saved_config", "check_state_version"]


def check_state_version(owner: str, state: Mapping[str, Any], key: str, expected: int) -> None:
    """Raise ``ValueError`` unless ``state[key] == expected``, naming both and the fix."""
    version = state.get(key)
    if version != expected:
        raise ValueError(
            f"{owner} state has version {version!r}, this code reads version {expected}; the state was written "
            "by another cpdata version (or is not a cpdata state): resume with that version or start from scratch"
        )


def check_saved_config(owner: str, saved: Mapping[str, Any], current: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` unless a state's saved configuration equals the node's, naming both."""
    if dict(saved) != dict(current):
        raise ValueError(
            f"{owner} state was saved with {dict(saved)}, this node has {dict(current)}; "
            f"resume with the same {', '.join(sorted(current))}"
        )
