"""``Collate`` node: group ``batch_size`` pack plans into one light ``CollatedPack``.

The record holds the plans; their metadata is computed when first read and token tensors only on demand
(:class:`~cpdata.nodes.shard.ShardForRank` gathers one rank's). The last batch of an epoch may hold fewer
plans (like ``DataLoader(drop_last=False)``), the same on every CP rank of a DP group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchdata.nodes import BaseNode

from cpdata.errors import check_int
from cpdata.nodes.state_version import VersionedState
from cpdata.worker.collate import CollatedPack, check_padding_token_id, check_qkv_format

if TYPE_CHECKING:
    from cpdata.worker.plan import PackPlan

__all__ = ["Collate"]


class Collate(VersionedState, BaseNode[CollatedPack]):
    """Group ``batch_size`` plans from ``pack_node`` into a :class:`CollatedPack`. State: the source's, a
    version and the config (a state saved under another config is refused)."""

    VERSION = 1

    def __init__(
        self,
        pack_node: BaseNode[PackPlan],
        *,
        batch_size: int = 1,
        qkv_format: str = "bshd",
        padding_token_id: int = 0,
    ) -> None:
        super().__init__()
        self.batch_size = check_int("batch_size", batch_size, min=1)
        check_qkv_format(qkv_format)
        self.source = pack_node
        self.qkv_format = qkv_format
        self.padding_token_id = check_padding_token_id(padding_token_id)
        self._exhausted = False

    def _config(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "qkv_format": self.qkv_format, "padding_token_id": self.padding_token_id}

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._exhausted = False
        if initial_state is None:
            self.source.reset(None)
            return
        self.check_saved(initial_state, self._config())
        self.source.reset(initial_state[self.SOURCE_KEY])

    def next(self) -> CollatedPack:
        plans = []
        while not self._exhausted and len(plans) < self.batch_size:
            try:
                plans.append(next(self.source))
            except StopIteration:
                self._exhausted = True  # a short last batch; do not pull an exhausted source again
        if not plans:
            raise StopIteration
        return CollatedPack(
            plans=tuple(plans),
            pack_len=plans[0].capacity,
            qkv_format=self.qkv_format,
            padding_token_id=self.padding_token_id,
        )

    def get_state(self) -> dict[str, Any]:
        return {**self.state_header(self._config()), self.SOURCE_KEY: self.source.state_dict()}
