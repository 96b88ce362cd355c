"""Pack hands out its per-window snapshot as fresh states: equal to deep copies, holding no numpy objects (they
load with ``torch.load``'s default ``weights_only=True``), and a caller that edits every part of a state it got
changes neither the next state nor a restore from it."""

from __future__ import annotations

import copy
import dataclasses
import io
import pickle
import warnings

import numpy as np
import pytest
import torch
from state_contract import assert_items_equal
from torchdata.nodes import IterableWrapper

from cpdata.nodes.mix import mix
from cpdata.nodes.pack import Pack
from cpdata.nodes.source import Documents
from cpdata.nodes.state_copy import fresh_state, portable_state, stats_dict
from cpdata.packing import PackingStats


def _docs(n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(0, 1000, int(k))} for k in rng.integers(1, 60, n)]


SOURCES = {
    "seekable": lambda: _docs(200, 0),
    "iterable": lambda: IterableWrapper(_docs(200, 0)),  # the carry holds token arrays
    "mix": lambda: mix({"a": _docs(120, 1), "b": IterableWrapper(_docs(90, 2))}, {"a": 2, "b": 1}, seed=4),
}


def _pack(kind: str) -> Pack:
    return Pack(Documents(SOURCES[kind]()), capacity=64, layout="thd", cp_size=2, overflow="split", window=12)


def _vandalise(state) -> None:
    """Change in place everything a caller could: every dict and list gains an entry and loses none of its
    own, int entries are bumped, writeable arrays are overwritten; a read-only array must refuse a write."""
    if isinstance(state, dict):
        for key, value in list(state.items()):
            _vandalise(value)
            if type(value) is int:
                state[key] = value + 1
        state["__vandal__"] = [1]
    elif isinstance(state, list):
        for value in state:
            _vandalise(value)
        state.append("__vandal__")
    elif isinstance(state, tuple):
        for value in state:
            _vandalise(value)
    elif isinstance(state, torch.Tensor) and state.numel():
        state.fill_(7)
    elif isinstance(state, np.ndarray) and state.size:
        if state.flags.writeable:
            state[...] = 7
        else:
            with pytest.raises(ValueError, match="read-only"):
                state[...] = 7


def _numpy_objects(state, path="state") -> list[str]:
    """Where ``state`` holds numpy arrays or scalars (which ``torch.load(weights_only=True)`` refuses)."""
    if isinstance(state, dict):
        return [p for k, v in state.items() for p in _numpy_objects(v, f"{path}[{k!r}]")]
    if isinstance(state, (list, tuple)):
        return [p for i, v in enumerate(state) for p in _numpy_objects(v, f"{path}[{i}]")]
    return [path] if isinstance(state, (np.ndarray, np.generic)) else []


def _torch_load(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer)  # weights_only=True, torch's default


@pytest.mark.parametrize("kind", list(SOURCES))
def test_a_state_handed_out_is_the_callers(kind):
    node, checked = _pack(kind), 0
    for i, _ in enumerate(node):
        if i % 4:
            continue
        kept = copy.deepcopy(node.state_dict())
        given = node.state_dict()
        assert_items_equal(pickle.loads(pickle.dumps(given)), kept, "a fresh state pickles as a deep copy does")
        assert not _numpy_objects(given), _numpy_objects(given)
        _vandalise(given)
        again = node.state_dict()
        assert_items_equal(again, kept, "state after a caller edited the previous one")
        assert_items_equal(_torch_load(again), kept, "a state through torch.save / torch.load (weights_only=True)")
        if kind == "iterable" and again["carry"]["arrays"]:
            checked += 1
        elif kind != "iterable" and again["emitted"] and again["carry"]["key"].numel():
            checked += 1
    assert checked >= 3, "no state with carried pieces mid-window was checked"
    if kind == "mix":
        assert set(node.state_dict()["stats"]["sources"]) == {"a", "b"}


@pytest.mark.parametrize("kind", list(SOURCES))
def test_restore_after_a_caller_edited_earlier_states(kind):
    reference = list(_pack(kind))
    node = _pack(kind)
    for _ in range(9):
        next(node)
        _vandalise(node.state_dict())  # e.g. a Prefetcher's copy, edited by its consumer
    state = node.state_dict()
    _vandalise(node.state_dict())
    restored = _pack(kind)
    restored.reset(pickle.loads(pickle.dumps(state)))
    assert_items_equal(list(restored), reference[9:])
    assert_items_equal(list(node), reference[9:])


def test_fresh_state_copies_containers_and_arrays_and_shares_immutables():
    inner = np.arange(4)
    state = {"a": [inner, {"b": (1, "x")}], "c": (inner, 2.5), "d": None, "e": np.int64(3)}
    out = fresh_state(state)
    assert_items_equal(out, state)
    assert out is not state and out["a"] is not state["a"] and out["a"][1] is not state["a"][1]
    assert out["a"][0] is not inner and out["c"][0] is not inner and out["a"][1]["b"] is state["a"][1]["b"]
    out["a"][0][0] = 9
    assert inner[0] == 0
    assert pickle.dumps(fresh_state({"x": [1, (2, "y")], "z": "s"})) == pickle.dumps({"x": [1, (2, "y")], "z": "s"})


