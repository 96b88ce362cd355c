"""Trainers users already run, fed by cpdata and trained with context parallelism (docs/trainers.md).

Nothing in the core imports this package; each module imports its trainer library when imported itself:
``hf`` (``CPTrainer``), ``trl`` (``CPSFTTrainer``), ``torchtitan`` (``CPTitanTrainer``), over the shared
``cp_trainer`` mixin, ``attention`` (the one choice of HF attention) and ``metrics`` (the log figures).
"""

__all__: list[str] = []
