"""Cheap, safe copies of node states (``fresh_state``, ``portable_state``) and of packer stats (``stats_dict``).

A node that hands out the same saved state many times (``Pack``: one snapshot
per window, read once per block of batches) must give every caller its own
copy, or a caller that edits the dict it got (or an array in it) would change
the next state or the node's restore point. ``copy.deepcopy`` does that but
pays its memo and dispatch machinery per object (~10-15 us for a Pack
snapshot's source and planner parts); a state is a tree of dicts, lists,
tuples, numpy arrays and immutable scalars, which :func:`fresh_state` copies
directly (new containers, a ``copy()`` of every array, scalars and strings
shared), a few times faster. Anything else is handed to ``copy.deepcopy``.

The copy equals the original (recursive ``==``, ``np.array_equal`` for arrays)
and pickles to the same bytes unless the original holds one mutable object
at two places (``deepcopy`` keeps that sharing, this copy does not); states
built by cpdata's nodes never do.

What a node hands out as its state holds no numpy objects (:func:`portable_state`:
arrays become CPU tensors, numpy scalars Python ones): ``torch.load`` refuses numpy
objects under its default ``weights_only=True`` (torch >= 2.6), so a checkpoint
holding ``loader.state_dict()`` would not load without ``weights_only=False``; and
``StatefulDataLoader`` compares a worker's state with the previous one after
every batch, where ``==`` on arrays raises (so every array was sent again each
batch) but tensors compare with ``torch.equal``. Restoring reads either form:
``np.asarray`` of a CPU tensor is a view of it.
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
    """A copy of ``state`` that shares nothing mutable with it (see the module docstring).

    Cost: one Python call per container and array (no memo), one ``ndarray.copy()`` per array.
    """
    return _copy_tree(state, portable=False)


def portable_state(state: Any) -> Any:
    """:func:`fresh_state` with every numpy array as a CPU tensor of its own (``torch.from_numpy`` of a copy)
    and every numpy scalar as a Python scalar (see the module docstring)."""
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
    """``dataclasses.asdict(dataclasses.replace(stats, **fields))`` without building a second dataclass
    or running ``asdict``'s generic recursion: a fresh dict in field order, ``sources`` copied. ``stats``
    may be given as its fields already (a fresh dict in field order, e.g.
    :meth:`~cpdata.packing.StreamPlanner.stats_fields`), which is then filled in and returned."""
    out = stats if type(stats) is dict else {name: getattr(stats, name) for name in _STATS_FIELDS}
    for name, value in fields.items():
        if name not in out:
            raise TypeError(f"PackingStats has no field {name!r}")
        out[name] = value
    out["sources"] = fresh_state(out["sources"])
    return out
