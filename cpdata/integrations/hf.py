"""``CPTrainer``: a ``transformers.Trainer`` that trains with context parallelism on cpdata's packs.

::

    trainer = CPTrainer(model=model, args=TrainingArguments(max_steps=1000, ...), train_dataset=tokenized,
                        cp_size=2, capacity=4096, layout="balanced")
    trainer.train()          # torchrun --nproc-per-node 4 train.py  ->  dp 2 x cp 2

``train_dataset`` holds tokenized documents (anything :class:`~cpdata.nodes.dataset.CPDataset` reads, e.g. a
``datasets.Dataset`` with ``input_ids`` and optionally HF-aligned ``labels`` / ``assistant_masks``). No
``data_collator``: a micro-batch is ``per_device_train_batch_size`` packs, each rank getting its CP share.
"""

from __future__ import annotations

from transformers import Trainer

from cpdata.integrations.cp_trainer import CPTrainerMixin

__all__ = ["CPTrainer"]


class CPTrainer(CPTrainerMixin, Trainer):
    """``transformers.Trainer`` + ``cp_size``, ``capacity``, ``layout``, ``plan``, ``data``, ``delivery`` (see
    :class:`~cpdata.integrations.cp_trainer.CPTrainerMixin`)."""

    def __init__(self, *args, data_collator=None, **kwargs) -> None:
        if data_collator is not None:
            raise ValueError("CPTrainer takes no data_collator: cpdata packs, collates and shards the batches "
                             "(pass plan=cpdata.StreamPlan(...) for the packer's settings)")  # fmt: skip
        super().__init__(*args, **kwargs)
