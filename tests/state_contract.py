"""The save/resume contract every cpdata node must meet, as one reusable helper.

``run_save_load_contract(make_node, midpoints)``:

1. runs a fresh node to the end (``epochs`` times, ``reset()`` between epochs)
   and keeps every item as the reference;
2. for each midpoint ``m`` (an item count over all epochs), runs a fresh node
   to ``m`` items and takes ``state_dict()``;
3. checks the state is a fresh object the node never touches again: mutating
   it does not leak into the node, and advancing the node does not change it;
4. restores a NEW node from the state after each round trip (``copy.deepcopy``,
   ``pickle``, ``torch.save``/``torch.load`` with its default ``weights_only=True``) and requires
   the remaining items to equal the reference's, bit for bit.

With ``epochs > 1`` the state saved right after an epoch's ``StopIteration``
(before ``reset()``) is checked as well. Item equality is
:func:`assert_items_equal`: numpy arrays and tensors by dtype, shape and
value; dataclasses field by field; mappings and sequences element-wise.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import math
import pickle
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["ROUND_TRIPS", "assert_items_equal", "run_save_load_contract"]


def assert_items_equal(actual: Any, expected: Any, path: str = "item") -> None:
    """Deep, exact equality; the AssertionError names the first differing path."""
    if isinstance(expected, np.ndarray) or isinstance(actual, np.ndarray):
        assert isinstance(actual, np.ndarray) and isinstance(expected, np.ndarray), (
            f"{path}: {type(actual).__name__} vs {type(expected).__name__}")
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} vs {expected.dtype}"
        assert actual.shape == expected.shape, f"{path}: shape {actual.shape} vs {expected.shape}"
        assert np.array_equal(actual, expected, equal_nan=actual.dtype.kind in "fc"), (
            f"{path}: values differ at {np.argwhere(actual != expected)[:4].tolist()}")
        return
    if isinstance(expected, torch.Tensor) or isinstance(actual, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor), (
            f"{path}: {type(actual).__name__} vs {type(expected).__name__}")
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} vs {expected.dtype}"
        assert actual.shape == expected.shape, f"{path}: shape {tuple(actual.shape)} vs {tuple(expected.shape)}"
        assert actual.device == expected.device, f"{path}: device {actual.device} vs {expected.device}"
        assert torch.equal(actual, expected) or (
            actual.is_floating_point() and torch.equal(actual.nan_to_num(0.5), expected.nan_to_num(0.5))
            and torch.equal(actual.isnan(), expected.isnan())), f"{path}: tensor values differ"
        return
    if dataclasses.is_dataclass(expected) and not isinstance(expected, type):
        assert type(actual) is type(expected), f"{path}: {type(actual).__name__} vs {type(expected).__name__}"
        for f in dataclasses.fields(expected):
            assert_items_equal(getattr(actual, f.name), getattr(expected, f.name), f"{path}.{f.name}")
        return
    if isinstance(expected, Mapping):
        assert isinstance(actual, Mapping), f"{path}: {type(actual).__name__} vs a mapping"
        assert list(actual.keys()) == list(expected.keys()), (
            f"{path}: keys {list(actual.keys())} vs {list(expected.keys())}")
        for key in expected:
            assert_items_equal(actual[key], expected[key], f"{path}[{key!r}]")
        return
    if isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected), f"{path}: {type(actual).__name__} vs {type(expected).__name__}"
        assert len(actual) == len(expected), f"{path}: length {len(actual)} vs {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_items_equal(a, e, f"{path}[{i}]")
        return
    if isinstance(expected, float) and isinstance(actual, float) and math.isnan(expected):
        assert math.isnan(actual), f"{path}: {actual!r} vs nan"
        return
    assert type(actual) is type(expected) or (
        isinstance(actual, (int, float, np.number)) and isinstance(expected, (int, float, np.number))
    ), f"{path}: {type(actual).__name__} vs {type(expected).__name__}"
    assert actual == expected, f"{path}: {actual!r} vs {expected!r}"


def _torch_round_trip(state: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer)  # torch's default, weights_only=True: a state holds no numpy objects


ROUND_TRIPS: dict[str, Callable[[Any], Any]] = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda s: pickle.loads(pickle.dumps(s, protocol=pickle.HIGHEST_PROTOCOL)),
    "torch": _torch_round_trip,
}


class _Runner:
    """Drives a node through ``epochs`` epochs, remembering where it is."""

    def __init__(self, node: Any, epochs: int, epoch: int = 0) -> None:
        self.node, self.epochs, self.epoch = node, epochs, epoch

    def take(self, n: int | None) -> list[Any]:
        """Up to ``n`` items (all remaining with ``None``), resetting between epochs."""
        out: list[Any] = []
        while n is None or len(out) < n:
            try:
                out.append(next(self.node))
            except StopIteration:
                if self.epoch + 1 >= self.epochs:
                    break
                self.epoch += 1
                self.node.reset()
        return out

    def drain_epoch(self) -> list[Any]:
        """Items up to and including this epoch's StopIteration (no reset)."""
        out = []
        while True:
            try:
                out.append(next(self.node))
            except StopIteration:
                return out


