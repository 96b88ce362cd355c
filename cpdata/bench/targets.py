"""The benchmark's targets (:data:`TARGETS`: section, name, rule, check), checked against a results dict.

Each check returns ``(measured text, met)``; targets of sections that did not run are left out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from cpdata.bench.worker_throughput import worker_ratio
from cpdata.bench.world import PACKS, STEPS

__all__ = ["TARGETS", "evaluate_targets"]


Check = Callable[[list[dict]], tuple[str, bool]]


def _worst(value: Callable[[dict], float], limit: float, text: str, *,
           where: Callable[[dict], bool] | None = None, none: str = "no matching row") -> Check:
    """Met when the largest ``value`` of the rows ``where`` picks is ``<= limit``; ``text`` is formatted with
    that row's columns and ``value``."""

    def check(rows: list[dict]) -> tuple[str, bool]:
        mine = [r for r in rows if where is None or where(r)]
        if not mine:
            return none, False
        worst = max(mine, key=value)
        return text.format(**worst, value=value(worst)), value(worst) <= limit

    return check


def _every(text: str, met: Callable[[dict], bool], *, where: Callable[[dict], bool], none: str) -> Check:
    """Met when every row ``where`` picks is; ``text`` formatted per row, joined by commas."""

    def check(rows: list[dict]) -> tuple[str, bool]:
        mine = [r for r in rows if where(r)]
        if not mine:
            return none, False
        return ", ".join(text.format(**r) for r in mine), all(met(r) for r in mine)

    return check


