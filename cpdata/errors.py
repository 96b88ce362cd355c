"""Exceptions that are both what Python or NeMo Automodel raises and the ``ValueError`` cpdata promises.

Code written against NeMo's sharder catches ``KeyError`` or ``NotImplementedError``, code written against cpdata
``ValueError``; these subclasses satisfy both. Also the one integer check, :func:`check_int` / :func:`is_int`,
the one number check, :func:`check_number`, the one flag and choice checks, :func:`check_bool` and
:func:`check_choice`, the one refusal listing every
setting an entry point cannot honour, :func:`refuse_settings`, and the lazy export of a package's names,
:func:`lazy_exports` (standard library only: ``cpdata`` imports this module).
"""

from __future__ import annotations

import importlib
import math
import numbers
import sys
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, Literal, overload

__all__ = ["MissingBatchKeyError", "NotAnIntError", "NotAvailableYetError", "check_bool", "check_choice",
           "check_int", "check_number", "is_int", "lazy_exports", "naming_parts", "refuse_settings"]


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


class NotAnIntError(TypeError, ValueError):
    """An integer argument of another type (a float, a string, a ``bool``): ``TypeError`` and ``ValueError``."""


def is_int(value: object) -> bool:
    """Whether ``value`` is an integer: ``int`` or a numpy integer, not ``bool`` (``True`` is no count)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@overload
def check_int(name: str, value: object, *, min: int | None = None, optional: Literal[False] = False,
              fix: str = "") -> int: ...
@overload
def check_int(name: str, value: object, *, min: int | None = None, optional: bool,
              fix: str = "") -> int | None: ...
def check_int(name: str, value: object, *, min: int | None = None, optional: bool = False,
              fix: str = "") -> int | None:
    """``int(value)`` after checking it is an integer ``>= min``: :class:`NotAnIntError` for another type
    (``"capacity must be an int >= 1, got float 2.0"``), ``ValueError`` below ``min`` (``"..., got 0"``);
    ``optional``: None passes and is returned (``"window must be an int >= 1 or None, ..."``); ``fix`` is
    appended to either message (``"; use 1 for a single run"``)."""
    if optional and value is None:
        return None
    bound = ("" if min is None else f" >= {min}") + (" or None" if optional else "")
    if not is_int(value):
        raise NotAnIntError(f"{name} must be an int{bound}, got {type(value).__name__} {value!r}{fix}")
    if min is not None and value < min:
        raise ValueError(f"{name} must be an int{bound}, got {value!r}{fix}")
    return int(value)


def check_number(name: str, value: object, *, positive: bool = True, fix: str = "") -> float:
    """``float(value)`` after checking it is a finite real number ``> 0`` (``positive``) or ``>= 0``:
    ``TypeError`` for another type or a ``bool`` (``"WorldCost.tile_seconds must be a number, got str 'x'"``),
    ``ValueError`` for NaN, an infinity or a value below (``"... must be finite and > 0, got 0.0"``); ``fix``
    is appended to either message."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}{fix}")
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise ValueError(f"{name} must be finite and {'>' if positive else '>='} 0, got {value!r}{fix}")
    return float(value)


def check_bool(name: str, value: object, *, optional: bool = False) -> None:
    """``TypeError`` unless ``value`` is ``True`` or ``False`` (or None when ``optional``): ``1`` or ``"yes"``
    is no flag (``"shuffle must be True or False, got int 1"``)."""
    if not isinstance(value, bool) and not (optional and value is None):
        none = ", or None" if optional else ""
        raise TypeError(f"{name} must be True or False{none}, got {type(value).__name__} {value!r}")


def check_choice(name: str, value: object, choices: Collection[object], *, optional: bool = False,
                 fix: str = "") -> None:
    """``ValueError`` unless ``value`` is one of ``choices`` (or None when ``optional``), listing them:
    ``"unknown packing algorithm 'best'; choose one of ['bfd', 'ffd', ...]"``, then ``fix``."""
    if value not in choices and not (optional and value is None):
        raise ValueError(f"unknown {name} {value!r}; choose one of {list(choices)}{fix}")


def naming_parts(parts: Iterable[tuple[str, Any]], check: Callable[[Any], object]) -> None:
    """``check(part)`` for each ``(name, part)``; a ``ValueError`` it raises is raised again with ``"{name}: "``
    before its message (which shard of a concatenation, which source of a mix failed)."""
    for name, part in parts:
        try:
            check(part)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from exc


def refuse_settings(owner: str, problems: Iterable[tuple[bool, str]]) -> None:
    """One ``ValueError`` ``"{owner} cannot honour: a; b"`` naming every ``(holds, message)`` that holds, so a
    user changes every setting in one go; nothing when none holds."""
    found = [message for holds, message in problems if holds]
    if found:
        raise ValueError(f"{owner} cannot honour: " + "; ".join(found))


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list]]:
    """``(__getattr__, __dir__)`` for ``package``: each public name (``exports``: name -> its home module) is
    imported on first use and kept in the package, so ``import cpdata`` and the command line load no torch."""
    namespace = vars(sys.modules[package])

    def get(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value = getattr(importlib.import_module(module), name)
        return value

    return get, lambda: sorted(set(namespace) | set(exports))
