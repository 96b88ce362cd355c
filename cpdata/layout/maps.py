"""CP layouts: which global token positions each context-parallel rank owns.

Every layout is one integer map: ``rank_indices(...)[r]`` holds the global positions of rank ``r``'s tokens in
its local order (``local = global[rows[r]]``), the rows together a permutation of ``range(pack_len)``, each
``pack_len // cp_size`` long; :func:`inverse_indices` undoes it (``global = concat(shards)[inverse]``). The
layouts and their alignment are tabled in docs/layouts.md. A layout that takes a parameter carries it in its
string (:func:`layout_spec`): ``"tiled:64"`` (tile; ``"tiled"`` is tile 128), ``"world:8"`` (ranks per node;
``"world:8:<intra>:<inter>"`` with a calibrated :class:`~cpdata.layout.world_cost.WorldCost`).

``seq_lens`` are the document slots laid out in the pack, in order; the rest of the pack is padding, which
``thd``'s last slot absorbs, as Transformer Engine requires. Pure, vectorized numpy, O(pack_len).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from cpdata.errors import check_int
from cpdata.layout.blocks import balanced_block, head_tail_block
from cpdata.layout.runs import RunBlock, RunTable, _per_pack, contiguous_runs
from cpdata.layout.spans import SpanBlock, SpanTable
from cpdata.layout.tiled import DEFAULT_TILE, TILES, tiled_block
from cpdata.layout.world_cost import H100_DEFAULTS, WorldCost
from cpdata.layout.world_deal import world_block

__all__ = [
    "LAYOUTS",
    "alignment",
    "causal_work",
    "check_layout",
    "concat_run_block",
    "inverse_indices",
    "layout_run_block",
    "layout_runs",
    "layout_spec",
    "layout_tile",
    "node_size_of",
    "rank_indices",
    "thd_slot_lens",
    "world_cost_of",
]

LAYOUTS: tuple[str, ...] = ("balanced", "contiguous", "identity", "round_robin", "thd", "tiled", "world")


def layout_spec(layout: str, tile: int | None = None, *, node_size: int | None = None,
                cost: WorldCost | None = None) -> str:  # fmt: skip
    """The layout string that carries ``tile`` (``"tiled"`` for 128, ``"tiled:64"``, ``"tiled:256"``) or
    ``node_size`` (``"world:8"``) and the deal's ``cost`` (a calibration: ``"world:8:<intra>:<inter>"``,
    :meth:`~cpdata.layout.world_cost.WorldCost.layout_suffix`); ``layout`` unchanged when all are None."""
    if cost is not None and (node_size is None or not isinstance(cost, WorldCost)):
        raise ValueError(f"cost={cost!r} must be a WorldCost (WorldCost.from_json(path)) and goes with layout "
                         "'world' and node_size=; pass both")  # fmt: skip
    if tile is None and node_size is None:
        return layout
    name, given = _split(layout)
    want, arg, value = ("tiled", "tile", tile) if node_size is None else ("world", "node_size", node_size)
    if name != want or (tile is not None and node_size is not None):
        raise ValueError(f"{arg}={value} applies to layout {want!r} only (and tile= and node_size= not together), "
                         f"got layout {layout!r}; drop {arg}= or use layout={want!r}")  # fmt: skip
    fix = " (the kernel's block size)" if want == "tiled" else " (ranks per node, torchrun's local world size)"
    value = check_int(arg, value, min=1, fix=fix)
    if given is not None and given != value:
        raise ValueError(f"layout {layout!r} already says {arg} {given}, but {arg}={value} was given; give one")
    if want == "tiled" and value not in TILES:
        raise ValueError(f"tile must be one of {list(TILES)} (the kernel's block size), got tile={value}")
    if want == "tiled":
        return "tiled" if value == DEFAULT_TILE else f"tiled:{value}"
    carried = world_cost_of(layout) or H100_DEFAULTS
    if cost is not None and carried is not H100_DEFAULTS and cost.layout_suffix() != carried.layout_suffix():
        raise ValueError(f"layout {layout!r} already carries a cost, and another cost= was given; give one")
    return f"world:{value}" + (cost or carried).layout_suffix()


def _split(layout: str) -> tuple[str, int | None]:
    """``"tiled:256"`` -> ``("tiled", 256)``; ``"world:8"`` and ``"world:8:<intra>:<inter>"`` -> ``("world",
    8)``; ``"thd"`` -> ``("thd", None)``; malformed -> ``(layout, None)``."""
    name, colon, digits = layout.partition(":") if isinstance(layout, str) else (layout, "", "")
    if colon and name == "world" and digits.count(":") == 2 and world_cost_of(layout) is not None:
        digits = digits.partition(":")[0]
    if colon and name in ("tiled", "world") and digits.isdigit():
        return name, int(digits)
    return layout, None


@functools.lru_cache(maxsize=64)
def world_cost_of(layout: str) -> WorldCost | None:
    """The deal's cost a ``world`` layout string carries (``"world:8"``: the defaults); None for other or
    malformed strings. Cached: each parse of a layout string (:func:`_split`) and each block's deal reads it."""
    parts = layout.split(":") if isinstance(layout, str) else []
    if parts[:1] != ["world"] or len(parts) not in (1, 2, 4):
        return None
    if len(parts) < 4:
        return H100_DEFAULTS
    try:
        return WorldCost.of_ratios(float(parts[2]), float(parts[3]))
    except ValueError:
        return None


