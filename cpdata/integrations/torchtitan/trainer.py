"""``CPTitanTrainer``: torchtitan's ``Trainer`` training on cpdata's per-rank batches and layouts.

Each override is torchtitan's seam for it: the mesh's CP coordinates go to the loader config, the batch (this
rank's shard already) gets its mask from the layout, and the loss divisor is the step's target count, so cp N
trains like cp 1 (docs/torchtitan.md). torchtitan's ``max_loss`` divides by its own label count (indicative).
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

from cpdata.device.consistency import verify_layout_consistency
from cpdata.errors import refuse_settings
from cpdata.integrations.torchtitan.loader import BATCH_KEY, CPTitanLoader
from cpdata.integrations.torchtitan.masks import batch_attention_mask, install_exchange_attention
from cpdata.worker.keys import N_TARGETS

__all__ = ["CPTitanTrainer"]


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