def _per_group(group: Callable[[dict], object], bounds: Mapping, value: Callable[[dict], float], text: str, *,
               none: str, prefix: str = "", joiner: str = "; ",
               allowed: Callable[[dict, float], float] | None = None) -> Check:
    """One part per key of ``bounds`` the ``tiled`` rows reach (``group(row)``): its worst row by ``value``
    (over the row's allowance when ``allowed`` is given, else the bound), ``text`` formatted with the row,
    ``K`` (its capacity in K) and ``allowed``; met when every row is within its allowance."""

    def check(rows: list[dict]) -> tuple[str, bool]:
        parts, ok = [], True
        for key, limit in bounds.items():
            at = [r for r in rows if r["layout"] == "tiled" and group(r) == key]
            if not at:
                continue
            room = (lambda r: limit) if allowed is None else (lambda r: allowed(r, limit))  # noqa: B023
            worst = max(at, key=value if allowed is None else lambda r: value(r) / room(r))  # noqa: B023
            parts.append(text.format(**worst, K=worst["capacity"] // 1024, allowed=room(worst)))
            ok &= all(value(r) <= room(r) for r in at)
        return (prefix + joiner.join(parts), ok) if parts else (none, False)

    return check


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


def _schedule_row(dist: str, method: str) -> Callable[[dict], bool]:
    """Picks the schedule section's row of ``dist`` at dp 8 by ``method``."""
    return lambda r: (r["distribution"], r["dp_size"], r["method"]) == (dist, 8, method)


def _schedule_d1(rows: list[dict]) -> tuple[str, bool]:
    r = next(filter(_schedule_row("D1", "cpdata_schedule"), rows), None)
    if r is None:
        return "no D1 dp 8 row", False
    pad_gap = r["padding_pct"] - r["bfd_padding_pct"]
    text = (f"imb_mb {r['imb_mb_mean']:.2f} / p95 {r['imb_mb_p95']:.2f}, imb_step {r['imb_step_mean']:.2f}, "
            f"over-cap {r['over_cap_pct']:g}, extra mb {r['extra_microbatch_pct']:g}, padding - bfd {pad_gap:+.3f} pp")
    ok = (r["imb_mb_mean"] <= 0.7 and r["imb_mb_p95"] <= 1.0 and r["imb_step_mean"] <= 0.5
          and r["over_cap_pct"] == 0 and r["extra_microbatch_pct"] == 0 and pad_gap <= 0.05)  # fmt: skip
    return text, ok


def _world_rows(system: str, rows: list[dict]) -> list[dict]:
    """The ``system`` rows of the world section measured beside Megatron (their ``*_vs_megatron`` ratios)."""
    return [r for r in rows if r["system"] == system and "tiles_vs_megatron" in r]


def _world_tiles(step: str) -> Callable[[list[dict]], tuple[str, bool]]:
    """The tiles rule over the columns of one reading (``step``: ``""`` or ``"step_"``, bench/world.py)."""
    ratio, over = f"{step}tiles_vs_megatron", f"{step}over_mean"

    def check(mine: list[dict]) -> tuple[str, bool]:
        worst = max(mine, key=lambda r: r[ratio])
        ok = all(r[ratio] <= 1.0 and r[over] <= 1.03 for r in mine)
        return (f"max {worst[ratio]:.3f} x Megatron's ({worst['distribution']} {worst['world']}), max "
                f"{max(r[over] for r in mine):.3f} x the mean rank's"), ok

    return check


def _world_keys(step: str) -> Callable[[list[dict]], tuple[str, bool]]:
    """The K/V rule over the columns of one reading (as :func:`_world_tiles`)."""

    def check(mine: list[dict]) -> tuple[str, bool]:
        recv, inter = (sum(r[f"{step}{key}_vs_megatron"] <= 1.0 for r in mine) for key in ("recv_keys", "inter_keys"))
        return f"received <= Megatron's on {recv} of {len(mine)} rows, inter-node on {inter}", \
            recv == inter == len(mine)

    return check


def _against_megatron(system: str, check: Callable[[list[dict]], tuple[str, bool]]) -> Check:
    """``check`` over the world section's ``system`` rows; unmet without Megatron's rows."""
    return lambda rows: check(mine) if (mine := _world_rows(system, rows)) else (
        "no Megatron rows (megatron-core not importable)", False)


def _integrity(rows: list[dict]) -> tuple[str, bool]:
    worst = max(rows, key=lambda r: r["overhead_pct"])
    text = ", ".join(f"{r['store']} {r['overhead_pct']:+.1f} %" for r in rows)
    return f"{text} (first read of every chunk; hashing {worst['verify_gb_s']:.1f} GB/s)", worst["overhead_pct"] <= 5


TARGETS: tuple[tuple[str, str, str, Check], ...] = (
    ("step_shard", "step speedup", ">= 20x at 32K tokens, cp 4",
     _every("{layout} {speedup:.1f}x", lambda r: r["speedup"] >= 20, none="no row at 32K tokens, cp 4",
            where=lambda r: r["tokens"] == 32768 and r["cp_size"] == 4)),
    ("step_shard", "H2D bytes per rank", "<= anchor / cp x 1.02",
     _worst(lambda r: r["cpdata_h2d_bytes"] * r["cp_size"] / r["anchor_h2d_bytes"], 1.02,
            "worst cpdata / (anchor / cp) = {value:.4f}")),
    ("worker", "worker vs in-step", "cpdata <= 0.3 x anchor per pack (paired by round), capacity >= 8K, cp <= 8",
     _worst(worker_ratio, 0.3, "max {value:.2f} x anchor ({layout}, cp {cp_size}, capacity {capacity}: "
            "medians {cpdata_us_per_pack:.0f} vs {anchor_host_us:.0f} us)",
            none="no row at capacity >= 8K, cp <= 8",
            where=lambda r: r["capacity"] >= 8192 and r["cp_size"] <= 8)),
    ("worker", "worker per token", "<= 12 ns per pack token at 32K, cp 4 (thd, balanced)",
     _every("{layout} {ns_per_pack_token:.1f} ns", lambda r: r["ns_per_pack_token"] <= 12,
            none="no thd/balanced row at 32K, cp 4", where=lambda r: r["capacity"] == 32768
            and r["cp_size"] == 4 and r["layout"] in ("thd", "balanced"))),
    ("handoff", "one storage", "1 shared-memory storage per batch", _storages),
    ("handoff", "handoff cost", "receive <= 0.8 x plain dict (default strategy)", _handoff),
    ("packing", "packing padding", "default within 0.1 pp of the lower bound",
     _worst(lambda r: r["padding_pct"] - r["lower_bound_pct"], 0.1,
            "max gap {value:.3f} pp ({distribution}, capacity {capacity})")),
    ("packing", "packing speed", "default <= 2 us per document",
     _worst(lambda r: r["us_per_doc"], 2.0,
            "max {us_per_doc:.2f} us/doc ({distribution}, capacity {capacity})")),
    ("balance", "balanced layout", "p95 <= 1.005, no doc padding, equal tokens", _balance),
    ("gather", "gather collectives", "cpdata 1 forward + 1 backward", _gather),
    ("long_document", "long document offline", "offline <= 2x online seconds per epoch",
     _worst(lambda r: r["ratio"], 2, "offline {offline_s:.2f} s vs online {online_s:.2f} s per epoch "
            "({ratio:.2f}x, {doc_tokens:,} tokens in {pieces} pieces)")),
    ("schedule", "D1 schedule", "imb_mb <= 0.7 / p95 1.0, imb_step <= 0.5 %, full, within 0.05 pp of bfd", _schedule_d1),
    ("schedule", "D2 schedule", "dp 8, max_delay 4: imb_mb <= 2.5 / p95 6 %, delay -1..4 steps",
     _every("imb_mb {imb_mb_mean:.2f} / p95 {imb_mb_p95:.2f}, delay {min_delay_steps}..{max_delay_steps} steps "
            "after FIFO", lambda r: r["imb_mb_mean"] <= 2.5 and r["imb_mb_p95"] <= 6.0
            and -1 <= r["min_delay_steps"] and r["max_delay_steps"] <= 4,
            where=_schedule_row("D2", "cpdata_schedule_delay4"), none="no D2 dp 8 max_delay 4 row")),
    ("schedule", "schedule speed", "<= 5 us per document",
     _worst(lambda r: r["us_per_doc"], 5.0, "max {us_per_doc:.2f} us/doc ({distribution}, dp {dp_size})",
            where=lambda r: r["method"].startswith("cpdata_schedule"))),
    ("attention", "tiled tiles", "busiest rank <= 1.02 x ideal tiles at tile 128, 1.03 at 256, or 1.01 x the "
     "integer bound (every row)",
     _per_group(lambda r: r["tile"], {128: 1.02, 256: 1.03}, lambda r: r["tiles_max_over_ideal"],
                "tile {tile}: max {tiles_max_over_ideal:.4f} ({distribution} {K}K cp {cp_size}, "
                "allowed {allowed:.4f})",
                none="no tiled row at tile 128 or 256",  # whole tiles (~20 a rank) may not reach the limit
                allowed=lambda r, limit: max(limit, 1.01 * r.get("tiles_integer_bound", 1.0)))),
    ("attention", "tiled K/V", ">= 32K: receive <= 0.30 of an all-gather (alpaca, sft, ultrachat), 0.5 long_context",
     _per_group(lambda r: r["distribution"] if r["capacity"] >= 32768 else None,
                {"alpaca": 0.30, "sft": 0.30, "ultrachat": 0.30, "long_context": 0.5},
                lambda r: r["kv_recv_fraction"], "{distribution} {kv_recv_fraction:.3f} ({K}K cp {cp_size})",
                none="no tiled row at >= 32K for alpaca / sft / ultrachat / long_context", prefix="max ",
                joiner=", ")),
    ("attention", "tiled solve", "<= 150 us per pack at 32K cp 4, 800 us at 128K cp 8 (tile 128)",
     _per_group(lambda r: (r["capacity"], r["cp_size"]) if r["tile"] == 128 else None,
                {(32768, 4): 150.0, (131072, 8): 800.0}, lambda r: r["solve_us_per_pack"],
                "{K}K cp {cp_size}: max {solve_us_per_pack:.0f} us ({distribution})",
                none="no tiled row at 32K cp 4 or 128K cp 8")),
    ("world", "world tiles", "each pack dealt alone: busiest rank's tiles <= Megatron's and <= 1.03 x the mean "
     "rank's (every row)", _against_megatron("cpdata world", _world_tiles(""))),
    ("world", "world K/V", "each pack dealt alone: busiest rank's received and inter-node keys <= Megatron's (every "
     "row)", _against_megatron("cpdata world", _world_keys(""))),
    ("world", "world step tiles", f"a step of {PACKS} packs dealt together, each rank summed over the step: the same "
     "rule", _against_megatron("cpdata world step", _world_tiles("step_"))),
    ("world", "world step K/V", f"a step of {PACKS} packs dealt together, each rank summed over the step: the same "
     "rule", _against_megatron("cpdata world step", _world_keys("step_"))),
    ("world", "world stream tiles", f"the first {STEPS} such steps of a stream, each step's busiest rank summed: the "
     "same rule", _against_megatron("cpdata world stream", _world_tiles("step_"))),
    ("world", "world stream K/V", f"the first {STEPS} such steps of a stream, each step's busiest rank summed: the "
     "same rule", _against_megatron("cpdata world stream", _world_keys("step_"))),
    ("world", "world solve", "<= 10 ms per world micro-batch (each cpdata system)",
     _worst(lambda r: r["solve_ms"], 10.0, "max {solve_ms:.2f} ms ({system}, {distribution} {world})",
            where=lambda r: r["system"].startswith("cpdata"))),
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
        if section == "packing":  # its targets hold for the default packer
            rows = [r for r in rows if r["algorithm"] == default]
        measured, met = check(rows)
        out.append({"section": section, "target": name, "rule": rule, "measured": measured, "met": bool(met)})
    return out
