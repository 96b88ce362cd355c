"""torchtitan trained on cpdata's per-rank batches and layouts (``pip install torchtitan==0.3.0``).

::

    torchrun --nproc-per-node 2 -m torchtitan.train \\
        --module cpdata.integrations.torchtitan --config cpdata_llama3_debugmodel \\
        --dataloader.dataset docs.jsonl --dataloader.layout tiled [--dataloader.kv_exchange] \\
        --parallelism.context_parallel_degree 2

=================================================================  ===================================================
:mod:`~cpdata.integrations.torchtitan.loader`                      ``CPTitanLoader`` (torchtitan's ``BaseDataLoader``:
                                                                   this rank's packs, its state in the checkpoint) and
                                                                   ``TokenIds`` (the tokenizer of pre-tokenized data)
:mod:`~cpdata.integrations.torchtitan.masks`                       the flex ``BlockMask`` in the order the keys reach the
                                                                   kernel; the swap to cpdata's K/V exchange
:mod:`~cpdata.integrations.torchtitan.trainer`                     ``CPTitanTrainer`` (torchtitan's ``Trainer``): mesh,
                                                                   masks, the pack's target count as loss divisor
:mod:`~cpdata.integrations.torchtitan.config_registry`             ``cpdata_config(base)`` and
                                                                   ``cpdata_llama3_debugmodel`` for ``--config``
=================================================================  ===================================================

Importing this package imports torchtitan.
"""

from cpdata.integrations.torchtitan.config_registry import cpdata_config, cpdata_llama3_debugmodel
from cpdata.integrations.torchtitan.loader import BATCH_KEY, CPTitanLoader, TokenIds
from cpdata.integrations.torchtitan.masks import (
    ExchangeMask,
    batch_attention_mask,
    install_exchange_attention,
)
from cpdata.integrations.torchtitan.trainer import CPTitanTrainer

__all__ = [
    "BATCH_KEY",
    "CPTitanLoader",
    "CPTitanTrainer",
    "ExchangeMask",
    "TokenIds",
    "batch_attention_mask",
    "cpdata_config",
    "cpdata_llama3_debugmodel",
    "install_exchange_attention",
]
