"""torchtitan on cpdata's per-rank batches and layouts (``pip install torchtitan==0.3.0``; docs/torchtitan.md).

``torchrun ... -m torchtitan.train --module cpdata.integrations.torchtitan --config cpdata_llama3_debugmodel``.
``loader``: ``CPTitanLoader`` and ``TokenIds``; ``trainer``: ``CPTitanTrainer`` with the flex ``BlockMask`` and
the K/V exchange swap; ``config_registry``: configs for ``--config``. Importing this imports torchtitan.
"""

from cpdata.integrations.torchtitan.config_registry import cpdata_config, cpdata_llama3_debugmodel
from cpdata.integrations.torchtitan.loader import BATCH_KEY, CPTitanLoader, TokenIds
from cpdata.integrations.torchtitan.trainer import (
    CPTitanTrainer,
    ExchangeMask,
    batch_attention_mask,
    install_exchange_attention,
)

__all__ = [
    "BATCH_KEY", "CPTitanLoader", "CPTitanTrainer", "ExchangeMask", "TokenIds", "batch_attention_mask",
    "cpdata_config", "cpdata_llama3_debugmodel", "install_exchange_attention",
]  # fmt: skip
