"""The benchmark's targets (:data:`TARGETS`: section, name, rule, check), checked against a results dict.

Each check returns ``(measured text, met)``; targets of sections that did not run are left out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from cpdata.bench.worker_throughput import worker_ratio

__all__ = ["TARGETS", "evaluate_targets"]


def _step_speedup(rows: list[dict]) -> tuple[str, bool]:
    hits = [r for r in rows if r["tokens"] == 32768 and r["cp_size"] == 4]
    if not hits:
        return "no row at 32K tokens, cp 4", False
    worst = min(r["speedup"] for r in hits)
    return ", ".join(f"{r['layout']} {r['speedup']:.1f}x" for r in hits), worst >= 20


def _h2d(rows: list[dict]) -> tuple[str, bool]:
    ratio = max(r["cpdata_h2d_bytes"] * r["cp_size"] / r["anchor_h2d_bytes"] for r in rows)
    return f"worst cpdata / (anchor / cp) = {ratio:.4f}", ratio <= 1.02


def _worker(rows: list[dict]) -> tuple[str, bool]:
    mine = [r for r in rows if r["capacity"] >= 8192 and r["cp_size"] <= 8]
    if not mine:
        return "no row at capacity >= 8K, cp <= 8", False
    worst = max(mine, key=worker_ratio)
    ratio = worker_ratio(worst)
    return (f"max {ratio:.2f} x anchor ({worst['layout']}, cp {worst['cp_size']}, capacity {worst['capacity']}: "
            f"medians {worst['cpdata_us_per_pack']:.0f} vs {worst['anchor_host_us']:.0f} us)"), ratio <= 0.3


def _worker_token(rows: list[dict]) -> tuple[str, bool]:
    hits = [r for r in rows if r["capacity"] == 32768 and r["cp_size"] == 4 and r["layout"] in ("thd", "balanced")]
    if not hits:
        return "no thd/balanced row at 32K, cp 4", False
    return (", ".join(f"{r['layout']} {r['ns_per_pack_token']:.1f} ns" for r in hits),
            max(r["ns_per_pack_token"] for r in hits) <= 12)


def _storages(rows: list[dict]) -> tuple[str, bool]:
    got = sorted({r["storages_per_batch"] for r in rows})
    base = sorted({r["baseline_storages_per_batch"] for r in rows})
    return f"cpdata {got}, plain dict {base}", got == [1]


def _handoff(rows: list[dict]) -> tuple[str, bool]:
    mine = [r for r in rows if r["strategy"] == "file_descriptor"] or rows
    ratio = max(r["receive_ms_per_batch"] / r["baseline_receive_ms_per_batch"] for r in mine)
    text = "; ".join(f"{r['strategy']} {r['receive_ms_per_batch']:.3f} vs {r['baseline_receive_ms_per_batch']:.3f} ms"
                     for r in rows)  # fmt: skip
    return f"{text} (ratio {ratio:.2f})", ratio <= 0.8


def _default_rows(rows: list[dict], default: str) -> list[dict]:
    return [r for r in rows if r["algorithm"] == default]


def _padding(rows: list[dict], default: str) -> tuple[str, bool]:
    mine = _default_rows(rows, default)
    worst = max(mine, key=lambda r: r["padding_pct"] - r["lower_bound_pct"])
    gap = worst["padding_pct"] - worst["lower_bound_pct"]
    return f"max gap {gap:.3f} pp ({worst['distribution']}, capacity {worst['capacity']})", gap <= 0.1


def _packing_speed(rows: list[dict], default: str) -> tuple[str, bool]:
    worst = max(_default_rows(rows, default), key=lambda r: r["us_per_doc"])
    return (f"max {worst['us_per_doc']:.2f} us/doc ({worst['distribution']}, capacity {worst['capacity']})",
            worst["us_per_doc"] <= 2.0)


def _balance(rows: list[dict]) -> tuple[str, bool]:
    mine = [r for r in rows if r["layout"] == "balanced"]
    worst = max(mine, key=lambda r: r["imbalance_p95"])
    pad = max(r["doc_pad_pct"] for r in mine)
    equal = all(r["equal_tokens"] for r in mine)
    text = (f"max p95 {worst['imbalance_p95']:.4f} ({worst['distribution']}, cp {worst['cp_size']}), "
            f"doc_pad_pct max {pad:g}, equal tokens {'yes' if equal else 'no'}")
    return text, worst["imbalance_p95"] <= 1.005 and pad == 0 and equal


def _gather(rows: list[dict]) -> tuple[str, bool]:
    pairs = sorted({(r["collectives_cpdata_fwd"], r["collectives_cpdata_bwd"]) for r in rows})
    anchor = sorted({(r["collectives_anchor_fwd"], r["collectives_anchor_bwd"], r["cp_size"]) for r in rows})
    text = ("cpdata fwd/bwd " + ", ".join(f"{f}/{b}" for f, b in pairs) + "; anchor fwd/bwd "
            + ", ".join(f"{f}/{b} (cp {c})" for f, b, c in anchor))
    return text, pairs == [(1, 1)]


def _long_document(rows: list[dict]) -> tuple[str, bool]:
    worst = max(rows, key=lambda r: r["ratio"])
    return (f"offline {worst['offline_s']:.2f} s vs online {worst['online_s']:.2f} s per epoch "
            f"({worst['ratio']:.2f}x, {worst['doc_tokens']:,} tokens in {worst['pieces']} pieces)", worst["ratio"] <= 2)


def _schedule_row(rows: list[dict], dist: str, dp: int, method: str) -> dict | None:
    return next((r for r in rows if (r["distribution"], r["dp_size"], r["method"]) == (dist, dp, method)), None)


def _schedule_d1(rows: list[dict]) -> tuple[str, bool]:
    r = _schedule_row(rows, "D1", 8, "cpdata_schedule")
    if r is None:
        return "no D1 dp 8 row", False
    pad_gap = r["padding_pct"] - r["bfd_padding_pct"]
    text = (f"imb_mb {r['imb_mb_mean']:.2f} / p95 {r['imb_mb_p95']:.2f}, imb_step {r['imb_step_mean']:.2f}, "
            f"over-cap {r['over_cap_pct']:g}, extra mb {r['extra_microbatch_pct']:g}, padding - bfd {pad_gap:+.3f} pp")
    ok = (r["imb_mb_mean"] <= 0.7 and r["imb_mb_p95"] <= 1.0 and r["imb_step_mean"] <= 0.5
          and r["over_cap_pct"] == 0 and r["extra_microbatch_pct"] == 0 and pad_gap <= 0.05)  # fmt: skip
    return text, ok


def _schedule_d2(rows: list[dict]) -> tuple[str, bool]:
    r = _schedule_row(rows, "D2", 8, "cpdata_schedule_delay4")
    if r is None:
        return "no D2 dp 8 max_delay 4 row", False
    early = r.get("min_delay_steps", 0)
    text = (f"imb_mb {r['imb_mb_mean']:.2f} / p95 {r['imb_mb_p95']:.2f}, delay {early}..{r['max_delay_steps']} "
            "steps after FIFO")
    return text, r["imb_mb_mean"] <= 2.5 and r["imb_mb_p95"] <= 6.0 and -1 <= early and r["max_delay_steps"] <= 4


def _schedule_speed(rows: list[dict]) -> tuple[str, bool]:
    worst = max((r for r in rows if r["method"].startswith("cpdata_schedule")), key=lambda r: r["us_per_doc"])
    return f"max {worst['us_per_doc']:.2f} us/doc ({worst['distribution']}, dp {worst['dp_size']})", \
        worst["us_per_doc"] <= 5.0


def _tiled(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["layout"] == "tiled"]


def _tiled_tiles(rows: list[dict]) -> tuple[str, bool]:
    bound = {128: 1.02, 256: 1.03}
    mine = [r for r in _tiled(rows) if r["tile"] in bound]
    if not mine:
        return "no tiled row at tile 128 or 256", False
    parts, ok = [], True
    for tile, limit in bound.items():
        at = [r for r in mine if r["tile"] == tile]
        if at:
            # where integer tiles cannot reach the limit (a rank's share ~20 tiles), within 1 % of that bound
            def allowed(r: dict, limit: float = limit) -> float:
                return max(limit, 1.01 * r.get("tiles_integer_bound", 1.0))

            worst = max(at, key=lambda r: r["tiles_max_over_ideal"] / allowed(r))
            parts.append(f"tile {tile}: max {worst['tiles_max_over_ideal']:.4f} ({worst['distribution']} "
                         f"{worst['capacity'] // 1024}K cp {worst['cp_size']}, allowed {allowed(worst):.4f})")
            ok &= all(r["tiles_max_over_ideal"] <= allowed(r) for r in at)
    return "; ".join(parts), ok


def _tiled_kv(rows: list[dict]) -> tuple[str, bool]:
    bound = {"alpaca": 0.30, "sft": 0.30, "ultrachat": 0.30, "long_context": 0.5}
    mine = [r for r in _tiled(rows) if r["distribution"] in bound and r["capacity"] >= 32768]
    if not mine:
        return "no tiled row at >= 32K for alpaca / sft / ultrachat / long_context", False
    parts, ok = [], True
    for name, limit in bound.items():
        at = [r for r in mine if r["distribution"] == name]
        if at:
            worst = max(at, key=lambda r: r["kv_recv_fraction"])
            parts.append(f"{name} {worst['kv_recv_fraction']:.3f} ({worst['capacity'] // 1024}K cp {worst['cp_size']})")
            ok &= worst["kv_recv_fraction"] <= limit
    return "max " + ", ".join(parts), ok


def _tiled_solve(rows: list[dict]) -> tuple[str, bool]:
    bound = {(32768, 4): 150.0, (131072, 8): 800.0}
    parts, ok = [], True
    for (capacity, cp), limit in bound.items():
        at = [r for r in _tiled(rows) if (r["capacity"], r["cp_size"], r["tile"]) == (capacity, cp, 128)]
        if at:
            worst = max(at, key=lambda r: r["solve_us_per_pack"])
            parts.append(f"{capacity // 1024}K cp {cp}: max {worst['solve_us_per_pack']:.0f} us ({worst['distribution']})")
            ok &= worst["solve_us_per_pack"] <= limit
    if not parts:
        return "no tiled row at 32K cp 4 or 128K cp 8", False
    return "; ".join(parts), ok
def _world_pairs(rows: list[dict]) -> list[tuple[dict, dict]]:
    """``(cpdata, megatron)`` rows of each (distribution, world) the section measured both on."""
    theirs = {(r["distribution"], r["world"]): r for r in rows if r["system"].startswith("megatron")}
    return [(r, theirs[(r["distribution"], r["world"])]) for r in rows
            if r["system"] == "cpdata world" and (r["distribution"], r["world"]) in theirs]  # fmt: skip


def _world_tiles(rows: list[dict]) -> tuple[str, bool]:
    pairs = _world_pairs(rows)
    if not pairs:
        return "no Megatron rows (megatron-core not importable)", False
    worst = max(pairs, key=lambda p: p[0]["tiles"] / p[1]["tiles"])
    flat = max(p[0]["over_mean"] for p in pairs)
    ok = all(m["tiles"] <= t["tiles"] and m["over_mean"] <= 1.03 for m, t in pairs)
    return (f"max {worst[0]['tiles'] / worst[1]['tiles']:.3f} x Megatron's ({worst[0]['distribution']} "
            f"{worst[0]['world']}), max {flat:.3f} x the mean rank's"), ok


def _world_keys(rows: list[dict]) -> tuple[str, bool]:
    pairs = _world_pairs(rows)
    if not pairs:
        return "no Megatron rows (megatron-core not importable)", False
    recv = sum(m["recv_keys"] <= t["recv_keys"] for m, t in pairs)
    inter = sum(m["inter_keys"] <= t["inter_keys"] for m, t in pairs)
    return f"received <= Megatron's on {recv} of {len(pairs)} rows, inter-node on {inter}", \
        recv == inter == len(pairs)


def _world_solve(rows: list[dict]) -> tuple[str, bool]:
    mine = [r for r in rows if r["system"] == "cpdata world"]
    worst = max(mine, key=lambda r: r["solve_ms"])
    return f"max {worst['solve_ms']:.2f} ms ({worst['distribution']} {worst['world']})", worst["solve_ms"] <= 10.0


def _integrity(rows: list[dict]) -> tuple[str, bool]:
    worst = max(rows, key=lambda r: r["overhead_pct"])
    text = ", ".join(f"{r['store']} {r['overhead_pct']:+.1f} %" for r in rows)
    return f"{text} (first read of every chunk; hashing {worst['verify_gb_s']:.1f} GB/s)", worst["overhead_pct"] <= 5


TARGETS: tuple[tuple[str, str, str, Callable], ...] = (
    ("step_shard", "step speedup", ">= 20x at 32K tokens, cp 4", _step_speedup),
    ("step_shard", "H2D bytes per rank", "<= anchor / cp x 1.02", _h2d),
    ("worker", "worker vs in-step", "cpdata <= 0.3 x anchor per pack (paired by round), capacity >= 8K, cp <= 8",
     _worker),
    ("worker", "worker per token", "<= 12 ns per pack token at 32K, cp 4 (thd, balanced)", _worker_token),
    ("handoff", "one storage", "1 shared-memory storage per batch", _storages),
    ("handoff", "handoff cost", "receive <= 0.8 x plain dict (default strategy)", _handoff),
    ("packing", "packing padding", "default within 0.1 pp of the lower bound", _padding),
    ("packing", "packing speed", "default <= 2 us per document", _packing_speed),
    ("balance", "balanced layout", "p95 <= 1.005, no doc padding, equal tokens", _balance),
    ("gather", "gather collectives", "cpdata 1 forward + 1 backward", _gather),
    ("long_document", "long document offline", "offline <= 2x online seconds per epoch", _long_document),
    ("schedule", "D1 schedule", "imb_mb <= 0.7 / p95 1.0, imb_step <= 0.5 %, full, within 0.05 pp of bfd", _schedule_d1),
    ("schedule", "D2 schedule", "dp 8, max_delay 4: imb_mb <= 2.5 / p95 6 %, delay -1..4 steps", _schedule_d2),
    ("schedule", "schedule speed", "<= 5 us per document", _schedule_speed),
    ("attention", "tiled tiles", "busiest rank <= 1.02 x ideal tiles at tile 128, 1.03 at 256, or 1.01 x the "
     "integer bound (every row)",
     _tiled_tiles),
    ("attention", "tiled K/V", ">= 32K: receive <= 0.30 of an all-gather (alpaca, sft, ultrachat), 0.5 long_context",
     _tiled_kv),
    ("attention", "tiled solve", "<= 150 us per pack at 32K cp 4, 800 us at 128K cp 8 (tile 128)", _tiled_solve),
    ("world", "world tiles", "busiest rank's tiles <= Megatron's and <= 1.03 x the mean rank's (every row)",
     _world_tiles),
    ("world", "world K/V", "busiest rank's received and inter-node keys <= Megatron's (every row)", _world_keys),
    ("world", "world solve", "<= 10 ms per world micro-batch", _world_solve),
    ("integrity", "store checks", "chunk checks <= 5 % of a reading pass", _integrity),
)


def evaluate_targets(results: Mapping[str, object]) -> list[dict]:
    """``[{section, target, rule, measured, met}]`` for every section present in ``results``."""
    out = []
    default = str(results.get("default_algorithm", "bfd"))
    for section, name, rule, check in TARGETS:
        rows = results.get(section)
        if not rows:
            continue
        measured, met = check(rows, default) if section == "packing" else check(rows)
        out.append({"section": section, "target": name, "rule": rule, "measured": measured, "met": bool(met)})
    return out
