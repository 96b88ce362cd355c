"""Choosing a sharding strategy for a model, mesh and batch, once, in NeMo's order (docs/nemo.md).

0. MagiAttention: NeMo Automodel's own ``_prepare_cp_sharder`` when it imports, else ``ValueError``.
1. The model's ``prepare_model_inputs_for_cp`` hook (cp > 1, or THD with ``model.supports_thd``).
2. A worker-sharded batch: copy only.
3. THD of a TE model, or without a model: :class:`ThdShard`.
4. cp > 1: :class:`DeviceShard` (``round_robin``).
5. Otherwise the identity.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch

from cpdata.device.presharded import is_presharded, mesh_rank_size
from cpdata.errors import check_int
from cpdata.layout.shard_layout import ShardLayout
from cpdata.nemo.raw_shard import DeviceShard, closed_form_indices, shard_identity
from cpdata.nemo.thd_shard import ThdShard

__all__ = ["Strategy", "attention_backend", "mesh_device", "resolve_strategy", "submesh", "uses_te_attention"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Strategy:
    """The three parts of a sharder that a resolution decides."""

    shard_batch: Callable[..., Any]
    """``(cp_mesh, tp_mesh, batch, *, loss_mask, padding_token_id) -> (ctx, batch, ShardLayout | None)``."""
    local_token_global_indices: Callable[..., torch.Tensor] | None = None
    """Closed-form ``(cp_mesh, padded_seq_len, device)`` index map, or None (data-dependent)."""
    shard_layout: ShardLayout | None = None
    """A layout known before the first shard (usually None)."""


def submesh(device_mesh: Any, name: str) -> Any:
    """``device_mesh[name]`` when the mesh has that dim, else None."""
    return device_mesh[name] if name in (getattr(device_mesh, "mesh_dim_names", None) or ()) else None


def mesh_device(device_mesh: Any) -> torch.device | None:
    """Where a sharder puts tensors: the mesh's ``device_type`` (cpu for gloo); None without a mesh."""
    kind = getattr(device_mesh, "device_type", None)
    if kind is None:
        return None
    if kind == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def attention_backend(model: Any) -> str | None:
    """``model.backend.attn``, else its config's ``_attn_implementation`` (NeMo's ``_attention_backend``)."""
    backend = getattr(getattr(model, "backend", None), "attn", None)
    if backend is None:
        config = getattr(model, "config", None)
        for candidate in (config, getattr(config, "text_config", None)):
            backend = getattr(candidate, "_attn_implementation", None)
            backend = backend or getattr(candidate, "_attn_implementation_internal", None)
            if backend is not None:
                break
    return None if backend is None else str(backend)


def uses_te_attention(model: Any) -> bool:
    """Whether a live model attends with Transformer Engine (NeMo's test, read from the model)."""
    return attention_backend(model) == "te" or bool(getattr(model, "_te_attention_injected", False))


@dataclass(frozen=True, slots=True)
class _ForeignLayout:
    """A backend's ``shard_batch`` whose layout record is another library's: read into cpdata's."""

    shard_batch: Callable[..., Any]

    def __call__(self, cp_mesh, tp_mesh, batch, *, loss_mask=None, padding_token_id: int = 0):
        ctx, out, layout = self.shard_batch(cp_mesh, tp_mesh, batch, loss_mask=loss_mask,
                                            padding_token_id=padding_token_id)  # fmt: skip
        if layout is not None and not isinstance(layout, ShardLayout):
            layout = ShardLayout(**{name: getattr(layout, name, None) for name in _LAYOUT_FIELDS})
        return ctx, out, layout


_LAYOUT_FIELDS = ("local_token_global_indices", "original_seq_len", "padded_seq_len", "input_row_shape",
                  "input_token_stream_positions")  # fmt: skip


