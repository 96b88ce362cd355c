"""Markdown rendering of a results dict: the benchmark tables of docs/benchmarks.md.

``render_markdown(results)`` (or ``cpdata bench --from-json PATH --markdown``): the targets, then one compact
table per section that ran (packing pivoted to a padding column per algorithm, balance to a p95 column per
layout, attention to a tile column per layout).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from cpdata.bench.runner import SECTIONS
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


def _attention(rows: list[dict]) -> str:
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


Cell = str | Callable[[Any], str]
"""How a column shows its value: a ``str.format`` template or a function (without one: as it is)."""

TABLES: dict[str, tuple[str, tuple[tuple, ...]]] = {
    "step_shard": ("**Per-step sharding** (rank 0, device `{device}`)", (
        ("layout", "layout"), ("cp", "cp_size"), ("tokens", "tokens", _tokens),
        ("anchor ms", "anchor_ms", "{:.3f}"), ("cpdata ms", "cpdata_ms", "{:.3f}"),
        ("of which copy ms", "copy_ms", "{:.3f}"),
        ("speedup", "speedup", "{:.1f}x"), ("anchor H2D", "anchor_h2d_bytes", _bytes),
        ("cpdata H2D", "cpdata_h2d_bytes", _bytes), ("layout maps", "layout_bytes", _bytes))),
    "worker": ("**Worker** (pack + collate + shard on one core, one rank's output; anchor: in-step collate + "
               "shard of the same pack)", (
        ("layout", "layout"), ("cp", "cp_size"), ("capacity", "capacity", _tokens),
        ("cpdata us/pack", "cpdata_us_per_pack", "{:.0f}"), ("anchor us/pack", "anchor_host_us", "{:.0f}"),
        ("paired ratio", worker_ratio, "{:.2f}"), ("ns/token", "ns_per_pack_token", "{:.1f}"),
        ("tokens/s", "tokens_per_s", lambda v: f"{v / 1e6:.1f}M"),
        ("of memcpy", "fraction_of_memcpy", "{:.3g}"))),
    "handoff": ("**Handoff** (main-process CPU per batch from a StatefulDataLoader worker)", (
        ("sharing strategy", "strategy"), ("tokens", "tokens", _tokens), ("storages", "storages_per_batch"),
        ("receive ms", "receive_ms_per_batch", "{:.3f}"), ("dict storages", "baseline_storages_per_batch"),
        ("dict receive ms", "baseline_receive_ms_per_batch", "{:.3f}"), ("ratio", "ratio", "{:.2f}"))),
    "gather": ("**Gather** (forward + backward, gloo on CPU; collectives counted per call)", (
        ("cp", "cp_size"), ("tokens", "tokens", _tokens), ("hidden", "hidden"),
        ("anchor collectives", "collectives_anchor"), ("cpdata collectives", "collectives_cpdata"),
        ("anchor ms", "anchor_ms", "{:.1f}"), ("cpdata ms", "cpdata_ms", "{:.1f}"),
        ("speedup", "speedup", "{:.2f}x"))),
    "long_document": ("**Long document** (JSONL, thd, cp 2, capacity 32K, split; one epoch, rank 0)", (
        ("long document tokens", "doc_tokens", "{:,}"), ("pieces", "pieces"), ("packs", "packs"),
        ("online s/epoch", "online_s", "{:.2f}"), ("offline s/epoch", "offline_s", "{:.2f}"),
        ("offline/online", "ratio", "{:.2f}x"), ("precompute s", "precompute_s", "{:.2f}"))),
    "schedule": ("**Scheduling across DP ranks** (FlexSP 7B cost model; mean over {batches}+ global "
                 "batches)", (
        ("dist", "distribution"), ("dp", "dp_size"), ("mb", "micro_batches"), ("method", "method"),
        ("imb_step %", "imb_step_mean", "{:.2f}"), ("imb_mb %", "imb_mb_mean", "{:.2f}"),
        ("imb_mb p95 %", "imb_mb_p95", "{:.2f}"), ("over cap %", "over_cap_pct", "{:.1f}"),
        ("extra mb %", "extra_microbatch_pct", "{:.1f}"), ("padding %", "padding_pct", "{:.2f}"),
        ("max delay", "max_delay_steps"), ("us/doc", "us_per_doc", "{:.1f}"))),
    "world": ("**World as one CP group** (sums over micro-batches of each one's busiest rank; step: the rank whose "
              "sum is largest; 8 ranks per node)", (
        ("distribution", "distribution"), ("world", "world"), ("system", "system"),
        ("micro-batches", "micro_batches"), ("busiest tiles", "tiles"),
        ("÷ mean rank", "over_mean", "{:.3f}"), ("busiest K/V recv", "recv_keys"),
        ("busiest inter-node K/V", "inter_keys"), ("step: busiest rank's tiles", "step_tiles"),
        ("step ÷ mean rank", "step_over_mean", "{:.3f}"), ("step: most K/V recv", "step_recv_keys"),
        ("step: most inter-node K/V", "step_inter_keys"), ("fill", "fill", "{:.3f}"),
        ("predicted ms", "predicted_ms", "{:.1f}"), ("step: predicted ms", "step_predicted_ms", "{:.1f}"),
        ("step: most calls", "step_calls"), ("solve ms / micro-batch", "solve_ms", "{:.2f}"))),
    "integrity": ("**Token store checks** (a reading pass, document by document; 1 MiB chunks hashed on "
                  "first read)", (
        ("store", "store"), ("tokens", "tokens", lambda v: f"{v / 1e6:.0f}M"), ("chunks", "chunks"),
        ("unchecked s", "plain_s", "{:.3f}"), ("first read s", "first_s", "{:.3f}"),
        ("unchecked again s", "warm_s", "{:.3f}"), ("checked s", "checked_s", "{:.3f}"),
        ("overhead %", "overhead_pct", "{:+.1f}"), ("steady %", "steady_pct", "{:+.1f}"),
        ("verify GB/s", "verify_gb_s", "{:.1f}"))),
}  # fmt: skip
"""Sections shown one row per result row: the title, then per column ``(header, column name or function of
the row, optional`` :data:`Cell` ``)``."""


def _table(name: str, rows: list[dict], device: str) -> str:
    """Section ``name``'s :data:`TABLES` table; a column a row lacks shows empty."""
    title, columns = TABLES[name]

    def cell(row: dict, key: str | Callable[[dict], Any], *show: Cell) -> Any:
        if isinstance(key, str) and key not in row:
            return ""
        value = row[key] if isinstance(key, str) else key(row)
        if not show:
            return value
        return show[0].format(value) if isinstance(show[0], str) else show[0](value)

    title = title.format(device=device, batches=min(r.get("batches", 0) for r in rows))
    body = [[cell(r, *column[1:]) for column in columns] for r in rows]
    return f"{title}\n\n" + markdown_table([column[0] for column in columns], body)


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
    pivots: dict[str, Callable[[list[dict]], str]] = {
        "packing": lambda rows: _packing(rows, str(results.get("default_algorithm", "bfd"))), "balance": _balance,
        "attention": _attention,
    }
    parts += [pivots[name](results[name]) if name in pivots else _table(name, results[name], m["device"])
              for name in SECTIONS if results.get(name)]  # run order: that of docs/benchmarks.md
    return "\n\n".join(parts) + "\n"