def test_stats_dict_is_asdict_of_the_replaced_stats():
    stats = PackingStats.from_counts(capacity=64, documents=5, tokens=100, slot_tokens=110, packs=2, split=1)
    sources = {"a": {"documents": 3, "tokens": 60}}
    expected = dataclasses.asdict(dataclasses.replace(stats, epoch=2, sources=sources))
    got = stats_dict(stats, epoch=2, sources=sources)
    assert pickle.dumps(got) == pickle.dumps(expected) and list(got) == list(expected)
    got["sources"]["a"]["documents"] = 0
    assert sources["a"]["documents"] == 3
    with pytest.raises(TypeError, match="no field 'epochs'"):
        stats_dict(stats, epochs=2)


def test_portable_state_turns_numpy_into_tensors_and_python_scalars_and_np_asarray_reads_both():
    inner = np.arange(4)
    state = {"a": [inner, {"b": (1, "x")}], "c": (inner, np.float64(2.5)), "d": None, "e": np.int64(3)}
    out = portable_state(state)
    assert type(out["a"][0]) is torch.Tensor and out["a"][0].tolist() == [0, 1, 2, 3]
    assert type(out["e"]) is int and out["e"] == 3 and type(out["c"][1]) is float and out["a"][1] == {"b": (1, "x")}
    out["a"][0][0] = 9  # the tensors are copies
    assert inner[0] == 0
    assert not _numpy_objects(out) and _numpy_objects(state)
    assert_items_equal(_torch_load(out), out)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (np.asarray(tensor, dtype=...) warns under numpy 2; the restores pass none)
        for saved in (out["a"][0], inner, [0, 1]):  # a new state, an earlier version's array, a list
            assert type(np.asarray(saved)) is np.ndarray


def _as_numpy(state):
    """``state`` as earlier versions saved it: numpy arrays where this one has tensors."""
    if isinstance(state, dict):
        return {k: _as_numpy(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_as_numpy(v) for v in state]
    if isinstance(state, tuple):
        return tuple(_as_numpy(v) for v in state)
    return state.numpy().copy() if isinstance(state, torch.Tensor) else state


@pytest.mark.parametrize("kind", ["seekable", "iterable"])
def test_a_state_saved_with_numpy_arrays_still_restores(kind):
    reference = list(_pack(kind))
    node = _pack(kind)
    for _ in range(9):
        next(node)
    state = _as_numpy(node.state_dict())
    assert _numpy_objects(state), "the state has no arrays: the test would pass vacuously"
    restored = _pack(kind)
    restored.reset(state)
    assert_items_equal(list(restored), reference[9:])


def _earlier_narrowed(arrays: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], list[str]]:
    """One carried piece as states before the columnar carry stored it: its int64 arrays whose values fit
    int32 stored as int32, and the names to widen back."""
    out, widen = {}, []
    for name, a in arrays.items():
        if a.dtype == np.int64 and a.size and np.iinfo(np.int32).min <= a.min() and a.max() <= np.iinfo(np.int32).max:
            out[name] = a.astype(np.int32)
            widen.append(name)
        else:
            out[name] = np.array(a)
        out[name].flags.writeable = False
    return out, widen


def test_a_state_with_the_earlier_per_piece_carry_arrays_still_restores():
    """States before the columnar carry held one ``(narrowed arrays, names to widen)`` pair per piece."""
    from cpdata.nodes.live_pieces import piece_sources

    reference = list(_pack("iterable"))
    node = _pack("iterable")
    for _ in range(9):
        next(node)
    state = _as_numpy(node.state_dict())
    carry = state["carry"]
    pieces = piece_sources(carry["arrays"], carry["length"].tolist())
    assert pieces, "nothing carried: the test would pass vacuously"
    carry["arrays"] = [_earlier_narrowed(p) for p in pieces]
    restored = _pack("iterable")
    restored.reset(state)
    assert_items_equal(list(restored), reference[9:])


def test_carry_arrays_round_trip_any_dtype_and_mixed_key_sets():
    from cpdata.nodes.live_pieces import carry_arrays, piece_sources

    pieces = [
        {"input_ids": np.array([1, 2, 3]), "mask": np.array([True, False, True])},
        {"input_ids": np.array([2**40, 5])},  # does not fit int32: its group stays int64
        {"input_ids": np.array([7], dtype=np.int64), "w": np.array([0.5], dtype=np.float16)},
    ]
    columns = carry_arrays(pieces)
    got = piece_sources(_torch_load(portable_state(columns)), [3, 2, 1])
    assert_items_equal(got, pieces)
    assert [set(p) for p in got] == [set(p) for p in pieces]
    with pytest.raises(ValueError, match="the state is damaged"):
        piece_sources(columns, [3, 2, 2])


def test_carry_arrays_read_back_from_plain_lists():
    """A state whose columns became lists (e.g. through JSON) still gives every piece its own arrays."""
    from cpdata.nodes.live_pieces import carry_arrays, piece_sources

    pieces = [{"input_ids": np.array([1, 2, 3]), "labels": np.array([2, 3, -100])}, {"input_ids": np.array([9])}]
    columns = carry_arrays(pieces)
    as_lists = {k: [t.tolist() for t in v] if k == "data" else (v.tolist() if isinstance(v, np.ndarray) else v)
                for k, v in columns.items()}  # fmt: skip
    assert_items_equal(piece_sources(as_lists, [3, 1]), pieces)
