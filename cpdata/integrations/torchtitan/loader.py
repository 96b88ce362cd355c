"""torchtitan's data seam fed by cpdata: one CP rank's packs as torchtitan ``(input_dict, labels)`` pairs.

:class:`CPTitanLoader` (a ``BaseDataLoader``) runs :class:`~cpdata.nodes.dataset.CPDataset` on a
:class:`~cpdata.nodes.dataloader.CPDataLoader` for this rank's ``(dp, cp)`` coordinates over
``--dataloader.dataset`` (:func:`cpdata.open_dataset`). A micro-batch is ``training.local_batch_size`` packs of
``training.seq_len`` tokens in one ``"thd"`` stream, already sharded; every tensor is this rank's
``L = local_batch_size * seq_len / cp`` tokens as one row::

    input_dict = {"input": int64 [1, L], "positions": int64 [1, L], BATCH_KEY: ShardedBatch}
    labels     = int64 [1, L]       (next-token targets, -100 at document ends and on pads)

``positions`` restart per document; the batch rides along for the mask and the target count. Each rank saves
its loader state under its own key with the ``(dp, cp)`` shape, which a resume must match.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any

import torch
import tyro
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.tokenizer import BaseTokenizer

from cpdata.nodes.dataloader import CPDataLoader
from cpdata.nodes.dataset import CPDataset
from cpdata.nodes.options import DataPolicy, Delivery, StreamPlan
from cpdata.sources.open import open_dataset
from cpdata.worker.keys import INPUT_IDS, LABELS, POSITION_IDS

__all__ = ["BATCH_KEY", "CPTitanLoader", "TokenIds"]

BATCH_KEY = "cpdata_batch"
"""The ``input_dict`` key of the ``ShardedBatch`` (not a tensor: torchtitan leaves it on the host)."""


class TokenIds(BaseTokenizer):
    """The tokenizer of documents that are token ids already: knows its vocabulary size, encodes nothing."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = 2048
        """The model's vocabulary (token ids are checked against it on the workers)."""

    def __init__(self, config: Config, *, tokenizer_path: str | None = None) -> None:
        super().__init__()
        self.vocab_size = config.vocab_size

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        raise ValueError("TokenIds encodes no text: cpdata reads documents that are token ids already "
                         "(tokenize them first: cpdata tokenstore / precompute)")  # fmt: skip

    def decode(self, *args: Any, **kwargs: Any) -> str:
        raise ValueError("TokenIds decodes no ids: it stands in for a tokenizer the cpdata loader does not use")

    def get_vocab_size(self) -> int:
        return self.vocab_size


class CPTitanLoader(BaseDataLoader):
    """This rank's cpdata batches for torchtitan (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        # dataset (inherited): the tokenized documents, any path cpdata.open_dataset reads
        layout: str = "tiled"
        """A cpdata layout (cpdata.LAYOUTS)."""
        kv_exchange: bool = False
        """Build each batch's K/V exchange plan and swap the attention's all-gather for cpdata's exchange."""
        overflow: str = "truncate"
        """Documents longer than a pack: "truncate", "drop" or "error" ("split" would run past seq_len)."""
        algorithm: str | None = None
        """cpdata packer (None: the default)."""
        shuffle: bool = False
        seed: int = 0
        num_workers: int = 0
        """StatefulDataLoader workers (a resume needs the same count)."""
        padding_token_id: int = 0
        verify_layout: bool = True
        """At cp > 1, check each batch's plan digest across the CP group (one 16-byte all-reduce)."""
        cp_degree: Annotated[int | None, tyro.conf.Suppress] = None
        """Set by CPTitanTrainer.init_distributed from its mesh."""
        cp_rank: Annotated[int | None, tyro.conf.Suppress] = None

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        tokenizer: BaseTokenizer | None,
        seq_len: int,
        local_batch_size: int,
        snapshot_every_n_steps: int | None = None,
    ) -> None:
        if config.cp_degree is None or config.cp_rank is None:
            raise ValueError("CPTitanLoader needs the CP coordinates of CPTitanTrainer's mesh; train with "
                             "cpdata.integrations.torchtitan.CPTitanTrainer (its Config), not torchtitan's Trainer")  # fmt: skip
        if config.overflow == "split":
            raise ValueError(
                f"--dataloader.overflow split continues a long document's positions into the next pack, past "
                f"training.seq_len={seq_len}, the length of torchtitan's RoPE cache; use overflow 'truncate' or "
                "'drop' (or raise training.seq_len above the longest document)"
            )
        if not config.dataset:
            raise ValueError("--dataloader.dataset is empty: give the path of tokenized documents "
                             "(anything cpdata.open_dataset reads: .jsonl, a token store, .npy folder, ...)")  # fmt: skip
        self.seq_len, self.dp_size = seq_len, dp_world_size
        self.cp_rank, self.cp_size = config.cp_rank, config.cp_degree
        stream = StreamPlan(overflow=config.overflow) if config.algorithm is None else StreamPlan(
            overflow=config.overflow, algorithm=config.algorithm)  # fmt: skip
        data = DataPolicy(dp_rank=dp_rank, dp_size=dp_world_size, shuffle=config.shuffle, seed=config.seed,
                          vocab_size=None if tokenizer is None else tokenizer.get_vocab_size())  # fmt: skip
        dataset = CPDataset(open_dataset(config.dataset), capacity=seq_len, cp_size=self.cp_size, cp_rank=self.cp_rank,
                            layout=config.layout, batch_size=local_batch_size, qkv_format="thd",
                            padding_token_id=config.padding_token_id, plan=stream, data=data,
                            delivery=Delivery(kv_exchange=config.kv_exchange))  # fmt: skip
        self._loader = CPDataLoader(dataset, num_workers=config.num_workers)
        self._key = f"cpdata_dp{dp_rank}_cp{self.cp_rank}"

    def __iter__(self) -> Iterator[tuple[dict[str, Any], torch.Tensor]]:
        """``(input_dict, labels)`` per batch, every tensor ``[1, L]`` (see the module docstring)."""
        for batch in self._loader:
            positions = batch[POSITION_IDS].reshape(1, -1)
            top = int(positions.max()) if positions.numel() else 0
            if top >= self.seq_len:
                raise ValueError(
                    f"a batch holds position {top}, past training.seq_len={self.seq_len} (torchtitan's RoPE cache "
                    "has seq_len positions); use --dataloader.overflow truncate or drop, or raise training.seq_len"
                )
            inputs = {"input": batch[INPUT_IDS].reshape(1, -1), "positions": positions, BATCH_KEY: batch}
            yield inputs, batch[LABELS].reshape(1, -1)

    def state_dict(self) -> dict[str, Any]:
        return {self._key: pickle.dumps(self._loader.state_dict()), "dp_size": self.dp_size, "cp_size": self.cp_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        shape = [state_dict.get("dp_size"), state_dict.get("cp_size")]
        if shape != [self.dp_size, self.cp_size]:
            raise ValueError(f"the checkpoint's loader state is for (dp, cp) = {shape}, this run is "
                             f"{[self.dp_size, self.cp_size]}; resume with the same data and context parallel sizes")  # fmt: skip
        if self._key not in state_dict:
            raise ValueError(f"the checkpoint has no loader state {self._key!r} for this rank; it was not written "
                             "by CPTitanTrainer with this mesh")  # fmt: skip
        self._loader.load_state_dict(pickle.loads(state_dict[self._key]))
