"""``cpdata inspect``: summarize a plan directory, show one pack, draw it.

The drawing (:func:`plot_pack`) pictures one pack under CP layouts: per layout, which rank owns each token
(coloured by document, pads grey) and each rank's causal work. It needs matplotlib (extra ``plot``), imported
only when drawing, and draws on the Agg canvas, never pyplot.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cpdata.offline.metrics import DEFAULT_SAMPLE, SHORT_CHUNK, imbalance, layouts_for, pack_view, summarize
from cpdata.offline.store import PackStore, read_store

__all__ = ["PLOT_INSTALL_HINT", "plot_pack", "register", "run"]

PLOT_INSTALL_HINT = "pip install 'cpdata[plot]'"
_PAD = (0.62, 0.62, 0.62)
_UNOWNED = (1.0, 1.0, 1.0)
_MAX_LEGEND = 12


def register(subparsers: Any) -> None:
    """Add ``inspect`` to the ``cpdata`` command line."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "inspect",
        help="summarize a precomputed plan directory (padding, CP work balance per layout)",
        description="Summarize a plan directory written by `cpdata precompute`: padding against the lower "
        "bound, documents per pack, and per-rank causal attention work imbalance under each CP layout.",
    )
    p.add_argument("dir", metavar="DIR", help="plan directory")
    p.add_argument("--pack", type=int, default=None, help="show this pack's documents and per-rank work")
    p.add_argument("--plot", metavar="OUT.png", default=None, help="draw the pack (default pack 0) to a PNG")
    p.add_argument("--all-layouts", action="store_true", help="plot every layout, not only the plan's")
    p.add_argument("--sample", type=int, default=DEFAULT_SAMPLE,
                   help=f"measure layouts on at most this many evenly spaced packs (default {DEFAULT_SAMPLE}; 0 = all)")
    p.add_argument("--no-verify", action="store_true", help="skip the array checksums (faster on huge plans)")
    p.set_defaults(func=run)


def _print_summary(store: Any, sample: int | None) -> None:
    s = summarize(store, sample=sample)
    cfg = store.config
    print(f"plan {store.path}")
    settings = {**{k: cfg[k] for k in ("capacity", "cp_size", "layout")}, **cfg["planner"]}
    print("  config      " + " ".join(f"{k}={v}" for k, v in settings.items()))
    print(f"  packs       {s.packs} ({s.pieces} pieces from {s.documents} documents, {s.real_tokens} real tokens)")
    print(f"  padding     {s.padding_pct:.2f}% (lower bound {s.lower_bound_pct:.2f}%)")
    print(f"  docs/pack   mean {s.docs_per_pack_mean:.2f}, max {s.docs_per_pack_max}")
    stats = store.manifest["stats"]
    print("  policy      " + ", ".join(f"{k} {stats[k]}" for k in ("skipped", "split", "truncated", "dropped")))
    work = np.asarray(store.arrays["rank_work"])
    if work.shape[0]:
        ratios = imbalance(work)
        print(
            f"  {cfg['layout']} work imbalance over all packs: mean {ratios.mean():.3f}, "
            f"p95 {np.percentile(ratios, 95):.3f}, max {ratios.max():.3f}"
        )
    print(f"\n  CP layouts at cp_size={cfg['cp_size']}, causal doc-masked work, over {s.measured_packs} packs:")
    print(f"  {'layout':<12} {'imb mean':>9} {'imb p95':>9} {'doc pad %':>10} {'over cap':>9} {'chunks<' + str(SHORT_CHUNK):>11}"
          f" {'tiles':>7}")
    for row in s.layouts:
        mark = " *" if row.layout == cfg["layout"] else ""
        print(
            f"  {row.layout:<12} {row.imbalance_mean:>9.3f} {row.imbalance_p95:>9.3f} {row.doc_padding_pct:>10.2f} "
            f"{row.packs_over_capacity:>9} {row.short_chunk_pct:>10.1f}% {row.tiles_mean:>7.3f}{mark}"
        )
    print("  (* the plan's layout; imb = max/mean per-rank work; over cap = packs that no longer fit after")
    print("   that layout's per-document padding; chunks = share of per-rank runs of one document's tokens;")
    print("   tiles = busiest rank's live 128x128 attention tiles (tiled: its own tile) over the ideal, what a")
    print("   flash / flex-style kernel computes)")


def _print_pack(store: Any, k: int) -> None:
    geometry, _, work = pack_view(store, k, store.config["layout"])
    rows = store.pack_slice(k)
    a = store.arrays
    print(f"\npack {k}: {int(geometry.doc_len.sum())} real tokens of {geometry.pack_len}")
    print(f"  {'slot':>4} {'document':>9} {'start':>7} {'tokens':>7} {'slot len':>9}")
    for i, j in enumerate(range(rows.start, rows.stop)):
        print(f"  {i:>4} {int(a['doc_index'][j]):>9} {int(a['doc_start'][j]):>7} {int(a['doc_len'][j]):>7} "
              f"{int(a['slot_len'][j]):>9}")  # fmt: skip
    print(f"  tail padding {geometry.pack_len - int(geometry.slot_len.sum())}")
    print(f"  {store.config['layout']} work per rank {work.tolist()} (max/mean {float(imbalance(work)):.3f})")