def _parameter(layout: str, name: str, default: int) -> int | None:
    """The number a ``name`` layout string carries (``default`` when bare); None for other layouts."""
    got, value = _split(layout)
    if got != name:
        return None
    return default if value is None else value


def node_size_of(layout: str, cp_size: int) -> int | None:
    """Ranks per node of a ``world`` layout string (``"world"``: ``cp_size``, one node); None for others."""
    return _parameter(layout, "world", cp_size)


def layout_tile(layout: str) -> int | None:
    """The tile size of a ``tiled`` layout string (``"tiled"`` -> 128); None for other layouts."""
    return _parameter(layout, "tiled", DEFAULT_TILE)


def check_layout(layout: str, cp_size: int) -> None:
    """Validate a layout name and CP size; raise ``ValueError`` naming the fix."""
    name, tile = _split(layout)
    if not isinstance(layout, str) or name not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {list(LAYOUTS)} (tiled: also 'tiled:64', "
                         "'tiled:256'; world: 'world:<node_size>')")  # fmt: skip
    if name == "tiled" and tile is not None and (tile not in TILES or tile == DEFAULT_TILE):
        raise ValueError(f"layout {layout!r}: the tile must be one of {list(TILES)}, and 128 is written 'tiled'; "
                         "build the string with layout_spec('tiled', tile)")  # fmt: skip
    check_int("cp_size", cp_size, min=1, fix="; use cp_size=1 to turn context parallelism off")
    if name == "world" and tile is not None and (tile < 1 or cp_size % tile):
        raise ValueError(f"layout {layout!r}: a world of cp_size={cp_size} ranks is not a whole number of nodes of "
                         f"node_size={tile} ranks; pass torchrun's local world size as node_size, or a cp_size "
                         f"that is a multiple of it")  # fmt: skip
    if layout == "identity" and cp_size != 1:
        raise ValueError(
            f"layout 'identity' gives every token to one rank and needs cp_size=1, got cp_size={cp_size}; "
            "pick 'contiguous', 'round_robin', 'thd' or 'balanced' for cp_size > 1"
        )


def alignment(layout: str, cp_size: int, tile: int | None = None) -> tuple[int, int]:
    """``(doc_multiple, pack_multiple)``: every document slot and the pack length must be multiples of these."""
    layout = layout_spec(layout, tile)
    check_layout(layout, cp_size)
    tile = layout_tile(layout)
    if tile is not None:
        return 1, cp_size * tile
    if layout == "thd":
        return 2 * cp_size, 2 * cp_size
    if layout == "round_robin":
        return 1, 2 * cp_size
    return 1, cp_size  # contiguous, balanced, world; identity (cp_size 1, checked)


