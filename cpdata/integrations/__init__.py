"""Trainers users already run, fed by cpdata and trained with context parallelism.

Nothing in the core imports this package, and importing it imports nothing
heavy: each module pulls in its trainer library when imported itself.

=====================================  ==========================================================
:mod:`cpdata.integrations.attention`   the one place that picks how HF attention runs under CP
:mod:`cpdata.integrations.metrics`     padding, CP imbalance and tokens/s for the log lines
:mod:`cpdata.integrations.cp_trainer`  the mixin: mesh, loader, loss, gradient scale, resume, logs
:mod:`cpdata.integrations.hf`          ``CPTrainer`` (``transformers.Trainer``; ``pip install 'cpdata[hf]'``)
:mod:`cpdata.integrations.trl`         ``CPSFTTrainer`` (TRL's ``SFTTrainer``; ``pip install 'cpdata[trl]'``)
:mod:`cpdata.integrations.torchtitan`  ``CPTitanTrainer`` (torchtitan's ``Trainer``; ``pip install torchtitan==0.3.0``)
=====================================  ==========================================================
"""

__all__: list[str] = []
