"""shard_graph and build_node take one set of options (GraphOptions), with the signatures and errors of before."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from cpdata.nodes.loader import GraphOptions, build_node, shard_graph

SHARED = [
    ("capacity", inspect.Parameter.empty), ("cp_size", inspect.Parameter.empty), ("layout", inspect.Parameter.empty),
    ("algorithm", "bfd"), ("overflow", None), ("padding_token_id", 0), ("dp_rank", 0), ("dp_size", 1), ("seed", 0),
    ("batch_size", 1), ("qkv_format", "bshd"), ("vocab_size", None), ("window", None), ("labels_alignment", None),
    ("shuffle", False), ("num_epochs", None), ("shuffle_buffer", 10000), ("micro_batches", 1), ("schedule", None),
    ("max_delay", 0), ("cost", None), ("lengths", None), ("tail", "pad"), ("schedule_window", None), ("tile", None),
]  # fmt: skip


def _params(func):
    params = list(inspect.signature(func).parameters.values())
    assert params[0].name == "source" and params[0].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[1:])
    return [(p.name, p.default) for p in params[1:]]


def test_the_signatures_list_every_option_in_the_order_of_before():
    assert [(f.name, f.default if f.default is not dataclasses.MISSING else inspect.Parameter.empty)
            for f in dataclasses.fields(GraphOptions)] == SHARED  # fmt: skip
    assert _params(shard_graph) == SHARED + [("worker", (0, 1)), ("packs", None)]
    empty = inspect.Parameter.empty
    want = SHARED[:2] + [("cp_rank", empty)] + SHARED[2:12] + [("pin_memory", None), ("prefetch", 2), ("block_size", None),
                                                               ("kv_exchange", False)]
    want += SHARED[12:]
    assert _params(build_node) == want
    assert inspect.signature(build_node).parameters["capacity"].annotation == "int"
    assert inspect.signature(shard_graph).return_annotation == "Collate"


def test_unknown_and_missing_keywords_are_refused_as_python_refuses_them():
    docs = [{"input_ids": [1, 2]}]
    common = {"capacity": 16, "cp_size": 1, "layout": "identity"}
    for func, extra in ((build_node, {"cp_rank": 0}), (shard_graph, {})):
        name = func.__name__
        with pytest.raises(TypeError, match=rf"^{name}\(\) got an unexpected keyword argument 'capacty'$"):
            func(docs, **common, **extra, capacty=3)
        with pytest.raises(TypeError, match=rf"^{name}\(\) missing 2 required keyword-only arguments: 'capacity' "
                                            r"and 'layout'$"):  # fmt: skip
            func(docs, cp_size=1, **extra)
        with pytest.raises(TypeError, match=rf"^{name}\(\) takes 1 positional argument but 2 were given$"):
            func(docs, 16)
    with pytest.raises(TypeError, match=r"^shard_graph\(\) got an unexpected keyword argument 'cp_rank'$"):
        shard_graph(docs, **common, cp_rank=0)
    with pytest.raises(TypeError, match=r"^build_node\(\) got an unexpected keyword argument 'worker'$"):
        build_node(docs, **common, cp_rank=0, worker=(0, 1))
    with pytest.raises(dataclasses.FrozenInstanceError):
        GraphOptions.of("shard_graph", common).capacity = 8  # type: ignore[misc]
