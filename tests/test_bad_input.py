"""Bad input through the whole pipeline: every error names the value, the source document and the fix.

The unit tests of each stage check its own messages (``test_source_node``,
``test_pack_node``, ``test_packing``, ``test_shard_node``, ``test_sharder``,
``test_gather_dist``, ``test_consistency_dist``); the tests here feed the bad
input where a user would, through :func:`cpdata.nodes.loader.build_loader` /
:func:`~cpdata.nodes.loader.build_node` / :class:`~cpdata.nodes.dataset.CPDataset`, with
the documents DP-sharded so that a document's index in the source differs
from its position in the rank's stream. The table in docs/bad-input.md
"Bad input and failures" lists every case and the test that checks it.
"""

from __future__ import annotations

import copy
import gc
import time
import traceback

import numpy as np
import psutil
import pytest
import torch
from dist_utils import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torchdata.stateful_dataloader import StatefulDataLoader

from cpdata.device.consistency import verify_layout_consistency
from cpdata.gather import gather_token_tensor
from cpdata.layout.maps import alignment, inverse_indices, rank_indices
from cpdata.layout.shard_layout import ShardLayout
from cpdata.nemo.sharder import ContextParallelSharder
from cpdata.nodes.dataset import CPDataset
from cpdata.nodes.loader import GraphOptions, build_loader, build_node, closing_loader, shard_graph
from cpdata.nodes.options import DataPolicy, StreamPlan
from cpdata.nodes.shard import ShardForRank
from tests.flat_options import graph_options, records

pytestmark = pytest.mark.filterwarnings("ignore:.set_vital. is deprecated")

BAD = 5
"""Source index of the bad document; with ``dp_size=2`` it is the third document of DP rank 1."""


def good_docs(n: int = 8, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(1, 100, int(rng.integers(2, 12)))} for _ in range(n)]


def with_bad(item: object) -> list:
    docs: list = good_docs()
    docs[BAD] = item
    return docs


def first_batch(source, **kw):
    """``next()`` of DP rank 1's pipeline (documents 1, 3, 5, ... of ``source``)."""
    cfg = dict(capacity=32, cp_size=2, cp_rank=0, layout="thd", dp_rank=1, dp_size=2, prefetch=0, pin_memory=False)
    return next(build_node(source, **records(**{**cfg, **kw})))


def error_of(fn, exc: type[Exception] = Exception) -> str:
    """The message of the ``exc`` that ``fn()`` raises.

    The traceback's frames are cleared so that a DataLoader iterator they hold
    is freed at once: left to the cyclic GC, torch's iterator shuts its workers
    down with a 5 s join timeout per worker.
    """
    with pytest.raises(exc) as info:
        fn()
    traceback.clear_frames(info.value.__traceback__)
    return str(info.value)


# ----------------------------------------------------------------------------- documents


