"""The "cpdata" attention with kernel="varlen" at cp 2 and 4 on gloo, against each document alone.

torch's ``varlen_attn`` is swapped for the exact reference
(:func:`cpdata.device.varlen.reference_varlen_attn`, itself checked
against brute force in tests/test_varlen.py) inside each rank, so the code
under test is everything around the kernel: the segments of the rank's
queries, ``cu_seq_q`` / ``cu_seq_k``, the gather of each segment's keys from
the own and exchanged keys (or the all-gathered ones), the window and GQA
arguments. The copy limit that sends token-cut layouts to the fallback is
lifted here, so ``balanced`` (one segment per query) runs through varlen too.
Every family of tests/hf_zoo.py on every layout (``tiled`` with
tile 64), keys exchanged and all-gathered; the ranks' summed loss and
gradients must equal every document run alone through HF's own attention
(< 1e-6 relative). Gemma 2 (softcap) and gpt-oss (sinks) must take the
fallback (dense on CPU), log why, and never call the kernel; a rank holding
only pad never calls it either (its trailing pad is not run).
"""

from __future__ import annotations

import logging

import pytest
import torch.distributed as dist
import torch.nn.attention.varlen as torch_varlen

from cpdata.adapters import hf_model_kwargs, register_hf_attention
from cpdata.bench.hf_reference import full_pack
from cpdata.device import varlen
from cpdata.nodes.loader import GraphOptions, shard_graph
from cpdata.nodes.options import StreamPlan
from cpdata.nodes.shard import ShardForRank
from tests import hf_zoo
from tests.dist_utils import run_ranks
from tests.hf_zoo import FAMILIES, build, error_against_alone
from tests.test_hf_attention_dist import _summed
from tests.test_varlen import FALLBACK, LAYOUTS, CountingReference


def _pack(cp: int, layout: str, exchange: bool) -> tuple:
    """Every rank's batch of the first pack holding at least three documents."""
    spec = "tiled:64" if layout == "tiled" else layout
    graph = shard_graph(hf_zoo.docs(), GraphOptions(capacity=64 * cp, cp_size=cp, layout=spec,
                        qkv_format="thd" if layout == "thd" else "bshd", plan=StreamPlan(overflow="split")))  # fmt: skip
    for batches in ShardForRank(graph, cp_size=cp, cp_rank=0, layout=spec, all_ranks=True, kv_exchange=exchange):
        if batches[0].info["n_documents"] >= 3:
            return batches
    raise AssertionError("no pack with three documents")


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _rank(rank: int, world: int) -> list:
    kernel = CountingReference()
    torch_varlen.varlen_attn = kernel  # this forked rank's torch: the reference behind the same call
    varlen._LOGGED.clear()  # a fresh process's log-once state (the rank is forked from the test process)
    varlen.MAX_KEY_COPIES = 10**9  # balanced's one-query segments too: the most fragmented plan stays on varlen
    records = _Records()
    logging.getLogger("cpdata.device.varlen").addHandler(records)
    register_hf_attention("cpdata_varlen", kernel="varlen")
    out = []
    for family in FAMILIES:
        model = build(family, "cpdata_varlen")
        for layout in LAYOUTS:
            for exchange in (True, False):
                batches = _pack(world, layout, exchange)
                n = int(sum(int((b["labels"] != -100).sum()) for b in batches))
                kwargs = hf_model_kwargs(batches[rank], "cpdata_varlen", group=dist.group.WORLD,
                                         num_items_in_batch=n)  # fmt: skip
                model.zero_grad(set_to_none=True)
                before = kernel.calls
                loss, summed = _summed(model, kwargs)
                calls = kernel.calls - before
                all_pad = bool(batches[rank]["padding_mask"].all())  # its trailing pad only: nothing to run
                want = 0 if family in FALLBACK or all_pad else model.config.num_hidden_layers
                assert calls == want, (family, layout, calls)
                if rank == 0:
                    out.append((family, layout, exchange, loss, summed, full_pack(batches)))
    logged = {reason: sum(reason in m for m in records.messages) for reason in FALLBACK.values()}
    assert logged == {reason: 1 for reason in FALLBACK.values()}, records.messages
    return out if rank == 0 else []


@pytest.mark.parametrize("cp", [2, 4])
def test_varlen_segments_give_each_document_alone(cp):
    results = run_ranks(_rank, cp, timeout=900)[0]
    assert len(results) == len(FAMILIES) * len(LAYOUTS) * 2
    refs: dict[tuple, tuple] = {}
    worst: dict[str, float] = {}
    for family, layout, exchange, loss, g, full in results:
        err, n_docs = error_against_alone(family, full, loss, g, refs)
        assert err < 1e-6 and n_docs >= 3, (family, layout, exchange, cp, err)
        worst[family] = max(worst.get(family, 0.0), err)
    print(f"cp {cp}, varlen: max relative error per family over {list(LAYOUTS)} x (exchange, all-gather): "
          + ", ".join(f"{f} {e:.1e}" for f, e in worst.items()))  # fmt: skip
