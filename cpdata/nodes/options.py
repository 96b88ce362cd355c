"""The typed options of :func:`~cpdata.build_loader`, :class:`~cpdata.CPDataset` and :func:`~cpdata.precompute`.

Choices that belong together travel as one frozen, keyword-only record, checked when built::

    build_loader(docs, capacity=8192, cp_size=4, cp_rank=r, layout="thd",
                 plan=SchedulePlan(micro_batches=2),            # how packs are planned
                 data=DataPolicy(dp_rank=d, dp_size=8, shuffle=True, epochs=3),  # which documents, in what order
                 delivery=Delivery(prefetch=4, kv_exchange=True))               # how batches reach the step

The plan is a :class:`StreamPlan` or a :class:`SchedulePlan`, each holding only its own planner's options;
:class:`Delivery` never changes which batches (none of it is in the saved state). One spelling per
concept (``epochs``, ``window``); the keywords of 0.3 are refused naming their field (:data:`RENAMED`).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Collection, Mapping
from typing import Any, TypeAlias

from cpdata.errors import check_bool, check_choice, check_int
from cpdata.nodes.shuffle_buffer import DEFAULT_SHUFFLE_BUFFER
from cpdata.packing.records import ALGORITHMS, DEFAULT_ALGORITHM, OVERFLOW_POLICIES
from cpdata.schedule import TAIL_POLICIES, CostModel
from cpdata.worker.targets import LabelsAlignment, check_labels_alignment

__all__ = [
    "RENAMED",
    "SCHEDULES",
    "DataPolicy",
    "Delivery",
    "ENTRY_KEYWORDS",
    "PlanChoice",
    "SchedulePlan",
    "StreamPlan",
    "check_records",
    "refuse_keywords",
]

SCHEDULES: tuple[str, ...] = ("balanced", "in_order")
"""``balanced``: packs cost-balanced (:class:`~cpdata.schedule.CostModel`); ``in_order``: dealt in order."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StreamPlan:
    """Pack documents as they stream (:class:`~cpdata.nodes.pack.Pack`): any source, no lengths needed; DP
    ranks may end an epoch a few steps apart (:class:`SchedulePlan` gives equal steps)."""

    algorithm: str = DEFAULT_ALGORITHM
    """Packing algorithm, one of :data:`cpdata.packing.ALGORITHMS` (``bfd`` packs best from a mixed order)."""
    overflow: str | None = None
    """Documents longer than a pack: ``"error"`` (None: the algorithm's default), ``"split"``, ``"truncate"``,
    ``"drop"``."""
    window: int | None = None
    """Documents planned at once (None: :data:`cpdata.packing.DEFAULT_WINDOW`; all for ``ffd``): larger
    windows pack tighter and hold more in memory."""
    shuffle_buffer: int = DEFAULT_SHUFFLE_BUFFER
    """With ``DataPolicy(shuffle=True)`` over a stream (no ``len``): documents held to draw from."""
    world_step: int = 1
    """Under a ``world`` layout, micro-batches dealt together (:mod:`cpdata.packing.world_steps`): pass the
    micro-batches the trainer accumulates a step, so each rank's tiles summed over a step balance; 1: each
    micro-batch by itself."""

    def __post_init__(self) -> None:
        check_choice("StreamPlan.algorithm", self.algorithm, ALGORITHMS)
        check_int("StreamPlan.world_step", self.world_step, min=1, fix=" (micro-batches dealt together)")
        check_choice("StreamPlan.overflow", self.overflow, OVERFLOW_POLICIES, optional=True)
        check_int("StreamPlan.window", self.window, min=1, optional=True)
        check_int("StreamPlan.shuffle_buffer", self.shuffle_buffer, min=1)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SchedulePlan:
    """Plan every document's length first (:func:`cpdata.schedule.plan_schedule`): every DP rank gets the
    same steps of ``micro_batches`` packs, cost-balanced, reading only its own documents. Needs the lengths
    and an indexable source, or ``window`` (a stream planned window by window)."""

    kind: str = "balanced"
    """``"balanced"``: packs balanced by attention cost; ``"in_order"``: the planner's packs dealt in order."""
    micro_batches: int = 1
    """Packs per DP rank per step."""
    max_delay: int = 0
    """Steps a long document may wait for partners of its size."""
    cost: CostModel | None = None
    """``kind="balanced"`` only: the cost model (None: the FlexSP 7B fit)."""
    tail: str = "pad"
    """The last, short step: ``"pad"`` it with empty packs or ``"drop"`` it."""
    lengths: Any = dataclasses.field(default=None, compare=False)
    """Token count of every document (None: ``source.lengths``); not with ``window``."""
    window: int | None = None
    """Plan a stream without lengths in windows of this many documents (None: plan all documents at once)."""
    algorithm: str = DEFAULT_ALGORITHM
    """Packing algorithm of the planner (as :attr:`StreamPlan.algorithm`)."""
    overflow: str | None = None
    """Documents longer than a pack (as :attr:`StreamPlan.overflow`)."""

    def __post_init__(self) -> None:
        check_choice("SchedulePlan.kind", self.kind, SCHEDULES)
        check_int("SchedulePlan.micro_batches", self.micro_batches, min=1)
        check_int("SchedulePlan.max_delay", self.max_delay, min=0)
        check_choice("SchedulePlan.tail", self.tail, TAIL_POLICIES)
        check_int("SchedulePlan.window", self.window, min=1, optional=True)
        check_choice("SchedulePlan.algorithm", self.algorithm, ALGORITHMS)
        check_choice("SchedulePlan.overflow", self.overflow, OVERFLOW_POLICIES, optional=True)
        if self.cost is not None:
            if not isinstance(self.cost, CostModel):
                raise TypeError(f"SchedulePlan.cost must be a cpdata.CostModel or None, got {type(self.cost).__name__}")
            if self.kind != "balanced":
                raise ValueError(f"SchedulePlan.cost balances packs by cost; kind={self.kind!r} deals them in order: "
                                 "drop cost= or use kind='balanced'")  # fmt: skip
        if self.window is not None and self.lengths is not None:
            raise ValueError("SchedulePlan.window plans a stream from the lengths it reads window by window; "
                             "SchedulePlan.lengths plans every document at once: give one of them")  # fmt: skip


