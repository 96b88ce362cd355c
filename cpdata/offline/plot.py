"""Picture of one pack under CP layouts: per layout, which rank owns each token (coloured by document, pads
grey) and each rank's causal work. Needs matplotlib (extra ``plot``); draws on the Agg canvas, never pyplot.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from cpdata.offline.metrics import imbalance, pack_view
from cpdata.offline.store import PackStore

__all__ = ["PLOT_INSTALL_HINT", "plot_pack"]

PLOT_INSTALL_HINT = "pip install 'cpdata[plot]'"
_PAD = (0.62, 0.62, 0.62)
_UNOWNED = (1.0, 1.0, 1.0)
_MAX_LEGEND = 12


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

    cfg = store.config
    cp = int(cfg["cp_size"])
    rows = store.pack_slice(k)
    doc_index = np.asarray(store.arrays["doc_index"][rows])
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
        if i == len(layouts) - 1:
            ax.set_xlabel("global token position in the pack")
        bars = fig.add_subplot(grid[i, 1], sharex=first_bars)  # one work scale across layouts
        first_bars = first_bars or bars
        bars.barh(range(cp), work, color="#4c72b0")
        bars.set_ylim(cp - 0.5, -0.5)
        bars.set_yticks(range(cp), [str(r) for r in range(cp)])
        bars.set_title(f"causal work, max/mean {float(imbalance(work)):.2f}", fontsize=10)
        bars.xaxis.set_major_formatter(EngFormatter(places=0, sep=""))
        if i == len(layouts) - 1:
            bars.set_xlabel("query-key pairs")
    shown = min(doc_index.shape[0], _MAX_LEGEND)
    handles = [Patch(color=colors[j], label=f"doc {int(doc_index[j])}") for j in range(shown)]
    handles.append(Patch(color=_PAD, label="padding"))
    if doc_index.shape[0] > shown:
        handles.append(Patch(color=_UNOWNED, label=f"+{doc_index.shape[0] - shown} more docs"))
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 7), fontsize=9, frameon=False)
    fig.savefig(out, dpi=110)
