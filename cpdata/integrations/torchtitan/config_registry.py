"""Configs for ``torchtitan --module cpdata.integrations.torchtitan --config NAME``: torchtitan imports
``<module>.config_registry`` and calls the function named by ``--config``; CLI flags override its result."""

from __future__ import annotations

from dataclasses import fields

from torchtitan.trainer import Trainer

from cpdata.integrations.torchtitan.loader import CPTitanLoader, TokenIds
from cpdata.integrations.torchtitan.trainer import CPTitanTrainer

__all__ = ["cpdata_config", "cpdata_llama3_debugmodel"]


def cpdata_config(base: Trainer.Config, loader: CPTitanLoader.Config | None = None) -> CPTitanTrainer.Config:
    """``base`` as a :class:`CPTitanTrainer` config reading cpdata batches (``loader``), with what cpdata needs:
    ``spmd_backend="partial_dtensor"``, no validator, no CUDA graphs, :class:`TokenIds` as the tokenizer."""
    values = {f.name: getattr(base, f.name) for f in fields(base)}
    values["dataloader"] = loader if loader is not None else CPTitanLoader.Config()
    values["tokenizer"] = TokenIds.Config(vocab_size=int(base.model_spec.model.vocab_size))
    values["parallelism"].spmd_backend = "partial_dtensor"
    values["validator"].enable = False
    values["training"].disable_cuda_graphs = True
    return CPTitanTrainer.Config(**values)


def cpdata_llama3_debugmodel() -> CPTitanTrainer.Config:
    """torchtitan's ``llama3_debugmodel`` (6 layers, dim 256, vocab 2048, flex attention) on cpdata batches."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    return cpdata_config(llama3_debugmodel())
