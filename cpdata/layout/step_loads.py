"""The open world step's books: each rank's room in each micro-batch, its load (varlen tiles) and the keys it
receives, kept as pieces land and leave, and where a spread piece fits at least busiest load.

:class:`StepLoads` is what every phase reads and writes: the deal (:class:`~cpdata.layout.world_step.StepBins`,
its rules), the settle, the trades and the close (:mod:`cpdata.packing.world_close`). It checks each change (a
piece that does not fit, or leaves a place it does not hold, is refused, the step unchanged) and keeps the ranks'
loads and projected loads sorted as pieces land, so that no piece costs a pass over the world. A rank's
*projected* load is its load plus its free tokens times ``density`` (tiles a token adds, as the pieces to come are
expected to): where it ends if the rest of its room fills like the average. Where a piece fits
(:meth:`StepLoads.choose`, :meth:`StepLoads.choose_widths` for several widths) is one array search over every
window, micro-batch and orientation of its widths (:func:`~cpdata.layout.world_owners.best_windows`), under the
receive cap the books work out; a look at the ranks' most room (:meth:`StepLoads.choose_widths`) and loads
(:meth:`StepLoads.widths_under`) spares the search where no window could fit or stay under a level.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cpdata.layout.ranked import move_key, ranked
from cpdata.layout.world_owners import Placement, best_windows, owner_ranks, role_costs
from cpdata.layout.world_plan import alone_tiles

__all__ = ["RECEIVE_CAP", "StepLoads"]

RECEIVE_CAP = 1.6
"""A spread piece waits rather than lift the step's busiest receiver past the most of: the busiest so far, its own
first role's keys, and this many times the mean rank's received keys after it
(:meth:`~cpdata.layout.world_step.StepBins.place`). A later piece that would wait for the cap alone is tried again
against the mean the spread pieces still to come will make, as far as the room left holds them
(:meth:`StepLoads.choose`): held to the keys dealt so far, a stream of equal documents twice a rank's length fills
one micro-batch and then waits. At 2, web passes Megatron's busiest receiver (1.30 x at 16 x 8K, seed 18); at 1.6
none of web's and long_context's seeds 1-36 does (docs/benchmarks.md, the receive cap)."""


class StepLoads:
    """The books of an open step: ``packs`` world micro-batches of ``world`` ranks (``node_size`` a node) of
    ``local`` tokens (the module docstring). A rank's ``load`` is its step cost: its pieces' varlen tiles (its
    trailing pad costs nothing); ``recv`` the keys it receives; ``room[r][k]`` its free tokens in micro-batch ``k``.
    Deterministic: the same changes in the same order give the same books.
    """

    __slots__ = ("packs", "world", "local", "node_size", "tile", "room", "free", "best_room", "load", "placed",
                 "density", "recv", "_capacity", "_by_load", "_projected", "_total", "_coming",
                 "_spreading")  # fmt: skip

    def __init__(self, packs: int, world: int, local: int, node_size: int, tile: int = 128) -> None:
        self.packs, self.world, self.local, self.node_size, self.tile = packs, world, local, node_size, tile
        self.room = [[local] * packs for _ in range(world)]  # [rank][micro-batch]
        self.free = [local * packs] * world  # per rank, over the micro-batches
        self.best_room = [local] * world  # per rank: the most room of one micro-batch
        self.load = [0.0] * world
        self.recv = [0] * world  # keys each rank receives over the step
        self.placed = 0  # tokens
        self._capacity = packs * world * local
        self.density = 0.0
        # kept sorted as pieces land (a piece changes one rank's entries): no per-piece pass over the world
        self._by_load = ranked([0.0] * world)  # loads
        self._projected = ranked([0.0] * world)  # load + free * density
        self._total = 0.0  # the loads' sum
        self._coming = [0.0, 0, 0.0]  # the whole pieces still expected: tiles, tokens; all's density
        self._spreading = [0, 0]  # the spread pieces still expected: keys received on their fewest ranks, tokens

    def ratio(self) -> float:
        """The busiest rank's load over the mean rank's (inf where nothing is loaded)."""
        total = self.total_load
        return self.busiest_load * self.world / total if total > 0 else float("inf")

    def over(self, fraction: float) -> bool:
        """Whether the busiest rank's load stands more than ``fraction`` above the mean rank's."""
        return self.busiest_load > (1 + fraction) * self.total_load / self.world

    def busiest_rank(self) -> int:
        """The rank of most load (ties: the lowest)."""
        return self.load.index(max(self.load))

    @property
    def busiest_load(self) -> float:
        """The busiest rank's load (kept as pieces land: no pass over the world)."""
        return self._by_load[-1][0]

    @property
    def total_load(self) -> float:
        """The ranks' loads summed (kept as pieces land; loads are whole tiles, so the sum is exact)."""
        return self._total

    @property
    def free_tokens(self) -> int:
        """Tokens of room left in the step."""
        return self._capacity - self.placed

    def set_density(self, pieces: Sequence[int]) -> None:
        """Expect the pieces to come to add tiles per token as ``pieces`` (lengths, in the order :meth:`place`
        will see them) do: as :meth:`place` sees each, the ones left of them, and the room they leave as all of
        them (the stream goes on)."""
        lengths = np.asarray(pieces, dtype=np.int64)
        spread = [0, 0, 0]  # the spread pieces' keys and tiles on their fewest ranks, and tokens
        for s in lengths[lengths > self.local].tolist():
            for i, value in enumerate(self._fewest(s)):
                spread[i] += value
        self._spreading = [spread[0], spread[2]]
        whole = lengths[lengths <= self.local]
        added, tokens = int(alone_tiles(whole, self.tile).sum()), int(whole.sum())  # (each, at once)
        if not tokens and len(pieces):  # only pieces longer than a rank to come: they set the level
            self._coming = [0.0, 0, spread[1] / sum(pieces)]
        else:
            self._coming = [added, tokens, added / tokens if tokens else self.density]
        self._reproject()

    def _fewest(self, s: int) -> tuple[int, int, int]:
        """``(keys, tiles, tokens)``: the keys a spread piece of ``s`` tokens makes its ranks receive and the tiles
        it costs on its fewest ranks, and its tokens; zeros where it cannot spread over this world."""
        fewest = -(-s // self.local)
        cut = self.cut(s, fewest) if fewest <= self.world else None
        return (0, 0, 0) if cut is None else (int(cut[2].sum()), int(cut[1].sum()), s)

    def _reproject(self) -> None:
        added, tokens, mean = self._coming
        beyond = max(self.free_tokens - tokens, 0)
        self.density = (added + mean * beyond) / (tokens + beyond) if tokens + beyond > 0 else mean
        self._projected = ranked([self._project(r) for r in range(self.world)])

    def _project(self, r: int) -> float:
        return self.load[r] + self.free[r] * self.density


    def _best_fit(self, r: int, s: int) -> int:
        """The micro-batch of rank ``r`` with the least room that holds ``s`` tokens (ties: the first)."""
        best, least = -1, self.local + 1
        for k, left in enumerate(self.room[r]):
            if s <= left < least:
                best, least = k, left
        return best

    def first_empty(self) -> int | None:
        """The first micro-batch no rank holds anything of; None where none."""
        return next((k for k in range(self.packs) if all(room[k] == self.local for room in self.room)), None)

    def copy(self) -> StepLoads:
        """An independent copy of the step, of this class (a trial deal changes it, not this one)."""
        other = object.__new__(type(self))
        for name in (name for cls in type(self).__mro__ for name in getattr(cls, "__slots__", ())):
            value = getattr(self, name)
            if name == "room":
                value = [list(room) for room in value]
            elif isinstance(value, list):
                value = list(value)
            setattr(other, name, value)
        return other

    def restore(self, s: int, where: Placement) -> None:
        """Put back a piece :meth:`place` placed at ``where`` (a saved step's)."""
        k, first, c = where
        if c == 1:
            self._take(first, k, s, alone_tiles(s, self.tile))
        else:
            self._take_spread(s, k, first, c)

    def remove(self, s: int, where: Placement) -> None:
        """Take back a piece of ``s`` tokens placed at ``where``, whole (:meth:`take_back`) or spread
        (:meth:`take_back_spread`); :meth:`restore` puts it back."""
        if where[2] == 1:
            self.take_back(s, where)
        else:
            self.take_back_spread(s, where)

    def _lightest(self, s: int, most: float, other_than: int) -> int:
        """The least loaded rank but ``other_than`` with room for ``s`` tokens and a load of at most ``most``."""
        best_room = self.best_room
        for value, r in self._by_load:
            if value > most:
                return -1
            if r != other_than and best_room[r] >= s:
                return r
        return -1

    def take_back(self, s: int, where: Placement) -> None:
        """Remove a whole piece of ``s`` tokens placed at ``where`` (it leaves the step)."""
        k, r, c = where
        if c != 1 or not 0 <= r < self.world or not 0 <= k < self.packs or self.room[r][k] + s > self.local:
            raise ValueError(f"no whole piece of {s} tokens can leave {where} of this step")
        self._take(r, k, -s, -alone_tiles(s, self.tile))

    def _take(self, r: int, k: int, s: int, added: float) -> None:
        self._check_room(r, k, s)
        self._put(r, k, s, added)

    def _check_room(self, r: int, k: int, s: int) -> None:
        """``ValueError`` unless rank ``r`` of micro-batch ``k`` is in the step and has room for ``s`` tokens."""
        if not 0 <= r < self.world or not 0 <= k < self.packs or self.room[r][k] < s:
            raise ValueError(f"a piece of {s} tokens does not fit rank {r} of micro-batch {k} of this step "
                             f"({self.packs} x {self.world} ranks of {self.local} tokens)")  # fmt: skip

    def _put(self, r: int, k: int, s: int, added: float) -> None:
        """:meth:`_take` where the caller found the room (the per-document path: no check)."""
        load, free, room, density = self.load, self.free, self.room[r], self.density
        was, projected = load[r], load[r] + free[r] * density
        left = room[k]
        room[k] = left - s
        free[r] -= s
        if s < 0 or left == self.best_room[r]:  # (only then can the rank's most room change)
            self.best_room[r] = max(room)
        load[r] = now = was + added
        self._total += added
        self.placed += s
        move_key(self._by_load, was, now, r)
        move_key(self._projected, projected, now + free[r] * density, r)

    def roles(self, s: int, c: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """int64 ``[c]`` each (read-only): the tokens, tiles and keys received of each role of a piece of ``s``
        tokens spread over ``c`` ranks of this step (:func:`~cpdata.layout.spread.spread_chunks`).
        ``ValueError`` where that width has no cut."""
        cut = self.cut(s, c)
        if cut is None:
            raise ValueError(f"a piece of {s} tokens has no cut over {c} ranks of {self.local} tokens")
        return cut

    def cut(self, s: int, c: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """:meth:`roles` of a piece of ``s`` tokens on ``c`` ranks, or None where that width has no cut."""
        return role_costs(s, c, self.local, self.tile, self.node_size)

    def take_back_spread(self, s: int, where: Placement) -> None:
        """Remove a piece of ``s`` tokens spread at ``where`` (it leaves the step; :meth:`restore` puts it back).
        ``ValueError``, the step unchanged, where no such piece is there."""
        k, first, c = where
        if abs(c) < 2:
            raise ValueError(f"no piece of {s} tokens spread over {c} ranks can leave {where} of this step")
        ranks, roles = owner_ranks(first, c), [role.tolist() for role in self.roles(s, abs(c))]
        for r, need in zip(ranks, roles[0], strict=True):
            if not 0 <= k < self.packs or not 0 <= r < self.world or self.room[r][k] + need > self.local:
                raise ValueError(f"no piece of {s} tokens spread at {where} holds {need} tokens of rank {r}")
        for r, need, added, keys in zip(ranks, *roles, strict=True):
            self._put(r, k, -need, -added)
            self.recv[r] -= keys

    def _take_spread(self, s: int, k: int, first: int, c: int) -> None:
        """Spread ``s`` tokens at ``(k, first, c)``; ``ValueError``, the step unchanged, where a role does not fit."""
        ranks, roles = owner_ranks(first, c), [role.tolist() for role in self.roles(s, abs(c))]
        for r, need in zip(ranks, roles[0], strict=True):
            self._check_room(r, k, need)
        for r, need, added, keys in zip(ranks, *roles, strict=True):
            self._put(r, k, need, added)
            self.recv[r] += keys

    def snapshot(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The ranks' room (int64 ``[world, packs]``), loads (float64 ``[world]``) and received keys (int64
        ``[world]``) as arrays."""
        return np.array(self.room, dtype=np.int64), np.array(self.load), np.array(self.recv, dtype=np.int64)

    def choose(self, s: int, c: int, cap: float | None = None, pack: int | None = None,
               arrays: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None, coming: bool = False
               ) -> tuple[float, int, int, int] | None:  # fmt: skip
        """``(busiest load after, micro-batch, first rank, signed ranks)``: where a piece of ``s`` tokens on ``c``
        ranks fits at least busiest load (:func:`~cpdata.layout.world_owners.best_window`: every window, either
        orientation, micro-batch ``pack`` alone where given), its busiest receiver within ``cap`` (None: the
        receive cap, :data:`RECEIVE_CAP`, its mean counting, with ``coming``, the keys the spread pieces still to
        come (:meth:`set_density`) would add on their fewest ranks, as many of them as the room left holds); None
        where none. The caller holds that load to its level: the least placement past it means none within it.
        ``arrays``: :meth:`snapshot` of the state as it is, where the caller tries several widths of one piece."""
        return self.choose_widths(s, (c,), cap, pack, arrays, coming)[0]

    def widths_under(self, s: int, widths: Sequence[int], level: float, strict: bool = False) -> list[int]:
        """The widths of ``widths`` where a piece of ``s`` tokens has a cut that some window could leave at or under
        ``level`` (``strict``: under it) at its busiest rank: no window of ``c`` ranks ends less loaded than the
        ``c``-th least loaded rank, or the least loaded one plus the cut's dearest role (a look at the loads, where
        most searches of a step that fills find nothing)."""
        least, out = sorted(self.load), []
        for c in widths:
            cut = self.cut(s, c) if c <= self.world else None
            if cut is not None and ((floor := max(least[c - 1], least[0] + int(cut[1].max()))) < level
                                    or (floor == level and not strict)):  # fmt: skip
                out.append(c)
        return out

    def choose_widths(self, s: int, widths: Sequence[int], cap: float | None = None, pack: int | None = None,
                      arrays: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None, coming: bool = False
                      ) -> list[tuple[float, int, int, int] | None]:  # fmt: skip
        """:meth:`choose` at each of ``widths``, in their order, in one search
        (:func:`~cpdata.layout.world_owners.best_windows`): a width with no cut is None, and so is one whose least
        role is more than all but fewer than its ranks have room for in any one micro-batch (most searches of a step
        that fills, a look at each rank's most room instead of a search)."""
        most_room = sorted(self.best_room, reverse=True)
        cuts = [cut if c <= self.world and (cut := self.cut(s, c)) is not None and most_room[c - 1] >= int(cut[0].min())
                else None for c in widths]  # fmt: skip
        found = [cut for cut in cuts if cut is not None]
        if not found:
            return [None] * len(cuts)
        room, load, recv = self.snapshot() if arrays is None else arrays
        caps = [cap] * len(found)
        if cap is None:  # the receive cap, each width its own
            to_come = 0.0
            if coming and self._spreading[1]:  # the keys of the spread pieces to come, in the room left
                to_come = self._spreading[0] * min(1.0, max(self.free_tokens - s, 0) / self._spreading[1])
            most, total = int(recv.max()), int(recv.sum())
            caps = [max(most, int(cut[2].max()), RECEIVE_CAP * (total + int(cut[2].sum()) + to_come) / self.world)
                    for cut in found]  # fmt: skip
        best = iter(best_windows(found, room, load, recv, caps, self.node_size, pack))
        return [None if cut is None else next(best) for cut in cuts]
