"""Cheap, safe copies of node states (``fresh_state``, ``portable_state``) and of packer stats (``stats_dict``).

A node that hands out one saved state many times (``Pack``'s per-window snapshot) gives every caller its
own copy, so editing it changes neither the next state nor the restore point. A state is a tree of dicts,
lists, tuples, arrays and immutable scalars, which :func:`fresh_state` copies directly, a few times faster
than ``copy.deepcopy`` (it does not keep sharing of one mutable object at two places; cpdata's states
have none). :func:`portable_state` also turns arrays into CPU tensors and numpy scalars into Python ones:
``torch.load(weights_only=True)`` refuses numpy objects, and ``StatefulDataLoader`` compares successive
worker states, where ``==`` on arrays raises. Restoring reads either form.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import numpy as np
import torch

from cpdata.packing import PackingStats

__all__ = ["fresh_state", "portable_state", "stats_dict"]

_ATOMS = frozenset({int, float, bool, str, bytes, type(None), complex})
_STATS_FIELDS = tuple(f.name for f in dataclasses.fields(PackingStats))


def fresh_state(state: Any) -> Any:
    """A copy of ``state`` that shares nothing mutable with it (see the module docstring)."""
    return _copy_tree(state, portable=False)


def portable_state(state: Any) -> Any:
    """:func:`fresh_state` with every numpy array as a CPU tensor and every numpy scalar as a Python scalar."""
    return _copy_tree(state, portable=True)


def _copy_tree(state: Any, portable: bool) -> Any:
    kind = type(state)
    if kind is dict:
        return {k: v if type(v) in _ATOMS else _copy_tree(v, portable) for k, v in state.items()}
    if kind is np.ndarray:
        return torch.from_numpy(state.copy()) if portable else state.copy()
    if kind is list:
        return [v if type(v) in _ATOMS else _copy_tree(v, portable) for v in state]
    if kind is tuple:
        if all(type(v) in _ATOMS for v in state):
            return state  # immutable all the way down (deepcopy returns it as is too)
        return tuple(_copy_tree(v, portable) for v in state)
    if kind in _ATOMS:
        return state
    if portable and isinstance(state, np.generic):
        return state.item()
    return copy.deepcopy(state)


def stats_dict(stats: PackingStats | dict[str, Any], **fields: Any) -> dict[str, Any]:
    """``dataclasses.asdict(dataclasses.replace(stats, **fields))`` without ``asdict``'s recursion; ``stats``
    may be a fresh dict of its fields already (:meth:`~cpdata.packing.StreamPlanner.stats_fields`), filled in."""
    out = stats if type(stats) is dict else {name: getattr(stats, name) for name in _STATS_FIELDS}
    for name, value in fields.items():
        if name not in out:
            raise TypeError(f"PackingStats has no field {name!r}")
        out[name] = value
    out["sources"] = fresh_state(out["sources"])
    return out
