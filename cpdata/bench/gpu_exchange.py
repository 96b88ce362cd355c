"""GPU check part: the K/V exchange against the all-gather on NCCL, one GPU per rank (needs >= 2 GPUs).

Each rank holds its shard of ``cat(K, V)`` of one layer, bf16 ``[1, 8, 8192, 256]``, of a ``tiled`` pack of
``sft`` and ``long_context`` at ``8192 * cp`` tokens (``cp`` = the GPUs, at most 8). Forward + backward,
median of 5: :func:`cpdata.device.kv_exchange.exchange_tokens` against
:func:`cpdata.gather.gather_token_tensor`; bytes: what the busiest rank receives forward.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["DISTRIBUTIONS", "run"]

KV_HEADS, KV_DIM, LOCAL, REPEATS = 8, 256, 8192, 5
DISTRIBUTIONS = ("sft", "long_context")


def _batches(world: int, distribution: str) -> tuple:
    from cpdata.bench.distributions import sample, split_graph, token_documents
    from cpdata.nodes.shard import ShardForRank

    lens = sample(distribution, 4096, 0)
    lens = lens[: int(np.searchsorted(np.cumsum(lens), 3 * LOCAL * world)) + 1]
    docs = token_documents(lens, low=1, high=1000)
    graph = split_graph(docs, LOCAL * world, world, "tiled")
    return next(iter(ShardForRank(graph, cp_size=world, cp_rank=0, layout="tiled", all_ranks=True,
                                  kv_exchange=True)))  # fmt: skip


def _rank(rank: int, world: int, device: str = "cuda") -> list[dict]:
    import torch.distributed as dist

    from cpdata.bench.gpu_attention import time_step
    from cpdata.device.kv_exchange import exchange_tokens
    from cpdata.gather import gather_token_tensor

    out = []
    for distribution in DISTRIBUTIONS:
        layout = _batches(world, distribution)[rank].layout  # carries its inverse: no index collective
        n_recv = int(layout.kv_exchange.n_recv)
        kv = torch.randn(1, KV_HEADS, LOCAL, KV_DIM, device=device, dtype=torch.bfloat16, requires_grad=True)
        g_ex = torch.randn(1, KV_HEADS, LOCAL + n_recv, KV_DIM, device=device, dtype=torch.bfloat16)
        g_ag = torch.randn(1, KV_HEADS, LOCAL * world, KV_DIM, device=device, dtype=torch.bfloat16)
        dist.barrier()
        exchange = time_step(lambda: exchange_tokens(kv, layout, None, seq_dim=2).backward(g_ex), REPEATS)  # noqa: B023
        dist.barrier()
        gather = time_step(lambda: gather_token_tensor(kv, layout, None, seq_dim=2).backward(g_ag),  # noqa: B023
                           REPEATS)  # fmt: skip
        token_bytes = KV_HEADS * KV_DIM * 2
        out.append({"distribution": distribution, "rank": rank, "exchange_ms": 1e3 * exchange,
                    "all_gather_ms": 1e3 * gather, "exchange_recv_bytes": n_recv * token_bytes,
                    "all_gather_recv_bytes": (world - 1) * LOCAL * token_bytes})  # fmt: skip
    return out


def run() -> dict:
    """``{"cp_size": cp, "rows": [...]}``: per distribution the busiest rank's times and bytes."""
    from cpdata.bench.ranks import run_on_ranks

    gpus = torch.cuda.device_count()
    if gpus < 2:
        raise RuntimeError(f"needs >= 2 GPUs, found {gpus}")
    world = min(gpus, 8)
    per_rank = run_on_ranks(_rank, world, timeout=300, backend="nccl", start_method="spawn")
    keys = ("exchange_ms", "all_gather_ms", "exchange_recv_bytes", "all_gather_recv_bytes")
    rows = [{"distribution": name, "cp_size": world, **{k: max(r[i][k] for r in per_rank) for k in keys}}
            for i, name in enumerate(DISTRIBUTIONS)]
    return {"cp_size": world, "rows": rows}