DOCUMENT_CASES = {
    # name: (item, exception, parts the message must contain: value, source index, fix)
    "not_1d": ({"input_ids": np.ones((2, 3), dtype=np.int64)}, ValueError,
               ["document 5", "'input_ids'", "must be 1-D", "shape (2, 3)"]),
    "float_ids": ({"input_ids": np.array([3.0, 4.5])}, TypeError,
                  ["document 5", "dtype float64", "[3.0, 4.5]", "convert token ids to an integer type"]),
    "float_tensor_ids": ({"input_ids": torch.tensor([1.0, 2.0])}, TypeError,
                         ["document 5", "dtype float32", "convert token ids to an integer type"]),
    "bool_ids": ({"input_ids": np.array([True, False])}, TypeError,
                 ["document 5", "dtype bool", "convert token ids to an integer type"]),
    "negative_id": ({"input_ids": np.array([4, -3, 2])}, ValueError,
                    ["document 5", "must be >= 0", "got -3 at position 1"]),
    "minus_one_id": ({"input_ids": np.array([4, 2, -1])}, ValueError,  # the id next to 0
                     ["document 5", "must be >= 0", "got -1 at position 2"]),
    "id_at_vocab_size": ({"input_ids": np.array([4, 100, 2])}, ValueError,
                         ["document 5", "input_ids[1]=100", "vocab_size=100", "check the tokenizer or vocab_size"]),
    "labels_length": ({"input_ids": np.arange(1, 4), "labels": np.arange(2)}, ValueError,
                      ["document 5", "'labels' has 2 entries", "'input_ids' has 3", "one entry per token"]),
    "loss_mask_length": ({"input_ids": np.arange(1, 4), "loss_mask": np.ones(4)}, ValueError,
                         ["document 5", "'loss_mask' has 4 entries", "'input_ids' has 3", "one entry per token"]),
    "extra_length": ({"input_ids": np.arange(1, 4), "weights": torch.ones(1)}, ValueError,
                     ["document 5", "'weights' has 1 entries", "'input_ids' has 3", "one entry per token"]),
    "float_labels": ({"input_ids": np.arange(1, 3), "labels": [0.5, 1.0]}, TypeError,
                     ["document 5", "'labels' must hold integers", "dtype float64"]),
    "not_a_dict": ([1, 2, 3], TypeError,
                   ["document 5", "expected a dict with 'input_ids'", "got list", "map your source to dicts"]),
    "string_item": ("some text", TypeError, ["document 5", "got str", "map your source to dicts"]),
    "no_input_ids": ({"tokens": [1, 2]}, ValueError, ["document 5 has no 'input_ids'", "['tokens']"]),
    "ids_not_an_array": ({"input_ids": "1 2 3"}, TypeError,
                         ["document 5", "must be a 1-D list, numpy array or tensor of integers", "got str"]),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(DOCUMENT_CASES))
def test_bad_document_names_value_source_index_and_fix(case):
    item, exc, parts = DOCUMENT_CASES[case]
    message = error_of(lambda: first_batch(with_bad(item), vocab_size=100), exc)
    missing = [p for p in parts if p not in message]
    assert not missing, f"message {message!r} lacks {missing}"


class CountingSource:
    """A map-style source that records every index read (``read``)."""

    def __init__(self, docs: list) -> None:
        self.docs, self.read = docs, []

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, i: int):
        self.read.append(i)
        return self.docs[i]


def test_bad_document_on_another_dp_rank_is_not_read():
    """DP rank 0 never reads document 5 (an odd index): its whole epoch reads each even document once, no other."""
    source = CountingSource(with_bad([1, 2, 3]))
    cfg = dict(capacity=32, cp_size=2, cp_rank=0, layout="thd", dp_rank=0, dp_size=2, prefetch=0, pin_memory=False)
    batches = list(build_node(source, **records(**cfg)))
    assert sum(b.info["real_tokens"] for b in batches) == sum(len(d["input_ids"]) for d in good_docs()[0::2])
    assert sorted(source.read) == list(range(0, len(source), 2)), source.read


def batches_before_reading(docs: list, index: int, **cfg) -> list:
    """The batches an uninterrupted run (no prefetch, one batch per block) produces before it first reads
    document ``index``."""
    source = CountingSource(docs)
    out = []
    opts = {k: v for k, v in cfg.items() if k != "cp_rank"}
    node = ShardForRank(shard_graph(source, graph_options(**opts)), cp_size=cfg["cp_size"], cp_rank=cfg["cp_rank"],
                        layout=cfg["layout"], block_size=1)  # fmt: skip
    for batch in node:
        if index in source.read:
            break  # producing this batch read the document
        out.append(batch)
    assert index in source.read
    return out


def test_a_bad_document_stops_the_stream_where_it_is_read():
    """Exactly the batches planned before the bad document's window arrive, equal to an uninterrupted run's."""
    cfg = dict(capacity=32, cp_size=2, cp_rank=0, layout="thd", window=4)
    expected = batches_before_reading(good_docs(40), 31, **cfg)
    docs = good_docs(40)
    docs[31] = {"input_ids": [1, -7]}
    seen = []
    with closing_loader(build_loader(docs, **records(**cfg))) as loader:
        with pytest.raises(ValueError, match=r"document 31: 'input_ids' must be >= 0, got -7 at position 1"):
            for batch in loader:
                seen.append(batch)
    assert len(expected) >= 3 and len(seen) == len(expected)
    for got, want in zip(seen, expected, strict=True):
        assert got.info == want.info and all(torch.equal(got[k], want[k]) for k in want)