def _check_state_is_detached(node: Any, runner: _Runner, state: dict[str, Any]) -> None:
    frozen = copy.deepcopy(state)
    assert isinstance(state, dict), f"state_dict() must return a dict, got {type(state).__name__}"
    probe = node.state_dict()
    assert probe is not state, "state_dict() returned the same dict twice; return a fresh dict"
    probe["__contract_probe__"] = True
    assert "__contract_probe__" not in node.state_dict(), "mutating a returned state changed the node's state"
    runner.take(3)
    assert_items_equal(state, frozen, "state (after the node advanced)")


def run_save_load_contract(
    make_node: Callable[[], Any],
    midpoints: Iterable[int],
    compare: Callable[[Any, Any], None] = assert_items_equal,
    *,
    epochs: int = 1,
    round_trips: Sequence[str] = tuple(ROUND_TRIPS),
) -> list[Any]:
    """Check exact save/resume of the nodes ``make_node()`` builds.

    Args:
        make_node: builds a fresh, identically configured node (with fresh sources).
        midpoints: item counts (over all epochs) at which to save; each must be
            ``<= `` the total number of items, so the check cannot pass vacuously.
        compare: ``compare(actual_item, expected_item)`` raising on a difference.
        epochs: epochs to run, with ``node.reset()`` after each ``StopIteration``.
        round_trips: names in :data:`ROUND_TRIPS` applied to each saved state.

    Returns:
        the reference items (all epochs), for further assertions.
    """
    reference = _Runner(make_node(), epochs).take(None)
    assert reference, "the node produced no items; the contract would pass vacuously"
    points = list(midpoints)
    for m in points:
        if not 0 <= m <= len(reference):
            raise ValueError(f"midpoint {m} is outside the {len(reference)} items the node produces")

    def check_restore(state: dict[str, Any], epoch: int, done: int, label: str) -> None:
        for trip in round_trips:
            restored = make_node()
            restored.reset(ROUND_TRIPS[trip](state))
            rest = _Runner(restored, epochs, epoch).take(None)
            expected = reference[done:]
            assert len(rest) == len(expected), (
                f"{label}, {trip}: {len(rest)} items after restore, expected {len(expected)}")
            for i, (a, e) in enumerate(zip(rest, expected, strict=True)):
                try:
                    compare(a, e)
                except AssertionError as err:
                    raise AssertionError(f"{label}, {trip}: item {done + i} differs: {err}") from err

    for m in points:
        node = make_node()
        runner = _Runner(node, epochs)
        assert len(runner.take(m)) == m
        state = node.state_dict()
        epoch = runner.epoch
        snapshot = copy.deepcopy(state)
        _check_state_is_detached(node, runner, state)
        check_restore(snapshot, epoch, m, f"midpoint {m} (epoch {epoch})")

    if epochs > 1:  # a state saved after StopIteration, before reset()
        node = make_node()
        runner = _Runner(node, epochs)
        done = len(runner.drain_epoch())
        check_restore(copy.deepcopy(node.state_dict()), 0, done, "after the first StopIteration")
    return reference
