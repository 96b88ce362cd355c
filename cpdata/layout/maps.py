"""CP layouts: which global token positions each context-parallel rank owns.

Every layout is one integer map. ``rank_indices(...)[r]`` holds the global
positions (``0 .. pack_len-1``) of rank ``r``'s tokens in rank ``r``'s local
order, so ``local = global[rows[r]]``; the rows together are a permutation of
``range(pack_len)`` and all have ``pack_len // cp_size`` entries. The inverse
(``inverse_indices``) turns the rank-major concatenation of all shards back into
global order: ``global = concat(shards)[inverse]``.

| layout        | rank r owns                                        | doc / pack multiple |
|---------------|----------------------------------------------------|---------------------|
| ``identity``  | everything (cp = 1)                                | 1 / 1               |
| ``contiguous``| ``[r*L, (r+1)*L)``                                 | 1 / cp              |
| ``round_robin``| chunks r and 2cp-1-r of the whole pack (torch ``context_parallel``) | 1 / 2cp |
| ``thd``       | chunks r and 2cp-1-r of every document slot (TE THD) | 2cp / 2cp         |
| ``balanced``  | per-document head-tail, remainder from the middle dealt round-robin | 1 / cp |
| ``tiled``     | whole ``tile``-token blocks, dealt to balance live kernel tiles (:mod:`cpdata.layout.tiled`) | 1 / cp*tile |
| ``world``     | whole documents, long ones spread over few ranks of one node (:mod:`cpdata.layout.world`) | 1 / cp |

``tiled`` takes a tile size (64, 128 or 256; 128 by default): ``rank_indices("tiled", cp, lens, S, tile=256)``.
Everywhere a layout travels as a string (packer, loader state, digest, precompute manifest), the tile travels
in it: :func:`layout_spec` gives ``"tiled"`` for tile 128 and ``"tiled:64"`` / ``"tiled:256"`` for the others,
and every function here accepts either form. ``world`` carries its ranks per node the same way:
``layout_spec("world", node_size=8)`` is ``"world:8"`` (``"world"``: the whole world is one node).

``seq_lens`` are the document slots laid out in the pack, in order; the pack's
tail (``pack_len - sum(seq_lens)``) is padding. For ``thd`` the last slot
absorbs that tail, as Transformer Engine requires (tokens past
``cu_seqlens_padded[-1]`` break its partition).

All functions are pure, vectorized numpy and picklable: they run on dataloader
workers. Cost: O(pack_len) time and memory, a few ms at 128K tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cpdata.errors import check_int, is_int
from cpdata.layout.blocks import balanced_block, balanced_runs, head_tail_block, head_tail_runs
from cpdata.layout.runs import RunBlock, RunTable, contiguous_runs
from cpdata.layout.tiled import DEFAULT_TILE, TILES, TiledBlock, TiledTable, tiled_block
from cpdata.layout.world import WorldBlock, WorldTable, world_block

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
]

LAYOUTS: tuple[str, ...] = ("balanced", "contiguous", "identity", "round_robin", "thd", "tiled", "world")


def layout_spec(layout: str, tile: int | None = None, *, node_size: int | None = None) -> str:
    """The layout string that carries ``tile``: ``"tiled"`` (tile 128), ``"tiled:64"``, ``"tiled:256"``; or
    ``node_size``: ``"world:8"``; any other layout unchanged (``tile`` and ``node_size`` must then be None).
    Raises ``ValueError`` for a tile ``tiled`` lacks or a node size below 1."""
    if node_size is not None:
        if tile is not None or _split(layout)[0] != "world":
            raise ValueError(f"node_size={node_size} applies to layout 'world' alone (no tile), got layout "
                             f"{layout!r}, tile={tile}")  # fmt: skip
        check_int("node_size", node_size, min=1, fix=" (ranks per node, torchrun's local world size)")
        given = _split(layout)[1]
        if given is not None and given != node_size:
            raise ValueError(f"layout {layout!r} already says node size {given}, but node_size={node_size} was "
                             "given; give one")  # fmt: skip
        return f"world:{int(node_size)}"
    if tile is None:
        return layout
    if not is_int(tile):
        raise TypeError(f"tile must be an int, got {type(tile).__name__} {tile!r}")
    name, given = _split(layout)
    if name != "tiled":
        raise ValueError(f"tile={tile} applies to layout 'tiled' only, got layout {layout!r}; drop tile= "
                         "or use layout='tiled'")  # fmt: skip
    if given is not None and given != tile:
        raise ValueError(f"layout {layout!r} already says tile {given}, but tile={tile} was given; give one")
    if int(tile) not in TILES:
        raise ValueError(f"tile must be one of {list(TILES)} (the kernel's block size), got tile={tile}")
    return "tiled" if int(tile) == DEFAULT_TILE else f"tiled:{int(tile)}"


def _split(layout: str) -> tuple[str, int | None]:
    """``"tiled:256"`` -> ``("tiled", 256)``; ``"world:8"`` -> ``("world", 8)``; ``"thd"`` -> ``("thd", None)``;
    malformed -> ``(layout, None)``."""
    for name in ("tiled", "world"):
        if isinstance(layout, str) and layout.startswith(f"{name}:"):
            digits = layout[len(name) + 1 :]
            if digits.isdigit():
                return name, int(digits)
    return layout, None


def node_size_of(layout: str, cp_size: int) -> int | None:
    """Ranks per node of a ``world`` layout string (``"world"``: ``cp_size``, one node); None for others."""
    name, size = _split(layout)
    if name != "world":
        return None
    return cp_size if size is None else size


def layout_tile(layout: str) -> int | None:
    """The tile size of a ``tiled`` layout string (``"tiled"`` -> 128); None for other layouts."""
    name, tile = _split(layout)
    if name != "tiled":
        return None
    return DEFAULT_TILE if tile is None else tile


def check_layout(layout: str, cp_size: int) -> None:
    """Validate a layout name and CP size; raise ``ValueError`` naming the fix."""
    name, tile = _split(layout)
    if not isinstance(layout, str) or name not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {list(LAYOUTS)} (tiled: also 'tiled:64', "
                         "'tiled:256'; world: 'world:<node_size>')")  # fmt: skip
    if name == "tiled" and tile is not None and (tile not in TILES or tile == DEFAULT_TILE):
        raise ValueError(f"layout {layout!r}: the tile must be one of {list(TILES)}, and 128 is written 'tiled'; "
                         "build the string with layout_spec('tiled', tile)")  # fmt: skip
    if not is_int(cp_size):
        raise TypeError(f"cp_size must be an int, got {type(cp_size).__name__} {cp_size!r}")
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got cp_size={cp_size}; use cp_size=1 to turn context parallelism off")
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
    """``(doc_multiple, pack_multiple)`` the packer must honour for ``layout``.

    Each document slot is padded to a multiple of ``doc_multiple``; the pack
    length must be a multiple of ``pack_multiple`` (``tiled``: ``cp * tile``).
    """
    layout = layout_spec(layout, tile)
    check_layout(layout, cp_size)
    tile = layout_tile(layout)
    if tile is not None:
        return 1, cp_size * tile
    if layout == "thd":
        return 2 * cp_size, 2 * cp_size
    if layout == "round_robin":
        return 1, 2 * cp_size
    if layout in ("contiguous", "balanced") or _split(layout)[0] == "world":
        return 1, cp_size
    return 1, 1


def _as_lengths(seq_lens: Sequence[int] | np.ndarray, pack_len: int) -> tuple[np.ndarray, int]:
    """Checked int64 ``[n]`` lengths and their sum."""
    lens = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
    check_int("pack_len", pack_len, min=0)
    if lens.size and lens.min() < 0:
        bad = int(np.flatnonzero(lens < 0)[0])
        raise ValueError(f"seq_lens must be >= 0, got seq_lens[{bad}]={int(lens[bad])}")
    total = int(lens.sum())
    if total > pack_len:
        raise ValueError(
            f"seq_lens sum to {total} tokens, more than pack_len={pack_len}; "
            "raise the capacity or pack fewer documents"
        )
    return lens, total


def _absorb_tail(lens: np.ndarray, total: int, pack_len: int) -> np.ndarray:
    if lens.size == 0:
        return np.array([pack_len], dtype=np.int64) if pack_len else lens.copy()
    slots = lens.copy()
    slots[-1] += pack_len - total
    return slots


def thd_slot_lens(seq_lens: Sequence[int] | np.ndarray, pack_len: int) -> np.ndarray:
    """Slot lengths as TE sees them: the last slot absorbs the pack's tail padding.

    With no slots, the whole pack is one (padding) slot.
    """
    return _absorb_tail(*_as_lengths(seq_lens, pack_len), pack_len)


def _thd_slots(lens: np.ndarray, total: int, pack_len: int, cp_size: int) -> np.ndarray:
    slots = _absorb_tail(lens, total, pack_len)
    bad = np.flatnonzero(slots % (2 * cp_size))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"layout 'thd' needs every document slot to be a multiple of 2*cp_size={2 * cp_size}; "
            f"slot {i} has {int(slots[i])} tokens (slots after tail absorption: {slots.tolist()[:16]}). "
            "Pad each document to that multiple (the packer does this for layout='thd')"
        )
    return slots


def layout_runs(
    layout: str, cp_size: int, seq_lens: Sequence[int] | np.ndarray, pack_len: int, *, checked: bool = False,
    tile: int | None = None,
) -> RunTable | TiledTable | WorldTable:
    """The layout as a :class:`~cpdata.layout.runs.RunTable` (arguments as :func:`rank_indices`; ``tiled``: a
    :class:`~cpdata.layout.tiled.TiledTable`, the same verbs).

    The table gives any rank's row, the inverse map and (``thd``,
    ``balanced``) the causal work per rank, each in one vectorized pass.
    ``checked=True``: ``seq_lens`` is already an int64 array of non-negative
    lengths summing to at most ``pack_len`` (a stream's checked slot tables),
    so those checks (two reductions) are skipped; the layout, the CP size and
    the pack multiple are still checked.
    """
    layout = layout_spec(layout, tile)
    _, pack_multiple = alignment(layout, cp_size)
    if checked:
        lens, total = seq_lens, None
    else:
        lens, total = _as_lengths(seq_lens, pack_len)
    if pack_len % pack_multiple:
        raise ValueError(
            f"layout {layout!r} with cp_size={cp_size} needs pack_len to be a multiple of {pack_multiple}, "
            f"got pack_len={pack_len}; pad the pack to {pack_len + (-pack_len) % pack_multiple}"
        )
    if layout in ("identity", "contiguous"):
        return contiguous_runs(cp_size, pack_len)
    if layout == "round_robin":
        return head_tail_runs(np.array([pack_len], dtype=np.int64), cp_size, with_docs=False, pack_len=pack_len)
    if layout == "thd":
        total = int(lens.sum()) if total is None else total
        return head_tail_runs(_thd_slots(lens, total, pack_len, cp_size), cp_size, with_docs=True, pack_len=pack_len)
    tile = layout_tile(layout)
    if tile is not None:
        return tiled_block(lens, None, pack_len, cp_size, tile).tables()[0]
    node_size = node_size_of(layout, cp_size)
    if node_size is not None:
        return world_block(lens, None, pack_len, cp_size, node_size).tables()[0]
    return balanced_runs(lens, pack_len, cp_size)


def layout_run_block(layout: str, cp_size: int, seq_lens: Sequence[np.ndarray], pack_len: int
                     ) -> RunBlock | TiledBlock | WorldBlock:  # fmt: skip
    """:func:`layout_runs` (``checked=True``) of ``P`` packs of ``pack_len`` tokens at once, for a layout
    that depends on the documents (``thd``, ``balanced``; the others' tables are the same for every pack).

    ``seq_lens``: ``P`` checked int64 ``[D_p]`` slot-length arrays. One block builder call over their
    concatenation (:func:`concat_run_block`): pack ``p``'s table is ``.tables()[p]``, bit for bit the one
    ``layout_runs`` gives it alone. Raises the error ``layout_runs`` raises for the first bad pack.
    """
    if len(seq_lens) == 1:
        return concat_run_block(layout, cp_size, seq_lens[0], None, pack_len)
    counts = np.array([lens.shape[0] for lens in seq_lens], dtype=np.int64)
    return concat_run_block(layout, cp_size, np.concatenate(seq_lens), counts, pack_len)


def concat_run_block(layout: str, cp_size: int, lens: np.ndarray, counts: np.ndarray | None, pack_len: int
                     ) -> RunBlock | TiledBlock | WorldBlock:  # fmt: skip
    """:func:`layout_run_block` of ``P`` packs given their checked slot lengths back to back: ``lens`` int64
    ``[N]``, ``counts`` int64 ``[P]`` slots per pack (None: one pack)."""
    _, pack_multiple = alignment(layout, cp_size)
    if pack_len % pack_multiple:
        layout_runs(layout, cp_size, _per_pack(lens, counts)[0], pack_len, checked=True)  # its error
    if layout == "balanced":
        return balanced_block(lens, counts, pack_len, cp_size)
    tile = layout_tile(layout)
    if tile is not None:
        return tiled_block(lens, counts, pack_len, cp_size, tile)
    node_size = node_size_of(layout, cp_size)
    if node_size is not None:
        return world_block(lens, counts, pack_len, cp_size, node_size)
    if layout != "thd":
        raise ValueError(f"layout_run_block takes 'thd', 'balanced', 'tiled' or 'world' (the layouts that depend on the "
                         f"documents), "
                         f"got {layout!r}; use layout_runs")  # fmt: skip
    sizes = np.array([lens.shape[0]], dtype=np.int64) if counts is None else counts
    if sizes.min() == 0:  # an empty pack is one padding slot
        slots = [_absorb_tail(pack, int(pack.sum()), pack_len) for pack in _per_pack(lens, counts)]
        return layout_run_block(layout, cp_size, slots, pack_len)
    flat = lens.copy()
    ends = np.cumsum(sizes)
    totals = np.add.reduceat(flat, ends - sizes) if counts is not None else flat.sum(keepdims=True)
    flat[ends - 1] += pack_len - totals  # every pack's last slot absorbs its tail
    if (flat % (2 * cp_size)).any():
        for pack in _per_pack(lens, counts):  # the first bad pack's error
            _thd_slots(pack, int(pack.sum()), pack_len, cp_size)
    return head_tail_block(flat, counts, cp_size, pack_len)


def _per_pack(lens: np.ndarray, counts: np.ndarray | None) -> list[np.ndarray]:
    """``lens`` int64 ``[N]`` split into the packs' ``counts`` int64 ``[P]`` slots (None: one pack)."""
    return [lens] if counts is None else np.split(lens, np.cumsum(counts)[:-1])


def rank_indices(
    layout: str, cp_size: int, seq_lens: Sequence[int] | np.ndarray, pack_len: int, *, tile: int | None = None
) -> np.ndarray:
    """Global positions owned by every CP rank, in each rank's local order.

    Args:
        layout: one of :data:`LAYOUTS`.
        cp_size: number of CP ranks (>= 1).
        seq_lens: document slot lengths laid out in the pack, in order
            (``sum <= pack_len``; the rest is tail padding).
        pack_len: tokens in the pack, a multiple of ``alignment(layout, cp)[1]``.
        tile: ``tiled`` only: the kernel's tile (64, 128 or 256; None: the layout string's, 128 for
            ``"tiled"``).

    Returns:
        int64 ``[cp_size, pack_len // cp_size]``; the rows form a permutation of
        ``range(pack_len)``.

    Example (``thd``, cp=2, slots [8, 4, 8]): rank 0 -> ``[0,1,6,7, 8,11, 12,13,18,19]``.
    """
    return layout_runs(layout, cp_size, seq_lens, pack_len, tile=tile).rows()


def inverse_indices(rows: np.ndarray) -> np.ndarray:
    """Inverse of a layout: ``concat(shards)[inverse] == global``.

    Args:
        rows: int64 ``[cp_size, local_len]`` from :func:`rank_indices`.

    Returns:
        int64 ``[cp_size * local_len]`` with ``inverse[g]`` = position of global
        token ``g`` in the rank-major concatenation. O(n) scatter, no sort.
    """
    flat = np.asarray(rows, dtype=np.int64).reshape(-1)
    inverse = np.empty_like(flat)
    inverse[flat] = np.arange(flat.size, dtype=np.int64)
    return inverse


def causal_work(rows: np.ndarray, doc_positions: np.ndarray) -> np.ndarray:
    """Causal document-masked attention work per rank.

    A real token at position p of its document attends to p+1 keys; pads cost 0.

    Args:
        rows: ``[cp_size, local_len]`` from :func:`rank_indices`.
        doc_positions: int ``[pack_len]``, each token's position inside its
            document, -1 for padding.

    Returns:
        float64 ``[cp_size]`` work per rank.
    """
    cost = np.where(doc_positions >= 0, doc_positions + 1, 0).astype(np.float64)
    return cost[np.asarray(rows)].sum(axis=1)