def test_extra_array_on_some_documents_only_names_them():
    """Extras are per batch: documents packed together must carry the same per-token arrays."""
    docs = good_docs(8)
    for i in (1, 3):
        docs[i] = {**docs[i], "token_type": np.ones(len(docs[i]["input_ids"]), dtype=np.float32)}
    message = error_of(lambda: first_batch(docs), ValueError)
    assert "'token_type'" in message and "documents [5, 7]" in message and "same extra arrays" in message


def test_per_token_extra_must_be_1d():
    docs = [{"input_ids": np.arange(1, 5), "emb": np.ones((4, 3))} for _ in range(8)]
    message = error_of(lambda: first_batch(docs, layout="contiguous"), ValueError)
    assert "document 1" in message and "'emb'" in message and "shape (4, 3)" in message and "1-D" in message


def test_huge_unsigned_id_is_reported_as_given():
    message = error_of(lambda: first_batch(with_bad({"input_ids": np.array([2**63 + 5], dtype=np.uint64)}),
                                           vocab_size=100), ValueError)  # fmt: skip
    assert "document 5" in message and str(2**63 + 5) in message


def test_not_1d_message_names_the_fix():
    message = error_of(lambda: first_batch(with_bad({"input_ids": np.ones((2, 3), dtype=np.int64)})), ValueError)
    assert "one document per item" in message


def test_negative_id_message_names_the_fix():
    message = error_of(lambda: first_batch(with_bad({"input_ids": [4, -100, 2]})), ValueError)
    assert "do not pre-pad" in message and "'labels'" in message


# ----------------------------------------------------------------------------- empty and overlong documents


def _drain_pack_stats(docs, **kw):
    """Every batch of one pipeline (all ranks) and the packer's final stats."""
    collated = shard_graph(docs, graph_options(**kw))
    shard = ShardForRank(collated, cp_size=kw["cp_size"], cp_rank=0, layout=kw["layout"], all_ranks=True)
    batches = list(shard)
    return batches, collated.source.stats


def _real_lengths(batches) -> list[int]:
    """Real tokens of every slot; no slot is empty (an empty document never occupies one)."""
    lengths = [int(n) for shards in batches for n in shards[0]["seq_lens"].tolist()]
    assert all(n > 0 for n in lengths), lengths
    return lengths


def test_empty_documents_are_skipped_and_counted():
    docs = good_docs(12)
    for i in (0, 3, 4, 11):
        docs[i] = {"input_ids": np.zeros(0, dtype=np.int64), "labels": []}
    batches, stats = _drain_pack_stats(docs, capacity=32, cp_size=2, layout="thd")
    assert stats.documents == 12 and stats.skipped == 4
    lengths = _real_lengths(batches)
    assert sorted(lengths) == sorted(len(d["input_ids"]) for d in docs if len(d["input_ids"]))
    assert stats.tokens == sum(lengths)


def test_a_source_of_only_empty_documents_gives_no_batches():
    docs = [{"input_ids": []} for _ in range(5)]
    batches, stats = _drain_pack_stats(docs, capacity=16, cp_size=2, layout="thd")
    assert batches == [] and (stats.documents, stats.skipped, stats.packs) == (5, 5, 0)


LONG = {1: 45, 4: 70}
"""Source index -> length of the documents longer than the capacity (32) in :func:`_long_docs`."""


def _long_docs() -> list[dict]:
    docs = good_docs(8)
    for i, n in LONG.items():
        docs[i] = {"input_ids": np.arange(1, n + 1)}
    return docs