def run(args: argparse.Namespace) -> int:
    from cpdata.sources.tokenstore import is_token_store

    if not Path(args.dir).exists():
        raise ValueError(f"{args.dir} does not exist; pass a plan directory written by `cpdata precompute`")
    if is_token_store(args.dir) or Path(args.dir).is_file():
        what = "a token store (documents, from cpdata tokenize / pack-store)" if Path(args.dir).is_dir() else "a file"
        raise ValueError(
            f"{args.dir} is {what}, not a plan: inspect summarizes the packs `cpdata precompute` writes; plan it "
            f"first, `cpdata precompute {args.dir} --capacity N --cp-size N --layout LAYOUT --out PLAN`, then run "
            "`cpdata inspect PLAN`"
        )
    store = read_store(args.dir, verify=not args.no_verify)
    _print_summary(store, args.sample or None)  # --sample 0: every pack
    if args.pack is not None:
        _print_pack(store, args.pack)
    if args.plot is not None:
        return _plot(store, args)
    return 0


def _plot(store: Any, args: argparse.Namespace) -> int:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"cpdata inspect: --plot needs matplotlib; install it with: {PLOT_INSTALL_HINT}", file=sys.stderr)
        return 2
    k = 0 if args.pack is None else args.pack
    layouts = layouts_for(store.config["cp_size"]) if args.all_layouts else (store.config["layout"],)
    if store.n_packs == 0:
        raise ValueError(f"plan {store.path} has no packs to plot")
    plot_pack(store, k, args.plot, layouts=layouts)
    print(f"\nwrote {args.plot} (pack {k}, layouts {', '.join(layouts)})")
    return 0


def _colors(n: int) -> np.ndarray:
    from matplotlib import colormaps

    cmap = colormaps["tab20"]
    # Even entries first (neighbouring documents get clearly different hues); no greys (14, 15): grey is padding.
    order = [i for i in (*range(0, 20, 2), *range(1, 20, 2)) if i not in (14, 15)]
    return np.array([cmap(order[i % len(order)])[:3] for i in range(n)], dtype=np.float32)


def plot_pack(store: PackStore, k: int, out: str | os.PathLike[str], *, layouts: Sequence[str]) -> None:
    """Draw pack ``k`` of ``store`` under each of ``layouts`` and save a PNG to ``out``."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    from matplotlib.ticker import EngFormatter

    cp = int(store.config["cp_size"])
    doc_index = np.asarray(store.arrays["doc_index"][store.pack_slice(k)])
    colors = _colors(doc_index.shape[0])
    fig = Figure(figsize=(13, 1.0 + (0.45 * cp + 1.1) * len(layouts)), layout="constrained")
    grid = fig.add_gridspec(len(layouts), 2, width_ratios=[5, 1])
    first_bars = None
    for i, layout in enumerate(layouts):
        geometry, owned, work = pack_view(store, k, layout)
        token_rgb = np.where((geometry.slot_of >= 0)[:, None], colors[np.maximum(geometry.slot_of, 0)], np.float32(_PAD))
        image = np.full((cp, geometry.pack_len, 3), _UNOWNED, dtype=np.float32)
        for r in range(cp):
            image[r, owned[r]] = token_rgb[owned[r]]
        ax = fig.add_subplot(grid[i, 0])
        ax.imshow(image, aspect="auto", interpolation="nearest", extent=(0, geometry.pack_len, cp - 0.5, -0.5))
        ax.set_yticks(range(cp), [f"rank {r}" for r in range(cp)])
        pad = int(geometry.pack_len - geometry.doc_len.sum())
        ax.set_title(f"{layout}: tokens owned per CP rank (pack {k}, {geometry.pack_len} tokens, "
                     f"{doc_index.shape[0]} documents, {pad} pad)", fontsize=10, loc="left")  # fmt: skip
        bars = fig.add_subplot(grid[i, 1], sharex=first_bars)  # one work scale across layouts
        first_bars = first_bars or bars
        bars.barh(range(cp), work, color="#4c72b0")
        bars.set_ylim(cp - 0.5, -0.5)
        bars.set_yticks(range(cp), [str(r) for r in range(cp)])
        bars.set_title(f"causal work, max/mean {float(imbalance(work)):.2f}", fontsize=10)
        bars.xaxis.set_major_formatter(EngFormatter(places=0, sep=""))
        if i == len(layouts) - 1:
            ax.set_xlabel("global token position in the pack")
            bars.set_xlabel("query-key pairs")
    shown = min(doc_index.shape[0], _MAX_LEGEND)
    handles = [Patch(color=colors[j], label=f"doc {int(doc_index[j])}") for j in range(shown)]
    handles.append(Patch(color=_PAD, label="padding"))
    if doc_index.shape[0] > shown:
        handles.append(Patch(color=_UNOWNED, label=f"+{doc_index.shape[0] - shown} more docs"))
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 7), fontsize=9, frameon=False)
    fig.savefig(out, dpi=110)
