"""What every stateful stage's state shares: its keys, its header, and the checks before a restore."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["VersionedState"]


class VersionedState:
    """A stage whose state holds ``VERSION`` under ``VERSION_KEY``, its configuration under ``CONFIG_KEY``
    and its source's state under ``SOURCE_KEY``; :meth:`check_saved` refuses a state of another."""

    VERSION: int
    VERSION_KEY = "version"
    CONFIG_KEY = "config"
    SOURCE_KEY = "source"

    def state_header(self, config: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """A state's first keys, which :meth:`check_saved` reads: the version, then ``config`` when given."""
        header: dict[str, Any] = {self.VERSION_KEY: self.VERSION}
        if config is not None:
            header[self.CONFIG_KEY] = config
        return header

    def check_saved(self, state: Mapping[str, Any], config: Mapping[str, Any] | None = None) -> None:
        """Raise ``ValueError`` unless ``state`` has this stage's version and, when given, its ``config``,
        naming both and the fix."""
        owner, version = type(self).__name__, state.get(self.VERSION_KEY)
        if version != self.VERSION:
            raise ValueError(
                f"{owner} state has version {version!r}, this code reads version {self.VERSION}; the state was "
                "written by another cpdata version (or is not a cpdata state): resume with that version or start "
                "from scratch"
            )
        saved = None if config is None else dict(state[self.CONFIG_KEY])
        if saved is not None and saved != dict(config):
            raise ValueError(
                f"{owner} state was saved with {saved}, this node has {dict(config)}; "
                f"resume with the same {', '.join(sorted(config))}"
            )