def _lengths_in_pack(seq_lens: Sequence[int] | np.ndarray, pack_len: int, name: str = "seq_lens"
                     ) -> tuple[np.ndarray, int]:  # fmt: skip
    """``seq_lens`` flattened to int64 ``[n]``, checked to be >= 0 and to fit in ``pack_len`` tokens, and their sum
    (``name``: the argument, for the errors)."""
    lens = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
    check_int("pack_len", pack_len, min=0)
    if lens.size and lens.min() < 0:
        bad = int(np.flatnonzero(lens < 0)[0])
        raise ValueError(f"{name} must be >= 0, got {name}[{bad}]={int(lens[bad])}")
    total = int(lens.sum())
    if total > pack_len:
        raise ValueError(
            f"{name} sum to {total} tokens, more than pack_len={pack_len}; "
            "raise the capacity or pack fewer documents"
        )
    return lens, total


def _absorb_tail(lens: np.ndarray, pack_len: int) -> np.ndarray:
    if lens.size == 0:
        return np.array([pack_len], dtype=np.int64) if pack_len else lens.copy()
    slots = lens.copy()
    slots[-1] += pack_len - int(lens.sum())
    return slots


def thd_slot_lens(seq_lens: Sequence[int] | np.ndarray, pack_len: int) -> np.ndarray:
    """Slot lengths as TE sees them: the last slot absorbs the pack's tail padding (no slots: one pad slot)."""
    return _absorb_tail(_lengths_in_pack(seq_lens, pack_len)[0], pack_len)


def _check_pack_len(layout: str, cp_size: int, pack_len: int) -> None:
    """``ValueError`` unless ``pack_len`` is a multiple of the layout's pack multiple (layout and CP checked)."""
    _, pack_multiple = alignment(layout, cp_size)
    if pack_len % pack_multiple:
        raise ValueError(
            f"layout {layout!r} with cp_size={cp_size} needs pack_len to be a multiple of {pack_multiple}, "
            f"got pack_len={pack_len}; pad the pack to {pack_len + (-pack_len) % pack_multiple}"
        )


def layout_runs(
    layout: str, cp_size: int, seq_lens: Sequence[int] | np.ndarray, pack_len: int, *, checked: bool = False,
    tile: int | None = None,
) -> RunTable | SpanTable:
    """The layout as a :class:`~cpdata.layout.runs.Table` (``row``, ``rows``, ``inverse``);
    arguments as :func:`rank_indices`. ``checked=True``: ``seq_lens`` is a stream's checked int64 slot table."""
    layout = layout_spec(layout, tile)
    _check_pack_len(layout, cp_size, pack_len)
    lens = seq_lens if checked else _lengths_in_pack(seq_lens, pack_len)[0]
    if layout in ("identity", "contiguous"):
        return contiguous_runs(cp_size, pack_len)
    if layout == "round_robin":  # chunks of the whole pack
        return head_tail_block(np.array([pack_len], dtype=np.int64), None, cp_size, pack_len, False).tables()[0]
    return concat_run_block(layout, cp_size, lens, None, pack_len).tables()[0]


def layout_run_block(layout: str, cp_size: int, seq_lens: Sequence[np.ndarray], pack_len: int,
                     owners: Sequence[np.ndarray | None] | None = None) -> RunBlock | SpanBlock:  # fmt: skip
    """:func:`layout_runs` (``checked=True``) of ``P`` packs at once, for a layout that depends on the documents
    (``thd``, ``balanced``, ``tiled``, ``world``): pack ``p``'s table is ``.tables()[p]``, bit for bit the one
    ``layout_runs`` gives it alone. ``seq_lens``: ``P`` checked int64 ``[D_p]`` slot-length arrays. ``owners``:
    per pack None or its world step's slot owners (int64 ``[D_p, 2]``, :attr:`PackPlan.owners`), ``world`` only."""
    if owners is not None and any(o is not None for o in owners):
        node_size = node_size_of(layout, cp_size)
        if node_size is None:
            raise ValueError(f"slot owners come from a world step (StreamPlan(world_step=...)) and lay out only a "
                             f"'world' layout, got layout {layout!r}")  # fmt: skip
        _check_pack_len(layout, cp_size, pack_len)
        counts = np.array([lens.shape[0] for lens in seq_lens], dtype=np.int64)
        return world_block(np.concatenate(seq_lens), counts, pack_len, cp_size, node_size,
                           cost=world_cost_of(layout), owners=owners)  # fmt: skip
    if len(seq_lens) == 1:
        return concat_run_block(layout, cp_size, seq_lens[0], None, pack_len)
    counts = np.array([lens.shape[0] for lens in seq_lens], dtype=np.int64)
    return concat_run_block(layout, cp_size, np.concatenate(seq_lens), counts, pack_len)