def _magi_strategy(model: Any, device_mesh: Any, batch: Mapping[str, Any], num_chunks: int, invoke_pre_embed: bool,
                   extra_seq_buffers: Mapping[str, int] | None) -> Strategy:  # fmt: skip
    """MagiAttention's strategy, resolved by NeMo Automodel itself; ``ValueError`` where that cannot be."""
    if is_presharded(batch):
        raise ValueError(
            "the model attends with MagiAttention (backend.attn='magi'), which dispatches the whole sequence "
            "over the CP ranks itself, but this batch was already sharded by cpdata's workers; build the "
            "pipeline with cp_size=1 and hand the raw packed batch to the sharder"
        )
    missing = [name for name in ("nemo_automodel", "magi_attention") if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(
            "the model attends with MagiAttention (backend.attn='magi'): NeMo Automodel hands such a batch to "
            "MagiAttention's dispatch solver, a layout cpdata does not have (a round-robin shard would be wrong "
            f"for it); install {' and '.join(missing)} so cpdata hands it over the way NeMo Automodel 0.7.0 does, "
            "or give the model another attention backend ('te', 'sdpa')"
        )
    from nemo_automodel.components.distributed.context_parallel.utils import _prepare_cp_sharder

    nemo = _prepare_cp_sharder(model, device_mesh, batch, num_chunks=num_chunks, invoke_pre_embed=invoke_pre_embed,
                               extra_seq_buffers=dict(extra_seq_buffers) if extra_seq_buffers else None)  # fmt: skip
    return Strategy(shard_batch=_ForeignLayout(nemo.shard_batch), local_token_global_indices=nemo.local_token_global_indices)


def _call_hook(model: Any, batch: Mapping[str, Any], num_chunks: int) -> Strategy | None:
    """Run the model's CP hook NeMo's way; merge its batch updates; return the strategy of its sharder."""
    prepared = model.prepare_model_inputs_for_cp(batch, num_chunks=num_chunks)
    if prepared is None:
        return None
    if not isinstance(prepared, Mapping):
        raise TypeError(
            "prepare_model_inputs_for_cp(batch, *, num_chunks) must return a dict (with an optional "
            f"'cp_sharder' and batch updates), got {type(prepared).__name__}"
        )
    updates = {k: v for k, v in prepared.items() if k != "cp_sharder"}
    if updates:
        if not isinstance(batch, MutableMapping):
            raise TypeError(
                f"prepare_model_inputs_for_cp returned batch keys {sorted(updates)} but the batch "
                f"({type(batch).__name__}) is read-only; pass a dict"
            )
        batch.update(updates)
    sharder = prepared.get("cp_sharder")
    if sharder is None:
        return None
    if not hasattr(sharder, "shard_batch"):
        raise TypeError(f"prepare_model_inputs_for_cp returned a 'cp_sharder' of type {type(sharder).__name__}")
    return Strategy(shard_batch=sharder.shard_batch, shard_layout=sharder.shard_layout,
                    local_token_global_indices=sharder.local_token_global_indices)


def resolve_strategy(model: Any, device_mesh: Any, batch: Mapping[str, Any], *, num_chunks: int = 1,
                     invoke_pre_embed: bool = True,
                     extra_seq_buffers: Mapping[str, int] | None = None) -> Strategy:
    """The strategy for ``model``, ``device_mesh`` and ``batch`` (see the module docstring)."""
    check_int("num_chunks", num_chunks, min=1, fix=" (pipeline micro-batch chunks)")
    if model is not None and attention_backend(model) == "magi":
        return _magi_strategy(model, device_mesh, batch, num_chunks, invoke_pre_embed, extra_seq_buffers)
    _, cp_size = mesh_rank_size(submesh(device_mesh, "cp"))
    batch_is_thd = batch.get("qkv_format") == "thd"
    hook = getattr(model, "prepare_model_inputs_for_cp", None) if model is not None else None
    model_owns_thd = batch_is_thd and bool(getattr(model, "supports_thd", False))
    if hook is not None and invoke_pre_embed and (cp_size > 1 or model_owns_thd):
        owned = _call_hook(model, batch, num_chunks)
        if owned is not None:
            return owned
    device, extras = mesh_device(device_mesh), dict(extra_seq_buffers or {})
    if is_presharded(batch):
        return Strategy(shard_batch=DeviceShard(device=device))
    if batch_is_thd and (model is None or uses_te_attention(model)):
        return Strategy(shard_batch=ThdShard(num_chunks=num_chunks, device=device, extra_seq_buffers=extras))
    if cp_size > 1:
        return Strategy(shard_batch=DeviceShard(device=device, extra_seq_buffers=extras),
                        local_token_global_indices=functools.partial(closed_form_indices, "round_robin"))
    return Strategy(shard_batch=shard_identity,
                    local_token_global_indices=functools.partial(closed_form_indices, "identity"))
