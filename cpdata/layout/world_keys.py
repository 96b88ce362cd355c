"""The K/V a ``world`` deal moves: its exchange plan from the deal's runs, and each rank's keys split into
intra-node and inter-node ones (what the links of :mod:`cpdata.layout.world_cost` carry)."""

from __future__ import annotations

import numpy as np

from cpdata.layout.exchange import ExchangePlan, exchange_plan_of_runs
from cpdata.layout.spans import SpanTable

__all__ = ["node_recv", "world_exchange"]


def world_exchange(table: SpanTable, real_lens: np.ndarray | None = None) -> ExchangePlan:
    """The K/V exchange plan of one pack's deal, from its runs (no pass over the tokens); ``real_lens`` int64
    ``[D]`` (None: the slots are all real, the pack's tail is padding). Empty slots hold no key: left out."""
    lens = table.lens
    real = lens if real_lens is None else np.asarray(real_lens, dtype=np.int64)[: lens.shape[0]]
    kept = lens > 0
    starts, ends = table.doc_starts[kept], (table.doc_starts + real)[kept]
    if not starts.shape[0]:
        starts = ends = np.zeros(1, np.int64)
    local = table.pack_len // table.cp_size
    return exchange_plan_of_runs(*table.spans(), cp_size=table.cp_size, local_len=local, slot_starts=starts,
                                 real_ends=ends)  # fmt: skip


def node_recv(plan: ExchangePlan, node_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(intra, inter)`` int64 ``[cp]``: keys each rank receives from ranks of its own node, and of others
    (rank ``r`` lies in node ``r // node_size``)."""
    counts = plan.recv_counts()  # [dst, src]
    node = np.arange(plan.cp_size) // node_size
    same = node[:, None] == node[None, :]
    return (counts * same).sum(axis=1), (counts * ~same).sum(axis=1)
