"""``CPTitanTrainer``: torchtitan's ``Trainer`` training on cpdata's per-rank batches and layouts.

Each override is torchtitan's seam for it: the mesh's CP coordinates go to the loader config, the batch (this
rank's shard already) gets its mask from the layout, and the loss divisor is the step's target count, so cp N
trains like cp 1 (docs/torchtitan.md). torchtitan's ``max_loss`` divides by its own label count (indicative).

The attention's ``BlockMask`` over ``L`` local queries is cpdata's document-causal predicate
(:mod:`cpdata.device.attention_masks`) at each key's global position: rank order under torchtitan's
all-gather, own + received keys under cpdata's exchange (:func:`install_exchange_attention`). One mask per
batch, shared by every layer.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.distributed import ParallelDims
from torchtitan.models.common.attention import FlexAttention
from torchtitan.models.common.decoder import Decoder
from torchtitan.trainer import Trainer

from cpdata.device.attention_masks import document_slots
from cpdata.device.consistency import verify_layout_consistency
from cpdata.device.kv_exchange import exchanged_key_positions, has_exchange, move_keys_values
from cpdata.errors import refuse_settings
from cpdata.gather import ensure_gather_index
from cpdata.integrations.torchtitan.loader import BATCH_KEY, CPTitanLoader
from cpdata.layout.shard_layout import ShardLayout
from cpdata.worker.batch import ShardedBatch
from cpdata.worker.keys import DOCUMENT_IDS, N_TARGETS

__all__ = ["CPTitanTrainer", "ExchangeMask", "batch_attention_mask", "gathered_key_positions",
           "install_exchange_attention"]


class CPTitanTrainer(Trainer):
    """torchtitan's ``Trainer`` on cpdata batches (see the module docstring), built from its ``Config``."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        def __post_init__(self) -> None:
            Trainer.Config.__post_init__(self)
            _check_config(self)

    def __init__(self, config: Config) -> None:
        self._step_targets: list[int] = []
        self._step_divisor: torch.Tensor | None = None
        super().__init__(config)
        self._cp_group = self.parallel_dims.get_mesh("cp").get_group() if self.parallel_dims.cp_enabled else None
        self._exchange = bool(config.dataloader.kv_exchange)
        if self._exchange:
            for model in self.model_parts:
                install_exchange_attention(model)

    def init_distributed(self) -> ParallelDims:
        parallel_dims = super().init_distributed()
        if parallel_dims.pp_enabled or parallel_dims.tp_enabled:
            raise ValueError(
                f"CPTitanTrainer: pipeline_parallel_degree={parallel_dims.pp} / tensor_parallel_degree="
                f"{parallel_dims.tp}: cpdata batches are tested with data (FSDP) and context parallelism "
                "only; set both to 1"
            )
        loader = self.config.dataloader
        loader.cp_degree = parallel_dims.cp
        loader.cp_rank = parallel_dims.get_mesh("cp").get_local_rank() if parallel_dims.cp_enabled else 0
        return parallel_dims

    def batch_generator(self, data_iterable: Iterable[tuple[dict[str, Any], torch.Tensor]]) -> Iterator[Any]:
        for input_dict, labels in super().batch_generator(data_iterable):
            self._step_targets.append(int(input_dict[BATCH_KEY].info[N_TARGETS]))
            yield input_dict, labels

    def train_step(self, data_iterator: Iterator[Any]) -> None:
        self._step_targets, self._step_divisor = [], None
        super().train_step(data_iterator)  # fetches every micro-batch of the step before the first forward

    def post_dataloading_process(
        self, input_dict: dict[str, Any], labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        batch = input_dict[BATCH_KEY]
        if self._cp_group is not None and self.config.dataloader.verify_layout:
            verify_layout_consistency(batch.layout, self._cp_group, device=self.device)
        block_size = self.model_config.first_attention.inner_attention.block_size
        mask = batch_attention_mask(batch, group=self._cp_group, device=self.device, block_size=block_size,
                                    exchange=self._exchange)  # fmt: skip
        self.ntokens_seen += labels.numel()
        return input_dict["input"], labels, {"positions": input_dict["positions"], "attention_masks": mask}

    def forward_backward_step(
        self, *, input_dict: Any, labels: Any, global_valid_tokens: torch.Tensor
    ) -> torch.Tensor:
        """torchtitan's step over the step's target count: every micro-batch's ``n_targets``, summed over DP."""
        if self._step_divisor is None:
            self._step_divisor = torch.tensor(sum(self._step_targets), dtype=torch.int64, device=self.device)
            if self.parallel_dims.dp_enabled:
                dist.all_reduce(self._step_divisor, group=self.parallel_dims.get_mesh("batch").get_group())
        return super().forward_backward_step(input_dict=input_dict, labels=labels,
                                             global_valid_tokens=self._step_divisor)  # fmt: skip


def _check_config(config: Trainer.Config) -> None:
    """Refuse, with one ``ValueError`` naming each setting, what CPTitanTrainer cannot honour."""
    model = config.model_spec.model if config.model_spec is not None else None
    attention = model.first_attention if isinstance(model, Decoder.Config) else None
    inner = attention.inner_attention if attention is not None else None
    refuse_settings("CPTitanTrainer", [
        (not isinstance(config.dataloader, CPTitanLoader.Config),
         f"dataloader={type(config.dataloader).__qualname__}: use CPTitanLoader.Config (cpdata's batches are "
         "the point of CPTitanTrainer)"),
        (config.parallelism.spmd_backend != "partial_dtensor",
         f"parallelism.spmd_backend={config.parallelism.spmd_backend!r}: cpdata shards the batches itself "
         "and feeds torchtitan's flex attention plain local tensors; set --parallelism.spmd_backend "
         "partial_dtensor"),
        (config.validator.enable,
         "validator.enable: validation would read torchtitan's own dataloader, unsharded; turn it off "
         "(--validator.no-enable) and evaluate the saved model separately"),
        (not config.training.disable_cuda_graphs,
         "training.disable_cuda_graphs=False: a CUDA graph would replay the first batch's document mask on "
         "every batch; set --training.disable_cuda_graphs"),
        (model is not None and not isinstance(inner, FlexAttention.Config),
         f"the model's inner attention is {type(inner).__qualname__}: cpdata's document masks need "
         "torchtitan's FlexAttention (a decoder with attn_backend='flex')"),
    ])  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class ExchangeMask:
    """What the swapped attention needs per batch: the ``BlockMask`` over the exchanged keys (in
    :func:`cpdata.device.kv_exchange.exchange_tokens`'s order) and the layout carrying the exchange plan."""

    block_mask: Any
    """``BlockMask`` ``[1, 1, L, L + n_recv]``."""
    layout: ShardLayout
    group: Any
    """The CP process group the plan was built for."""


def gathered_key_positions(layout: ShardLayout, group: Any, device: torch.device) -> torch.Tensor:
    """int64 ``[cp * L]``: the global position of each key torchtitan's all-gather returns (rank order):
    ``argsort(gather_index)``, after one index all-gather if the layout lacks it."""
    order = ensure_gather_index(layout, group).gather_index.reshape(-1)
    return torch.argsort(order.to(device=device, dtype=torch.int64))  # a permutation's inverse


def batch_attention_mask(
    batch: ShardedBatch, *, group: Any, device: torch.device, block_size: int | tuple[int, int], exchange: bool
) -> Any:
    """The mask torchtitan's attention gets for ``batch``: a ``BlockMask``, or an :class:`ExchangeMask`.

    Queries are the local tokens as one row ``[1, L]``; keys the same at cp 1, else the rank-order all-gather or
    (``exchange=True``) own + received keys.
    """
    layout = batch.layout
    document_ids = batch[DOCUMENT_IDS].reshape(1, -1).to(device)
    slots = document_slots(layout, document_ids, batch["cu_seqlens_padded"].to(device), batch["cu_seqlens"].to(device))
    if exchange:
        if not has_exchange(layout):
            raise ValueError("the attention swap needs batches built with kv_exchange=True; set "
                             "--dataloader.kv_exchange on every rank (the swap is installed from it)")  # fmt: skip
        keys = exchanged_key_positions(layout, device)
    elif layout.cp_size > 1:
        keys = gathered_key_positions(layout, group, device)
    else:
        keys = None  # one rank: keys in global order
    if not isinstance(block_size, int) and block_size[0] != block_size[1]:
        raise ValueError(f"block_size={block_size}: cpdata's masks use square tiles; set the same q and kv block size")
    mask = slots.mask("flex", keys, block_size=block_size if isinstance(block_size, int) else block_size[0])
    return ExchangeMask(block_mask=mask, layout=layout, group=group) if exchange else mask


def _exchange_forward(module: FlexAttention) -> Any:
    """``module.forward`` with its keys from cpdata's exchange instead of torchtitan's all-gather."""

    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, attention_masks: Any, **kwargs: Any):
        if not isinstance(attention_masks, ExchangeMask):
            raise ValueError(
                f"the cpdata exchange attention got attention_masks={type(attention_masks).__name__}; it runs "
                "only inside CPTitanTrainer, whose post_dataloading_process builds an ExchangeMask per batch"
            )
        k_x, v_x = move_keys_values(k, v, attention_masks.layout, attention_masks.group, exchange=True, seq_dim=1)
        return FlexAttention.forward(module, q, k_x, v_x, attention_masks=attention_masks.block_mask, **kwargs)

    return forward


def install_exchange_attention(model: torch.nn.Module) -> int:
    """Swap every ``FlexAttention`` forward in ``model`` (torchtitan's all-gather wrapper included) for the
    exchange one, still calling ``FlexAttention.forward`` for the kernel; returns how many."""
    count = 0
    for module in model.modules():
        if isinstance(module, FlexAttention):
            module.forward = _exchange_forward(module)
            count += 1
    if count == 0:
        raise ValueError(f"{type(model).__name__} has no FlexAttention module to swap; the cpdata exchange "
                         "attention needs a model whose inner attention is torchtitan's FlexAttention")  # fmt: skip
    return count
