"""``ContextParallelSharder``: the device half of a CP batch (NeMo Automodel's sharder contract).

``shard(batch)`` returns ``(ctx_factory, batch)`` and keeps the batch's :class:`ShardLayout`; the token verbs
then move any per-token tensor between the caller's coordinates and this rank's local order with it. A
worker-sharded batch is only copied to the device; a raw full batch is laid out on device
(:mod:`cpdata.nemo.raw_shard`). Construction is direct (``device_mesh=``, ``shard_batch=`` a backend's
function) or resolved (``model, mesh, batch``: the model's ``prepare_model_inputs_for_cp`` hook or cpdata's
own, :mod:`cpdata.nemo.resolve`).

At cp <= 1 a raw batch comes back as the same object and ``gather_token_tensor(t)`` returns ``t``. What NeMo
raises as ``NotImplementedError`` is :class:`cpdata.errors.NotAvailableYetError` (also a ``ValueError``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch

from cpdata.device.consistency import DEFAULT_CHECK_EVERY, LayoutCheck
from cpdata.device.presharded import PreshardedMove, mesh_group, mesh_rank_size
from cpdata.errors import NotAvailableYetError
from cpdata.gather import ensure_gather_index, layout_tensor_on
from cpdata.gather import gather_token_tensor as _gather
from cpdata.layout.shard_layout import ShardLayout
from cpdata.nemo.raw_shard import DeviceShard
from cpdata.nemo.resolve import Strategy, mesh_device, resolve_strategy, submesh
from cpdata.nemo.token_coords import to_padded_stream, trim_to_caller
from cpdata.worker.batch import ShardedBatch

__all__ = ["ContextParallelSharder"]

ShardBatchFn = Callable[..., tuple[Callable, dict[str, Any], "ShardLayout | None"]]
IndicesFn = Callable[..., torch.Tensor]
_NO_LAYOUT = ShardLayout()  # "nothing sharded yet": every optional field None


class ContextParallelSharder:
    """How a batch is sharded over CP ranks, and where each local token lives.

    Attributes:
        shard_batch: ``(cp_mesh, tp_mesh, batch, *, loss_mask, padding_token_id) -> (ctx, batch, layout)``.
        local_token_global_indices: closed-form ``(cp_mesh, padded_seq_len, device) ->`` int64 ``[L]``; None
            for data-dependent layouts (their token verbs raise before the first :meth:`shard`).
        shard_layout: the :class:`ShardLayout` of the last :meth:`shard`.
        device: where :meth:`shard` puts tensors (the mesh's device type).
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        device_mesh: Any = None,
        batch: Mapping[str, Any] | None = None,
        *,
        shard_batch: ShardBatchFn | None = None,
        local_token_global_indices: IndicesFn | None = None,
        shard_layout: ShardLayout | None = None,
        padding_token_id: int = 0,
        num_chunks: int = 1,
        loss_mask: torch.Tensor | None = None,
        invoke_pre_embed: bool = True,
        extra_seq_buffers: Mapping[str, int] | None = None,
        check_layout_every: int | None = DEFAULT_CHECK_EVERY,
    ) -> None:
        """Construct from a backend's ``shard_batch``, or resolve one for ``model`` and ``batch``.

        Args:
            device_mesh: mesh with optional ``"cp"`` and ``"tp"`` dims.
            batch: a raw full batch (``input_ids`` ``[B, S]``, or ``qkv_format="thd"``) or a worker-sharded
                one; required when resolving.
            shard_batch: a backend's shard function; excludes ``model``, ``batch`` and the resolution options,
                as ``local_token_global_indices`` and ``shard_layout`` require it.
            num_chunks: pipeline chunks (NeMo's PP convention): THD batches of TE models become that many
                stacked THD chunks. Forwarded to the model's hook.
            loss_mask: ``[B, S]`` mask sharded with the batch as ``"loss_mask"``.
            extra_seq_buffers: more token-aligned batch keys -> their sequence dim.
            check_layout_every: :func:`cpdata.device.consistency.verify_layout_consistency` on the first
                :meth:`shard` and every this many after (0 or None: off), so ranks fed different packs raise.
        """
        if shard_batch is not None:
            resolving = (model, batch, extra_seq_buffers)  # the resolution inputs, None when not given
            if num_chunks != 1 or not invoke_pre_embed or any(x is not None for x in resolving):
                raise TypeError(
                    "shard_batch is mutually exclusive with model, batch, num_chunks, invoke_pre_embed and "
                    "extra_seq_buffers (those resolve a sharder); pass either shard_batch or model/batch"
                )
            strategy = Strategy(shard_batch=shard_batch, shard_layout=shard_layout,
                                local_token_global_indices=local_token_global_indices)
        else:
            if local_token_global_indices is not None or shard_layout is not None:
                raise TypeError(
                    "local_token_global_indices and shard_layout require shard_batch (direct construction)"
                )
            if batch is None:
                raise TypeError("batch is required when shard_batch is not provided (it decides the layout)")
            strategy = resolve_strategy(model, device_mesh, batch, num_chunks=num_chunks,
                                        invoke_pre_embed=invoke_pre_embed,
                                        extra_seq_buffers=extra_seq_buffers)
        self.shard_batch = strategy.shard_batch
        self.local_token_global_indices = strategy.local_token_global_indices
        self.shard_layout = strategy.shard_layout
        self._cp_mesh = submesh(device_mesh, "cp")
        self._tp_mesh = submesh(device_mesh, "tp")
        self._loss_mask = loss_mask
        self._padding_token_id = padding_token_id
        self.device = mesh_device(device_mesh)
        self._inverse_cache: dict[int, ShardLayout] = {}
        self._check = LayoutCheck(check_layout_every)
        # pre-sharded batches under cpdata's own strategy: the mesh read once, no per-call dispatch
        dims = getattr(device_mesh, "mesh_dim_names", None)
        fast = PreshardedMove(self._cp_mesh, self.device, dims) if isinstance(self.shard_batch, DeviceShard) else None
        self._fast = (self.shard_batch, fast)

    def shard(self, batch: Mapping[str, Any]) -> tuple[Callable, dict[str, Any]]:
        """Shard ``batch`` for this rank; keep its layout for the token verbs."""
        shard_batch, fast = self._fast
        if fast is not None and type(batch) is ShardedBatch and shard_batch is self.shard_batch and (
            self._loss_mask is None
        ):  # a worker batch: checked against the mesh and moved (cpdata.device.presharded)
            ctx, out, self.shard_layout = fast(batch)
            self._check(self.shard_layout, self._cp_mesh)
            return ctx, out
        ctx, batch, self.shard_layout = self.shard_batch(self._cp_mesh, self._tp_mesh, batch,
                                                         loss_mask=self._loss_mask,
                                                         padding_token_id=self._padding_token_id)
        self._check(self.shard_layout, self._cp_mesh)
        return ctx, batch

    def _indices(self, padded_seq_len: int, device: Any) -> torch.Tensor:
        """This rank's global positions in a padded stream of ``padded_seq_len`` tokens, int64 ``[L]`` (a map
        reported int32 or ``[1, L]`` is flattened and cast, as NeMo does)."""
        layout = self.shard_layout or _NO_LAYOUT
        if layout.local_token_global_indices is not None:
            _, size = mesh_rank_size(self._cp_mesh)
            local = layout.local_token_global_indices.numel()
            if padded_seq_len != local * size:
                raise ValueError(
                    f"the shard layout covers a padded stream of {local * size} tokens ({local} local x cp_size "
                    f"{size}), got padded_seq_len={padded_seq_len}; the tensor does not match the batch this "
                    "sharder last sharded"
                )
            return layout_tensor_on(layout, "local_token_global_indices", device).reshape(-1).long()
        if self.local_token_global_indices is None:
            raise NotAvailableYetError(
                "this sharder's token layout depends on the batch and arrives with shard(batch): token-tensor "
                "shard/gather are unavailable before the first shard; call shard(batch) before "
                "shard_token_tensor / gather_token_tensor"
            )
        return self.local_token_global_indices(self._cp_mesh, padded_seq_len, device).reshape(-1).long()

    def shard_token_tensor(
        self, tensor: torch.Tensor, seq_dim: int = 1, fill: float | int | None = None
    ) -> torch.Tensor:
        """This rank's shard of a full token-aligned tensor, laid out like the model inputs (accepted shapes:
        :func:`cpdata.nemo.token_coords.to_padded_stream`)."""
        tensor, seq_dim = to_padded_stream(self.shard_layout or _NO_LAYOUT, tensor, seq_dim, fill)
        index = self._indices(tensor.shape[seq_dim], tensor.device)
        return tensor.index_select(seq_dim, index)

    def gather_token_tensor(
        self, tensor: torch.Tensor, seq_dim: int = 1, trim: bool = False, fill: float | int | None = None
    ) -> torch.Tensor:
        """Differentiably gather a local shard to global order (one collective each way; backward sums over CP
        ranks, :mod:`cpdata.gather`). ``trim=True``: in the caller's coordinates
        (:func:`cpdata.nemo.token_coords.trim_to_caller`)."""
        seq_dim = seq_dim % tensor.dim()
        rank, size = mesh_rank_size(self._cp_mesh)
        if size <= 1:
            full = self._gather_cp1(tensor, seq_dim)
        else:
            layout = self._layout_with_inverse(tensor.shape[seq_dim] * size, tensor.device)
            if (layout.cp_size, layout.cp_rank) != (size, rank):
                raise ValueError(
                    f"shard layout was built for cp_size={layout.cp_size}, cp_rank={layout.cp_rank} but the CP "
                    f"mesh has cp_size={size} and this process is cp_rank={rank}; shard a batch laid out for this rank"
                )
            full = _gather(tensor, layout, mesh_group(self._cp_mesh), seq_dim)
        return trim_to_caller(self.shard_layout, full, seq_dim, fill) if trim else full

    def _gather_cp1(self, tensor: torch.Tensor, seq_dim: int) -> torch.Tensor:
        """cp <= 1: ``tensor`` itself (as NeMo) unless the layout really reorders tokens."""
        layout = self.shard_layout or _NO_LAYOUT
        if layout.gather_index is not None:
            index = layout_tensor_on(layout, "gather_index", tensor.device)
        elif layout.local_token_global_indices is not None or self.local_token_global_indices is not None:
            index = self._indices(tensor.shape[seq_dim], tensor.device)
        else:
            return tensor
        if torch.equal(index, torch.arange(index.numel(), device=index.device)):
            return tensor
        if layout.gather_index is not None:
            return _gather(tensor, layout, mesh_group(self._cp_mesh), seq_dim)
        return torch.zeros_like(tensor).index_copy(seq_dim, index, tensor)

    def _layout_with_inverse(self, padded_seq_len: int, device: Any) -> ShardLayout:
        """The layout for a gather at cp > 1. One without ``gather_index`` (a backend's, or a closed-form map)
        gets it once by one index all-gather, cached on ``shard_layout`` (or per length without one)."""
        layout = self.shard_layout
        if layout is not None and layout.gather_index is not None:
            return layout
        cached = self._inverse_cache.get(padded_seq_len) if layout is None else None
        if cached is not None:
            return cached
        local = self._indices(padded_seq_len, device).cpu()
        group = mesh_group(self._cp_mesh)
        built = ensure_gather_index(replace(layout or _NO_LAYOUT, local_token_global_indices=local), group)
        if layout is not None:
            self.shard_layout = built
        else:
            self._inverse_cache = {padded_seq_len: built}
        return built
