"""``CPSFTTrainer``: TRL's ``SFTTrainer`` with ``SFTConfig(packing=True)``, packed and CP-sharded by cpdata.

TRL prepares the rows as always (chat template, masks, ``labels``) but does not pack: cpdata packs them
(``packing_strategy`` ``"bfd"`` or ``"bfd_split"``: docs/trainers.md says what each does, what is refused),
reading TRL's input-aligned ``labels`` with ``labels_alignment="inputs"``.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from trl import SFTTrainer

from cpdata.errors import refuse_settings
from cpdata.integrations.cp_trainer import CPTrainerMixin
from cpdata.nodes.options import PlanChoice, SchedulePlan, StreamPlan

__all__ = ["CPSFTTrainer", "check_sft_config"]

_STRATEGY_OVERFLOW = {"bfd": None, "bfd_split": "split"}


def check_sft_config(args: Any, capacity: int | None) -> int:
    """The pack capacity for ``args`` (an ``SFTConfig``); ``ValueError`` listing every setting it cannot honour."""
    capacity = args.max_length if capacity is None else capacity
    refuse_settings("CPSFTTrainer", [
        (not args.packing,
         "packing=False: CP trains packs; set packing=True (cpdata packs the tokenized rows)"),
        (args.packing_strategy not in _STRATEGY_OVERFLOW,
         f"packing_strategy={args.packing_strategy!r}: it lets attention cross document boundaries; use one "
         f"of {sorted(_STRATEGY_OVERFLOW)}"),
        (bool(args.use_liger_kernel),
         "use_liger_kernel=True: its fused loss is not the per-rank target sum over the pack's target count"),
        (args.loss_type != "nll", f"loss_type={args.loss_type!r}: only 'nll' is implemented under CP"),
        (args.neftune_noise_alpha is not None,
         "neftune_noise_alpha: NEFTune scales its noise by the sequence length, which differs per CP rank"),
        (capacity is None, "max_length=None and no capacity: give the pack length (SFTConfig(max_length=N))"),
        (capacity is not None and args.packing_strategy == "bfd" and args.max_length is not None
         and args.max_length > capacity,
         f"max_length={args.max_length} > capacity={capacity}: a row truncated to max_length would not fit a "
         "pack; use capacity >= max_length or packing_strategy='bfd_split'"),
    ])  # fmt: skip
    return capacity


class CPSFTTrainer(CPTrainerMixin, SFTTrainer):
    """``trl.SFTTrainer`` + :class:`~cpdata.integrations.cp_trainer.CPTrainerMixin`'s keywords (``capacity``
    defaults to ``args.max_length``)."""

    def __init__(self, model: Any, args: Any = None, *, capacity: int | None = None,
                 plan: PlanChoice = StreamPlan(), **kwargs: Any) -> None:  # fmt: skip
        if args is None:
            raise ValueError("CPSFTTrainer needs args=SFTConfig(packing=True, max_length=..., max_steps=...)")
        capacity = check_sft_config(args, capacity)
        overflow = _STRATEGY_OVERFLOW[args.packing_strategy]
        if overflow is not None and isinstance(plan, (StreamPlan, SchedulePlan)) and plan.overflow is None:
            plan = dataclasses.replace(plan, overflow=overflow)
        super().__init__(model=model, args=args, capacity=capacity, plan=plan, **kwargs)

    def _prepare_dataset(self, dataset: Any, processing_class: Any, args: Any, packing: bool,
                         formatting_func: Any, dataset_name: str) -> Any:  # fmt: skip
        """TRL's preparation without its packing (cpdata packs); no truncation for ``bfd_split``."""
        if args.packing_strategy == "bfd_split":
            args = copy.copy(args)
            args.max_length = None
        return super()._prepare_dataset(dataset, processing_class, args, False, formatting_func, dataset_name)