def concat_run_block(layout: str, cp_size: int, lens: np.ndarray, counts: np.ndarray | None, pack_len: int
                     ) -> RunBlock | SpanBlock:  # fmt: skip
    """:func:`layout_run_block` of ``P`` packs given their checked slot lengths back to back: ``lens`` int64
    ``[N]``, ``counts`` int64 ``[P]`` slots per pack (None: one pack)."""
    _check_pack_len(layout, cp_size, pack_len)
    if layout == "balanced":
        return balanced_block(lens, counts, pack_len, cp_size)
    tile = layout_tile(layout)
    if tile is not None:
        return tiled_block(lens, counts, pack_len, cp_size, tile)
    node_size = node_size_of(layout, cp_size)
    if node_size is not None:
        return world_block(lens, counts, pack_len, cp_size, node_size, cost=world_cost_of(layout))
    if layout != "thd":
        raise ValueError(f"layout_run_block takes 'thd', 'balanced', 'tiled' or 'world' (the layouts that depend on "
                         f"the documents), got {layout!r}; use layout_runs")  # fmt: skip
    if pack_len == 0:  # no tail to absorb (and no padding slot for an empty pack)
        return head_tail_block(lens, counts, cp_size, pack_len)
    sizes = np.array([lens.shape[0]], dtype=np.int64) if counts is None else counts
    if sizes.min() == 0:  # an empty pack is one padding slot
        slots = [_absorb_tail(pack, pack_len) for pack in _per_pack(lens, counts)]
        return layout_run_block(layout, cp_size, slots, pack_len)
    flat = lens.copy()
    ends = np.cumsum(sizes)
    totals = np.add.reduceat(flat, ends - sizes) if counts is not None else flat.sum(keepdims=True)
    flat[ends - 1] += pack_len - totals  # every pack's last slot absorbs its tail
    bad = np.flatnonzero(flat % (2 * cp_size))
    if bad.size:  # the first bad pack's first bad slot
        p = int(ends.searchsorted(bad[0], side="right"))
        slots, i = flat[ends[p] - sizes[p] : ends[p]], int(bad[0] - ends[p] + sizes[p])
        raise ValueError(
            f"layout 'thd' needs every document slot to be a multiple of 2*cp_size={2 * cp_size}; "
            f"slot {i} has {int(slots[i])} tokens (slots after tail absorption: {slots.tolist()[:16]}). "
            "Pad each document to that multiple (the packer does this for layout='thd')"
        )
    return head_tail_block(flat, counts, cp_size, pack_len)


def rank_indices(
    layout: str, cp_size: int, seq_lens: Sequence[int] | np.ndarray, pack_len: int, *, tile: int | None = None
) -> np.ndarray:
    """int64 ``[cp_size, pack_len // cp_size]``: the global positions every CP rank owns, in its local order
    (``pack_len`` a multiple of ``alignment(layout, cp)[1]``; ``thd``, cp 2, slots [8, 4, 8]: rank 0 owns
    ``[0,1,6,7, 8,11, 12,13,18,19]``)."""
    return layout_runs(layout, cp_size, seq_lens, pack_len, tile=tile).rows()


def inverse_indices(rows: np.ndarray) -> np.ndarray:
    """int64 ``[cp * L]``: ``inverse[g]`` = position of global token ``g`` in the rank-major concatenation of
    ``rows`` (int64 ``[cp, L]``, :func:`rank_indices`), so ``concat(shards)[inverse] == global``."""
    flat = np.asarray(rows, dtype=np.int64).reshape(-1)
    inverse = np.empty_like(flat)
    inverse[flat] = np.arange(flat.size, dtype=np.int64)
    return inverse


def causal_work(rows: np.ndarray, doc_positions: np.ndarray) -> np.ndarray:
    """float64 ``[cp]``: causal document-masked attention work per rank of ``rows`` (``[cp, L]``); a token at
    position ``p`` of its document (``doc_positions`` int ``[pack_len]``, -1: padding) attends to ``p + 1`` keys."""
    cost = np.where(doc_positions >= 0, doc_positions + 1, 0).astype(np.float64)
    return cost[np.asarray(rows)].sum(axis=1)
