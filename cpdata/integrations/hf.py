"""``CPTrainer``: a ``transformers.Trainer`` that trains with context parallelism on cpdata's packs.

``CPTrainer(model=..., args=TrainingArguments(max_steps=N), train_dataset=docs, cp_size=2, capacity=4096)``
under ``torchrun`` (docs/trainers.md); ``train_dataset`` is anything ``CPDataset`` reads.
"""

from __future__ import annotations

from transformers import Trainer

from cpdata.integrations.cp_trainer import CPTrainerMixin

__all__ = ["CPTrainer"]


class CPTrainer(CPTrainerMixin, Trainer):
    """``transformers.Trainer`` + :class:`~cpdata.integrations.cp_trainer.CPTrainerMixin`'s keywords."""

    def __init__(self, *args, data_collator=None, **kwargs) -> None:
        if data_collator is not None:
            raise ValueError("CPTrainer takes no data_collator: cpdata packs, collates and shards the batches "
                             "(pass plan=cpdata.StreamPlan(...) for the packer's settings)")  # fmt: skip
        super().__init__(*args, **kwargs)
