"""Markdown rendering of a results dict: the benchmark tables of docs/benchmarks.md.

``render_markdown(results)`` (or ``cpdata bench --from-json PATH --markdown``): the targets, then one compact
table per section that ran (packing pivoted to a padding column per algorithm, balance to a p95 column per
layout, attention to a tile column per layout).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cpdata.bench.table import markdown_table
from cpdata.bench.worker_throughput import worker_ratio

__all__ = ["render_markdown"]


def _bytes(n: float) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _step(rows: list[dict], device: str) -> str:
    body = [(r["layout"], r["cp_size"], _tokens(r["tokens"]), f"{r['anchor_ms']:.3f}", f"{r['cpdata_ms']:.3f}",
             f"{r['copy_ms']:.3f}" if "copy_ms" in r else "", f"{r['speedup']:.1f}x", _bytes(r["anchor_h2d_bytes"]),
             _bytes(r["cpdata_h2d_bytes"]), _bytes(r["layout_bytes"])) for r in rows]  # fmt: skip
    head = ("layout", "cp", "tokens", "anchor ms", "cpdata ms", "of which copy ms", "speedup", "anchor H2D",
            "cpdata H2D", "layout maps")
    return f"**Per-step sharding** (rank 0, device `{device}`)\n\n" + markdown_table(head, body)


def _worker(rows: list[dict]) -> str:
    body = [(r["layout"], r["cp_size"], _tokens(r["capacity"]), f"{r['cpdata_us_per_pack']:.0f}",
             f"{r['anchor_host_us']:.0f}", f"{worker_ratio(r):.2f}",
             f"{r['ns_per_pack_token']:.1f}", f"{r['tokens_per_s'] / 1e6:.1f}M", f"{r['fraction_of_memcpy']:.3g}")
            for r in rows]  # fmt: skip
    head = ("layout", "cp", "capacity", "cpdata us/pack", "anchor us/pack", "paired ratio", "ns/token", "tokens/s",
            "of memcpy")
    return ("**Worker** (pack + collate + shard on one core, one rank's output; anchor: in-step collate + shard "
            "of the same pack)\n\n" + markdown_table(head, body))


def _handoff(rows: list[dict]) -> str:
    body = [(r["strategy"], _tokens(r["tokens"]), r["storages_per_batch"], f"{r['receive_ms_per_batch']:.3f}",
             r["baseline_storages_per_batch"], f"{r['baseline_receive_ms_per_batch']:.3f}", f"{r['ratio']:.2f}")
            for r in rows]  # fmt: skip
    head = ("sharing strategy", "tokens", "storages", "receive ms", "dict storages", "dict receive ms", "ratio")
    title = "**Handoff** (main-process CPU per batch from a StatefulDataLoader worker)"
    return f"{title}\n\n" + markdown_table(head, body)


def _packing(rows: list[dict], default: str) -> str:
    algorithms = [default] + sorted({r["algorithm"] for r in rows} - {default})
    keys = list(dict.fromkeys((r["distribution"], r["capacity"]) for r in rows))
    by = {(r["distribution"], r["capacity"], r["algorithm"]): r for r in rows}
    body = []
    for dist, cap in keys:
        first = next(r for r in rows if (r["distribution"], r["capacity"]) == (dist, cap))
        pads = [f"{by[(dist, cap, a)]['padding_pct']:.3f}" if (dist, cap, a) in by else "" for a in algorithms]
        us = by[(dist, cap, default)]["us_per_doc"] if (dist, cap, default) in by else float("nan")
        body.append((dist, _tokens(cap), f"{first['lower_bound_pct']:.3f}", *pads, f"{us:.2f}"))
    head = ("distribution", "capacity", "lower bound %", *[f"{a} %" for a in algorithms], f"{default} us/doc")
    return "**Packing** (padding % of pack tokens)\n\n" + markdown_table(head, body)


def _balance(rows: list[dict]) -> str:
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    keys = list(dict.fromkeys((r["distribution"], r["cp_size"]) for r in rows))
    by = {(r["distribution"], r["cp_size"], r["layout"]): r for r in rows}
    body = []
    for dist, cp in keys:
        p95 = [f"{by[(dist, cp, lay)]['imbalance_p95']:.3f}" if (dist, cp, lay) in by else "" for lay in layouts]
        thd = by.get((dist, cp, "thd"))
        body.append((dist, cp, *p95, f"{thd['doc_pad_pct']:.3f}" if thd else ""))
    head = ("distribution", "cp", *[f"{lay} p95" for lay in layouts], "thd doc pad %")
    title = "**Load balance** (max ÷ mean causal work per rank, p95 over packs)"
    return f"{title}\n\n" + markdown_table(head, body)


def _gather(rows: list[dict]) -> str:
    body = [(r["cp_size"], _tokens(r["tokens"]), r["hidden"], r["collectives_anchor"], r["collectives_cpdata"],
             f"{r['anchor_ms']:.1f}", f"{r['cpdata_ms']:.1f}", f"{r['speedup']:.2f}x") for r in rows]
    head = ("cp", "tokens", "hidden", "anchor collectives", "cpdata collectives", "anchor ms", "cpdata ms",
            "speedup")
    title = "**Gather** (forward + backward, gloo on CPU; collectives counted per call)"
    return f"{title}\n\n" + markdown_table(head, body)


def _long_document(rows: list[dict]) -> str:
    body = [(f"{r['doc_tokens']:,}", r["pieces"], r["packs"], f"{r['online_s']:.2f}", f"{r['offline_s']:.2f}",
             f"{r['ratio']:.2f}x", f"{r['precompute_s']:.2f}") for r in rows]
    head = ("long document tokens", "pieces", "packs", "online s/epoch", "offline s/epoch", "offline/online",
            "precompute s")
    title = "**Long document** (JSONL, thd, cp 2, capacity 32K, split; one epoch, rank 0)"
    return f"{title}\n\n" + markdown_table(head, body)


def _schedule(rows: list[dict]) -> str:
    body = [(r["distribution"], r["dp_size"], r["micro_batches"], r["method"], f"{r['imb_step_mean']:.2f}",
             f"{r['imb_mb_mean']:.2f}", f"{r['imb_mb_p95']:.2f}", f"{r['over_cap_pct']:.1f}",
             f"{r['extra_microbatch_pct']:.1f}", f"{r['padding_pct']:.2f}", r["max_delay_steps"],
             f"{r['us_per_doc']:.1f}") for r in rows]  # fmt: skip
    head = ("dist", "dp", "mb", "method", "imb_step %", "imb_mb %", "imb_mb p95 %", "over cap %", "extra mb %",
            "padding %", "max delay", "us/doc")
    return ("**Scheduling across DP ranks** (FlexSP 7B cost model; mean over "
            f"{min(r['batches'] for r in rows)}+ global batches)\n\n" + markdown_table(head, body))


def _integrity(rows: list[dict]) -> str:
    body = [(r["store"], f"{r['tokens'] / 1e6:.0f}M", r["chunks"], f"{r['plain_s']:.3f}", f"{r['first_s']:.3f}",
             f"{r['warm_s']:.3f}", f"{r['checked_s']:.3f}", f"{r['overhead_pct']:+.1f}", f"{r['steady_pct']:+.1f}",
             f"{r['verify_gb_s']:.1f}") for r in rows]  # fmt: skip
    head = ("store", "tokens", "chunks", "unchecked s", "first read s", "unchecked again s", "checked s",
            "overhead %", "steady %", "verify GB/s")
    return ("**Token store checks** (a reading pass, document by document; 1 MiB chunks hashed on first read)\n\n"
            + markdown_table(head, body))


def _attention(rows: list[dict]) -> str:
    """One row per (distribution, capacity, cp, tile): each layout's busiest-rank tiles over the ideal, then
    ``tiled``'s K/V received (over an all-gather's) and solve time."""
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    keys = list(dict.fromkeys((r["distribution"], r["capacity"], r["cp_size"], r["tile"]) for r in rows))
    by = {(r["distribution"], r["capacity"], r["cp_size"], r["tile"], r["layout"]): r for r in rows}
    body = []
    for key in keys:
        tiles = [f"{by[(*key, lay)]['tiles_max_over_ideal']:.3f}" if (*key, lay) in by else "" for lay in layouts]
        mine = by.get((*key, "tiled"))
        extra = (f"{mine['kv_recv_fraction']:.2f}", f"{mine['solve_us_per_pack']:.0f}") if mine else ("", "")
        body.append((key[0], f"{key[1] // 1024}K", key[2], key[3], *tiles, *extra))
    head = ("distribution", "capacity", "cp", "tile", *layouts, "tiled K/V recv", "tiled solve us")
    return ("**Kernel tiles** (busiest rank's live tiles ÷ ideal, mean over packs; `tiled`'s K/V to receive ÷ "
            "all-gather's)\n\n" + markdown_table(head, body))  # fmt: skip


def _world(rows: list[dict]) -> str:
    """One row per (distribution, world, system): sums over micro-batches of the busiest rank's tiles, keys
    and predicted time, and the solve time per world micro-batch."""
    body = [(r["distribution"], r["world"], r["system"], r["micro_batches"], r["tiles"], f"{r['over_mean']:.3f}",
             r["recv_keys"], r["inter_keys"], f"{r['predicted_ms']:.1f}", f"{r['solve_ms']:.2f}")
            for r in rows]  # fmt: skip
    head = ("distribution", "world", "system", "micro-batches", "busiest tiles", "÷ mean rank", "busiest K/V recv",
            "busiest inter-node K/V", "predicted ms", "solve ms / micro-batch")  # fmt: skip
    return ("**World as one CP group** (sums over micro-batches of the busiest rank; 8 ranks per node)\n\n"
            + markdown_table(head, body))


def render_markdown(results: Mapping[str, Any]) -> str:
    """The benchmark tables (docs/benchmarks.md) for ``results`` (the dict ``cpdata bench --json`` writes)."""
    m, runs = results["machine"], int(results.get("runs", 1))
    flags = f"{' --quick' if results.get('quick') else ''}{f' --runs {runs}' if runs > 1 else ''}"
    parts = [
        f"Measured by `cpdata bench{flags}` on {m['cpu_model']} ({m['cores']} cores), "
        f"torch {m['torch_version']}, device `{m['device']}`"
        f"{', freed heap kept (`cpdata.keep_heap`)' if m.get('keep_heap') else ''}.",
    ]
    if results.get("targets"):
        parts.append(markdown_table(("target", "rule", "measured", "met"),
                         [(t["target"], t["rule"], t["measured"], "yes" if t["met"] else "**no**")
                          for t in results["targets"]]))
    sections: dict[str, Any] = {
        "step_shard": lambda rows: _step(rows, m["device"]), "worker": _worker, "handoff": _handoff,
        "packing": lambda rows: _packing(rows, str(results.get("default_algorithm", "bfd"))), "balance": _balance,
        "gather": _gather, "long_document": _long_document, "schedule": _schedule, "attention": _attention,
        "world": _world, "integrity": _integrity,
    }  # in the order of docs/benchmarks.md
    parts += [render(results[name]) for name, render in sections.items() if results.get(name)]
    return "\n\n".join(parts) + "\n"