@pytest.mark.parametrize("algorithm", ["bfd", "concat"])
@pytest.mark.parametrize("overflow", ["split", "truncate", "drop"])
def test_overlong_documents_follow_the_policy_and_are_counted(overflow, algorithm):
    docs = _long_docs()
    cap = 32
    batches, stats = _drain_pack_stats(docs, capacity=cap, cp_size=2, layout="thd", overflow=overflow,
                                       algorithm=algorithm)  # fmt: skip
    total = sum(len(d["input_ids"]) for d in docs)
    long_tokens = sum(LONG.values())
    assert stats.documents == len(docs)
    if overflow == "split":
        assert stats.tokens == total and stats.split >= len(LONG)
        if algorithm == "bfd":
            assert stats.split == len(LONG)
    elif overflow == "truncate":
        assert (stats.truncated, stats.truncated_tokens) == (len(LONG), long_tokens - cap * len(LONG))
        assert stats.tokens == total - stats.truncated_tokens
    else:
        assert (stats.dropped, stats.dropped_tokens) == (len(LONG), long_tokens)
        assert stats.tokens == total - long_tokens
    assert sum(_real_lengths(batches)) == stats.tokens
    assert stats.tokens + stats.truncated_tokens + stats.dropped_tokens == total  # reconciled exactly


def test_overlong_document_with_overflow_error_names_document_capacity_and_fix():
    # a list states its lengths (one len() per item): every overlong document is named when the pipeline is built
    message = error_of(lambda: build_node(_long_docs(), capacity=32, cp_size=2, cp_rank=0, layout="thd", plan=StreamPlan(overflow="error"), data=DataPolicy(dp_rank=1, dp_size=2)), ValueError)  # fmt: skip
    for part in ("document 1 has 45 tokens", "48 after aligning to a multiple of 4", "capacity=32",
                 "2 of 8 documents", "raise the capacity (to", "or pass overflow=", "'split'", "'truncate'", "'drop'"):
        assert part in message, (part, message)

    class Stream:  # a re-iterable of unknown lengths: checked as read, and the error says how to find them all
        def __iter__(self):
            return iter(_long_docs())

    message = error_of(lambda: first_batch(Stream(), overflow="error"), ValueError)
    for part in ("document 1 has 45 tokens", "capacity=32", "raise the capacity or pass overflow=",
                 "checked when it is read", "cpdata.plan_lengths(lengths", "cpdata.open_dataset(path)"):
        assert part in message, (part, message)


# ----------------------------------------------------------------------------- configuration


