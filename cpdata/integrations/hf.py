"""``CPTrainer``: a ``transformers.Trainer`` that trains with context parallelism on cpdata's packs.

::

    trainer = CPTrainer(model=model, args=TrainingArguments(max_steps=1000, ...), train_dataset=tokenized,
                        cp_size=2, capacity=4096, layout="balanced")
    trainer.train()          # torchrun --nproc-per-node 4 train.py  ->  dp 2 x cp 2

``train_dataset`` holds tokenized documents (a ``datasets.Dataset`` with an
``input_ids`` column, optionally ``labels`` / ``assistant_masks`` /
``completion_mask`` aligned with ``input_ids`` as Hugging Face aligns them, or
anything :class:`~cpdata.nodes.dataset.CPDataset` reads). No ``data_collator``: each
micro-batch is ``per_device_train_batch_size`` packs of ``capacity`` tokens,
and each rank receives only its CP share of them, laid out on the dataloader
workers. Everything the mixin adds (mesh, loss normalization, gradient
scale, resume, log figures) is in :mod:`cpdata.integrations.cp_trainer`.

Measured (``tests/test_integrations_hf.py``, CPU, gloo): at cp 2 the per-step
losses and final weights equal cp 1's on the same packs, over 4 optimizer steps
with gradient accumulation 2, AdamW, a linear schedule and gradient clipping.
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