PlanChoice: TypeAlias = StreamPlan | SchedulePlan
"""How packs are planned: as documents stream, or by a global schedule."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DataPolicy:
    """Which documents a DP rank reads, in what order, and what their tokens must satisfy."""

    dp_rank: int = 0
    """This data-parallel rank, ``0 <= dp_rank < dp_size``."""
    dp_size: int = 1
    """Data-parallel ranks (a stream gives rank ``r`` documents ``i % dp_size == r``)."""
    seed: int = 0
    """Seed of the planner and of the shuffled order ``(seed, epoch)``."""
    shuffle: bool = False
    """A fresh permutation of a sequence source every epoch (a stream: through ``StreamPlan.shuffle_buffer``)."""
    epochs: int | None = None
    """Passes per ``iter()`` (None: one); ``precompute``: the epochs of a :func:`cpdata.mix` to plan."""
    vocab_size: int | None = None
    """Token ids ``>= vocab_size`` are refused, naming the document (negative ids always are)."""
    labels_alignment: LabelsAlignment | None = None
    """``"inputs"`` (HF, TRL, torchtune) or ``"targets"`` (Megatron, NeMo): the meaning of ``labels`` and
    masks, required when documents carry any (:mod:`cpdata.worker.targets`)."""

    def __post_init__(self) -> None:
        check_int("DataPolicy.dp_size", self.dp_size, min=1)
        check_int("DataPolicy.dp_rank", self.dp_rank, min=0)
        if self.dp_rank >= self.dp_size:
            raise ValueError(f"need 0 <= dp_rank < dp_size, got dp_rank={self.dp_rank}, dp_size={self.dp_size}")
        check_int("DataPolicy.seed", self.seed, min=0)
        check_bool("DataPolicy.shuffle", self.shuffle)
        check_int("DataPolicy.epochs", self.epochs, min=1, optional=True)
        check_int("DataPolicy.vocab_size", self.vocab_size, min=1, optional=True)
        check_labels_alignment(self.labels_alignment)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Delivery:
    """How batches are made and handed over; never which batches, so none of these is in the saved state."""

    prefetch: int | None = None
    """Batches prepared ahead in a background thread (None: 2 for ``build_loader``, 0 for ``CPDataset``,
    whose DataLoader already queues ``prefetch_factor`` batches per worker)."""
    pin_memory: bool | None = None
    """``build_loader`` only: pin batches (None: when CUDA is available). A ``CPDataset`` leaves pinning
    to ``StatefulDataLoader(pin_memory=...)``."""
    block_size: int | None = None
    """Batches :class:`~cpdata.nodes.shard.ShardForRank` prepares at once (None: 16, more for short packs)."""
    kv_exchange: bool = False
    """Build each batch's K/V exchange plan on the worker (``batch.layout.kv_exchange``): attention then
    moves only the keys each rank needs instead of all-gathering K/V."""

    def __post_init__(self) -> None:
        check_int("Delivery.prefetch", self.prefetch, min=0, optional=True)
        check_bool("Delivery.pin_memory", self.pin_memory, optional=True)
        check_int("Delivery.block_size", self.block_size, min=1, optional=True)
        check_bool("Delivery.kv_exchange", self.kv_exchange)


def check_records(*, plan: Any = None, data: Any = None, delivery: Any = None) -> None:
    """Refuse a record of the wrong kind for ``plan=``, ``data=`` or ``delivery=`` (None: not checked)."""
    for name, value, kinds, example in (
        ("plan", plan, (StreamPlan, SchedulePlan), "plan=cpdata.SchedulePlan(micro_batches=2)"),
        ("data", data, (DataPolicy,), "data=cpdata.DataPolicy(dp_rank=0, dp_size=2)"),
        ("delivery", delivery, (Delivery,), "delivery=cpdata.Delivery(prefetch=0)"),
    ):
        if value is not None and not isinstance(value, kinds):
            wanted = " or a ".join(k.__name__ for k in kinds)
            raise TypeError(f"{name} must be a {wanted}, got {type(value).__name__} {value!r}; e.g. {example}")


ENTRY_KEYWORDS: tuple[str, ...] = ("capacity", "cp_size", "cp_rank", "layout", "tile", "batch_size", "qkv_format",
                                   "padding_token_id", "plan", "data", "delivery")  # fmt: skip
"""The keywords ``build_node`` and ``CPDataset`` take (``build_loader`` adds ``restart_on_stop_iteration``)."""

RENAMED: Mapping[str, tuple[str, str]] = {
    **{k: ("plan", f"StreamPlan.{k} or SchedulePlan.{k}") for k in ("algorithm", "overflow")},
    **{k: ("plan", f"StreamPlan.{k}") for k in ("window", "shuffle_buffer")},
    "schedule": ("plan", "SchedulePlan.kind"),
    "schedule_window": ("plan", "SchedulePlan.window"),
    **{k: ("plan", f"SchedulePlan.{k}") for k in ("micro_batches", "max_delay", "cost", "lengths", "tail")},
    **{k: ("data", f"DataPolicy.{k}") for k in ("dp_rank", "dp_size", "seed", "shuffle")},
    "num_epochs": ("data", "DataPolicy.epochs"),
    **{k: ("data", f"DataPolicy.{k}") for k in ("epochs", "vocab_size", "labels_alignment")},
    **{k: ("delivery", f"Delivery.{k}") for k in ("prefetch", "pin_memory", "block_size", "kv_exchange")},
}
"""Keyword of cpdata 0.3 -> (the keyword that now carries it, ``Record.field``): the one table of renames."""


def refuse_keywords(caller: str, given: Mapping[str, Any], accepted: Collection[str]) -> None:
    """Raise ``TypeError`` for the first keyword in ``given`` (``caller``'s ``**removed``): a keyword of 0.3
    naming its record and field, any other as Python does, with the close match among ``accepted`` and the
    old keywords."""
    for name in given:
        if name in RENAMED:
            raise TypeError(f"{caller}() no longer takes {name}=; pass {_replacement(name)}")
        close = difflib.get_close_matches(name, [*accepted, *RENAMED], n=1)
        if not close:
            hint = f"it takes {', '.join(accepted)}"
        elif close[0] in RENAMED:
            hint = f"did you mean {close[0]!r}? It is now {_replacement(close[0])}"
        else:
            hint = f"did you mean {close[0]!r}?"
        raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}; {hint}")


def _replacement(old: str) -> str:
    """``"data=DataPolicy(epochs=...) (DataPolicy.epochs)"`` for ``num_epochs``."""
    keyword, field = RENAMED[old]
    record, _, attr = field.partition(" or ")[0].partition(".")
    return f"{keyword}={record}({attr}=...) ({field})"