CONFIG_CASES = {
    "capacity_not_a_multiple": (dict(capacity=30), ValueError,
                                ["capacity=30", "not a multiple of 4", "'thd'", "cp_size=2", "use capacity 28 or 32"]),
    "capacity_below_2cp_for_thd": (dict(capacity=4, cp_size=4), ValueError,
                                   ["capacity=4", "multiple of 8", "'thd'", "cp_size=4", "use capacity 8"]),
    "round_robin_capacity": (dict(capacity=20, layout="round_robin", cp_size=4), ValueError,
                             ["capacity=20", "multiple of 8", "'round_robin'", "use capacity 16 or 24"]),
    "cp_size_zero": (dict(cp_size=0), ValueError, ["cp_size must be an int >= 1, got 0;", "use cp_size=1"]),
    "cp_size_negative": (dict(cp_size=-2, layout="contiguous"), ValueError, ["cp_size must be an int >= 1, got -2;"]),
    "cp_size_float": (dict(cp_size=2.0), TypeError, ["cp_size must be an int >= 1, got float 2.0;"]),
    "cp_rank_at_cp_size": (dict(cp_rank=2), ValueError, ["cp_rank=2", "[0, cp_size=2)"]),
    "cp_rank_negative": (dict(cp_rank=-1), ValueError, ["cp_rank=-1", "[0, cp_size=2)"]),
    "identity_with_cp": (dict(layout="identity"), ValueError,
                         ["needs cp_size=1, got cp_size=2", "'contiguous', 'round_robin', 'thd' or 'balanced'"]),
    "unknown_layout": (dict(layout="ring"), ValueError, ["'ring'", "balanced", "thd"]),
    "unknown_overflow": (dict(overflow="wrap"), ValueError, ["'wrap'", "'split'"]),
    "dp_rank_at_dp_size": (dict(dp_rank=2, dp_size=2), ValueError, ["dp_rank=2", "dp_size=2"]),
    "document_layout_with_bshd_rows": (dict(batch_size=2, qkv_format="bshd"), ValueError,
                                       ["'thd'", "2 rows", "use qkv_format='thd'", "batch_size=1"]),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_bad_configuration_is_refused_before_any_data_is_read(case):
    change, exc, parts = CONFIG_CASES[case]

    class Untouchable(list):
        def __getitem__(self, i):
            raise AssertionError("a refused configuration must not read the source")

    cfg = {**dict(capacity=32, cp_size=2, cp_rank=0, layout="thd"), **change}
    for build in (lambda: build_loader(Untouchable(good_docs()), **records(**cfg)),
                  lambda: CPDataset(Untouchable(good_docs()), **records(**cfg))):  # fmt: skip
        message = error_of(build, exc)
        missing = [p for p in parts if p not in message]
        assert not missing, f"message {message!r} lacks {missing}"


# ----------------------------------------------------------------------------- padding id inside the content


def stream(shards) -> dict[str, np.ndarray]:
    """Every rank's shard reassembled with ``gather_index``, flattened to the row-major stream."""
    gather = shards[0].layout.gather_index
    out = {}
    for key in shards[0]:
        if key in ("cu_seqlens", "cu_seqlens_padded", "seq_lens", "seq_lens_padded", "max_seqlen"):
            out[key] = shards[0][key].numpy()
        else:
            out[key] = torch.cat([s[key] for s in shards], dim=-1)[..., gather].reshape(-1).numpy()
    return out


PAD_CONTENT_DOCS = [[0, 5, 0, 0], [7, 0], [0], [0, 0, 0, 0, 0, 0, 0], [3, 4, 0, 7, 7, 1, 0, 2, 9], [7]]


@pytest.mark.parametrize("pad", [0, 7])
@pytest.mark.parametrize(("layout", "cp", "qkv_format", "batch_size"), [
    ("thd", 2, "thd", 2), ("thd", 2, "bshd", 1), ("balanced", 3, "thd", 2), ("round_robin", 2, "bshd", 2),
    ("contiguous", 4, "bshd", 1), ("identity", 1, "thd", 3),
])  # fmt: skip
def test_padding_id_in_the_content_does_not_matter(pad, layout, cp, qkv_format, batch_size):
    """Padding comes from the layout, never from token values: content equal to the pad id stays real."""
    docs = [{"input_ids": np.array(ids)} for ids in PAD_CONTENT_DOCS * 3]
    multiple = alignment(layout, cp)[1]
    capacity = multiple * -(-16 // multiple)
    graph = shard_graph(docs, GraphOptions(capacity=capacity, cp_size=cp, layout=layout, padding_token_id=pad, batch_size=batch_size, qkv_format=qkv_format, plan=StreamPlan(algorithm="next_fit")))  # fmt: skip
    found, pads, content_equal_to_pad = [], 0, 0
    for shards in ShardForRank(graph, cp_size=cp, cp_rank=0, layout=layout, all_ranks=True):
        s = stream(shards)
        real = np.zeros(s["input_ids"].size, dtype=bool)
        for start, n in zip(s["cu_seqlens_padded"][:-1].tolist(), s["seq_lens"].tolist(), strict=True):
            ids = s["input_ids"][start : start + n]
            found.append(ids.tolist())
            real[start : start + n] = True
            labels = s["labels"][start : start + n]
            assert labels[:-1].tolist() == ids[1:].tolist(), "the next token is the target, pad id or not"
            assert n == 0 or labels[-1] == -100
            assert s["position_ids"][start : start + n].tolist() == list(range(n))
        assert np.array_equal(s["padding_mask"], ~real), "padding_mask marks exactly the layout's padding"
        assert (s["input_ids"][~real] == pad).all() and (s["labels"][~real] == -100).all()
        pads += int((~real).sum())
        content_equal_to_pad += int((s["input_ids"][real] == pad).sum())
    assert sorted(found) == sorted(d["input_ids"].tolist() for d in docs)
    assert pads > 0 and content_equal_to_pad > 0, "the case must actually mix pad-valued content and padding"


# ----------------------------------------------------------------------------- state from elsewhere


CFG = dict(capacity=32, cp_size=2, cp_rank=0, layout="thd", window=4)


def _saved_state(docs, **kw) -> dict:
    with closing_loader(build_loader(docs, **records(**{**CFG, **kw}))) as loader:
        it = iter(loader)
        next(it), next(it)
        return loader.state_dict()


def _versioned(state: dict, path=()) -> list[tuple]:
    """Paths of every nested dict carrying a ``"version"`` (one per node of the graph)."""
    found = [path] if "version" in state else []
    for key, value in state.items():
        if isinstance(value, dict):
            found += _versioned(value, (*path, key))
    return found


def _set(state: dict, path: tuple, key: str, value) -> dict:
    state = copy.deepcopy(state)
    node = state
    for p in path:
        node = node[p]
    node[key] = value
    return state


def _restore_error(state: dict, docs, **kw) -> str:
    with closing_loader(build_loader(docs, **records(**{**CFG, **kw}))) as loader:
        loader.load_state_dict(state)
        return error_of(lambda: next(iter(loader)), ValueError)


def test_state_from_another_version_is_refused_at_every_node():
    docs = good_docs(40)
    state = _saved_state(docs)
    paths = _versioned(state)
    assert len(paths) >= 4, paths  # ShardForRank, Collate, Pack, Documents
    for path in paths:
        message = _restore_error(_set(state, path, "version", 99), docs)
        assert "version 99" in message and "this code reads version" in message, (path, message)
        assert "resume with that version or start from scratch" in message, (path, message)


@pytest.mark.parametrize(("change", "parts"), [
    (dict(overflow="truncate"), ["overflow='truncate'", "overflow='split'"]),
    (dict(algorithm="ffd"), ["algorithm='bfd'", "algorithm='ffd'"]),
    (dict(window=8), ["window=4", "window=8"]),
    (dict(dp_rank=1, dp_size=2), ["(dp_rank, dp_size)=(0, 1)", "(1, 2)", "same DP size"]),
    (dict(padding_token_id=3), ["'padding_token_id': 0", "'padding_token_id': 3", "resume with the same"]),
])  # fmt: skip
def test_state_from_another_configuration_is_refused(change, parts):
    docs = good_docs(40)
    state = _saved_state(docs, overflow="split")
    message = _restore_error(state, docs, **{"overflow": "split", **change})
    missing = [p for p in parts if p not in message]
    assert not missing, f"message {message!r} lacks {missing}"


def test_state_onto_another_dataset_is_refused():
    docs = good_docs(40)
    state = _saved_state(docs)
    message = _restore_error(state, good_docs(41))
    assert "length 40" in message and "length 41" in message and "same dataset" in message


def test_worker_state_from_another_configuration_is_refused_through_the_dataloader():
    """A refused restore inside a DataLoader worker reaches the training loop promptly, with its message."""
    docs = good_docs(60)
    kw = dict(capacity=32, cp_size=2, cp_rank=0, layout="thd", qkv_format="thd", window=4)

    def make(**over):
        return StatefulDataLoader(CPDataset(docs, **records(**{**kw, **over})), batch_size=None, num_workers=2,
                                  multiprocessing_context="fork")  # fmt: skip

    before = {p.pid for p in psutil.Process().children()}
    loader = make()
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    del it
    loader = make(capacity=64)
    loader.load_state_dict(state)
    start = time.monotonic()
    message = error_of(lambda: next(iter(loader)), ValueError)
    assert time.monotonic() - start < 5  # docs/bad-input.md: "asserted within 5 s"
    assert "capacity=32" in message and "capacity=64" in message and "worker" in message
    loader = None
    gc.collect()
    deadline = time.monotonic() + 10
    while {p.pid for p in psutil.Process().children()} - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not {p.pid for p in psutil.Process().children()} - before, "the workers were reaped"


# ----------------------------------------------------------------------------- device half, real gloo ranks


def _plans_disagree(rank: int, world: int) -> dict[str, str]:
    """Each rank builds its own pipeline; the consistency check must catch every disagreement."""
    docs = good_docs(60)
    kw = dict(capacity=32, cp_size=world, cp_rank=rank, layout="thd", prefetch=0, pin_memory=False)
    out = {}

    def check(name, batch):
        start = time.monotonic()
        try:
            verify_layout_consistency(batch, None, device="cpu")
            out[name] = "ok"
        except ValueError as err:
            out[name] = str(err)
        out[name + "_s"] = time.monotonic() - start

    check("agree", next(build_node(docs, **records(**kw))))
    check("other_seed_docs", next(build_node(good_docs(60, seed=rank), **records(**kw))))
    # Same shape (lengths, provenance, slots), other tokens: only the content tells the ranks apart.
    other_tokens = [{"input_ids": d["input_ids"] + 100 * rank} for d in docs]
    same_shape = next(build_node(other_tokens, **records(**kw)))
    out["same_shape"] = str(same_shape.info["real_tokens"] == next(build_node(docs, **records(**kw))).info["real_tokens"])
    check("same_shape_other_tokens", same_shape)
    node = build_node(docs, **records(**kw))
    if rank == 1:
        next(node)  # one step ahead, as after a resume from the wrong checkpoint
    check("one_step_off", next(node))
    rows = dict(batch_size=2, qkv_format="thd") if rank == 1 else {}
    check("other_length", next(build_node(docs, **records(**{**kw, **rows}))))  # a gather here would abort gloo

    # A tensor from another batch (wrong length for this layout): refused locally on every rank, before the
    # collective; the ranks stay in step and the next, correct gather works.
    batch = next(build_node(docs, **records(**kw)))
    local = batch["input_ids"].to(torch.float32)
    try:
        gather_token_tensor(local[..., :-1], batch.layout, None, seq_dim=-1)
        out["wrong_length"] = "ok"
    except ValueError as err:
        out["wrong_length"] = str(err)
    full = gather_token_tensor(local, batch.layout, None, seq_dim=-1)
    out["gathered_len"] = str(full.numel())

    # The same through the sharder: it keeps the last batch's layout; tensors of another batch are refused.
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    sharder = ContextParallelSharder(None, mesh, batch)
    sharder.shard(batch)
    for name, call in (("sharder_shard", lambda: sharder.shard_token_tensor(torch.zeros(1, 30))),
                       ("sharder_gather", lambda: sharder.gather_token_tensor(torch.zeros(1, 15)))):
        try:
            call()
            out[name] = "ok"
        except ValueError as err:
            out[name] = str(err)
    out["sharder_ok"] = str(sharder.gather_token_tensor(local).numel())

    # A layout built for another CP size than the process group.
    rows4 = rank_indices("contiguous", 2 * world, (), 8 * world)
    foreign = ShardLayout(local_token_global_indices=torch.from_numpy(rows4[rank]), padded_seq_len=rows4.size,
                          gather_index=torch.from_numpy(inverse_indices(rows4)), cp_size=2 * world, cp_rank=rank)
    try:
        gather_token_tensor(torch.zeros(4), foreign, None, seq_dim=0)
        out["other_cp_size"] = "ok"
    except ValueError as err:
        out["other_cp_size"] = str(err)
    return out


def test_disagreeing_ranks_raise_everywhere_and_nothing_hangs():
    start = time.monotonic()
    results = run_ranks(_plans_disagree, 2, timeout=60)
    assert time.monotonic() - start < 30
    for rank, r in enumerate(results):
        assert r["agree"] == "ok"
        assert r["same_shape"] == "True"
        for case in ("other_seed_docs", "same_shape_other_tokens", "one_step_off", "other_length"):
            assert "CP ranks received different shard plans" in r[case], (case, r[case])
            assert f"this rank (cp_rank {rank}) has digest" in r[case] and "same seed" in r[case]
            assert r[case + "_s"] < 3  # docs/bad-input.md: "asserted within 3 s per check"
        assert "local tensor has 15 tokens" in r["wrong_length"] and "covers 32 tokens" in r["wrong_length"]
        assert r["gathered_len"] == "32" and r["sharder_ok"] == "32"
        assert "padded_seq_len=32" in r["sharder_shard"] and "length 30 on dim 1" in r["sharder_shard"]
        assert "pre-pad it to padded_seq_len" in r["sharder_shard"]
        assert "local tensor has 15 tokens" in r["sharder_gather"] and "pass the shard of the batch" in r["sharder_gather"]
        assert "layout was built for cp_size=4" in r["other_cp_size"] and "group has size 2" in r["other_cp_size"]
