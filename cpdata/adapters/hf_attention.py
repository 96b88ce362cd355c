"""``"cpdata"``: a transformers attention implementation that is right for every layer, at any cp (torch only).

::

    register_hf_attention()                      # once per process: AttentionInterface.register("cpdata", ...)
    model.set_attn_implementation("cpdata")      # or from_pretrained(..., attn_implementation="cpdata")
    loss = model(**hf_model_kwargs(batch, "cpdata", tensors=local, group=cp_group)).loss

Each layer gets local ``query [B, H, L, E]``, ``key``/``value [B, Hkv, L, E]`` and the batch's
:class:`HFAttentionState`; it checks the layer's variant, brings the keys and masks each query's key interval
(:class:`~cpdata.device.cp_attention.AttentionCore`) and runs :func:`attend`. No KV cache.

At cp > 1 the kwargs reach this attention on every rank, or every rank refuses (:func:`check_reaches_cpdata`):
a model left on ``sdpa``/``eager`` ignores the state kwarg (a wrong loss, or a hang if one rank slipped). The
slip shows in the configured implementation (``config=``) or in the previous batch's state never consumed (one
step late); one 16-byte all-reduce of both flags on the first two calls and every
:data:`~cpdata.device.consistency.DEFAULT_CHECK_EVERY` after makes all ranks raise together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from cpdata.adapters.attention_kernels import attend
from cpdata.adapters.hf_layers import layer_variant
from cpdata.device.consistency import DEFAULT_CHECK_EVERY, any_rank_flags, verify_layout_consistency
from cpdata.device.cp_attention import AttentionCore, record_served_call
from cpdata.device.varlen import Kernel, check_kernel, choose_kernel
from cpdata.gather import check_cp_group
from cpdata.layout.shard_layout import ShardLayout

__all__ = ["REGISTERED", "STATE_KEY", "HFAttentionState", "attention_state", "check_reaches_cpdata",
           "register_hf_attention", "remember"]

STATE_KEY = "cpdata_attention_state"


@dataclass(frozen=True, slots=True)
class _Options:
    kernel: Literal["auto"] | Kernel
    verify_layout: bool


REGISTERED: dict[str, _Options] = {}
"""The names :func:`register_hf_attention` registered, with their options."""


def register_hf_attention(
    name: str = "cpdata", *, kernel: Literal["auto"] | Kernel = "auto", verify_layout: bool = True
) -> str:
    """Register cpdata's attention with transformers' ``AttentionInterface`` under ``name`` (again: new options).
    ``kernel``: ``"auto"``, ``"dense"``, ``"flex"`` or ``"varlen"`` (:func:`cpdata.device.varlen.choose_kernel`);
    ``verify_layout``: at cp > 1, check on each batch's first call that every CP rank holds the same plan."""
    check_kernel(kernel)
    from transformers import AttentionInterface

    def cpdata_attention(module, query, key, value, attention_mask, **kwargs):  # noqa: ANN001, ANN202
        return _attention(name, module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(name, cpdata_attention)
    REGISTERED[name] = _Options(kernel=kernel, verify_layout=bool(verify_layout))
    return name


@dataclass(eq=False, kw_only=True)
class HFAttentionState(AttentionCore):
    """One batch's attention state (:func:`attention_state`): the :class:`AttentionCore` of its one row
    ``[1, L]`` of queries, with the registered ``options``."""

    options: _Options
    verified: bool = False
    """Set after the first call's one-time checks (plan digest)."""


def attention_state(
    name: str,
    layout: ShardLayout,
    document_ids: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    group: Any = None,
) -> HFAttentionState:
    """The state ``model(**kwargs)`` carries to every layer (``kwargs[STATE_KEY]``); ``document_ids`` rows are
    flattened into one stream, ``cu_seqlens`` (real lengths) makes pad queries see their own key only."""
    options = REGISTERED.get(name)
    if options is None:
        raise ValueError(
            f"attn_implementation={name!r} is not registered; call cpdata.adapters.register_hf_attention("
            f"{name!r}) before building the model's kwargs (and model.set_attn_implementation({name!r}))"
        )
    state = HFAttentionState(layout=layout, group=group, document_ids=document_ids.reshape(1, -1),
                             cu_seqlens_padded=cu_seqlens_padded, cu_seqlens=cu_seqlens,
                             whole_pack=layout.cp_size == 1, options=options)  # fmt: skip
    state.slots(document_ids.device)  # checked now, before the model runs
    return state


def _attention(
    name: str,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    state = kwargs.pop(STATE_KEY, None)
    if not isinstance(state, HFAttentionState):
        raise ValueError(
            f"attn_implementation={name!r} needs the batch's cpdata state in model(...)'s kwargs: call "
            f"model(**hf_model_kwargs(batch, {name!r}, tensors=..., group=...)); to run the model on other "
            "inputs (evaluation, generation) switch it to another attn_implementation"
        )
    if attention_mask is not None:
        raise ValueError(
            f"attn_implementation={name!r} got an attention_mask ({type(attention_mask).__name__}); the masks "
            "come from the batch's layout and document ids: call the model without attention_mask"
        )
    n = state.document_ids.numel()
    if query.shape[0] != 1 or query.shape[2] != n or key.shape[2] != n:
        raise ValueError(
            f"attn_implementation={name!r}: query {tuple(query.shape)} / key {tuple(key.shape)} do not hold "
            f"this batch's {n} tokens as one row (a KV cache or generation step?); use_cache=False and the "
            "kwargs of hf_model_kwargs for this batch"
        )
    variant = layer_variant(module, query, kwargs)
    if state.layout.cp_size > 1:
        if state.options.verify_layout and not state.verified:
            verify_layout_consistency(state.layout, state.group, device=query.device)
        state.verified = True
        key, value = state.keys_values(key, value, 2)
    kernel = choose_kernel(state.options.kernel, softcap=variant.softcap, sinks=variant.sinks, device=query.device,
                           dtype=query.dtype, plan=lambda: state.mask("varlen", variant.window, query.device))
    if kernel == "varlen" and torch.is_autocast_enabled(query.device.type):  # flash is no autocast op
        low = torch.get_autocast_dtype(query.device.type)
        query, key, value = query.to(low), key.to(low), value.to(low)
    out = attend(kernel, query, key, value, state.mask(kernel, variant.window, query.device), variant)
    record_served_call()
    return out.transpose(1, 2).contiguous(), None


class _LastState:
    """This process' previous cp > 1 state and how many cp > 1 calls it has made."""

    state: HFAttentionState | None = None
    calls: int = 0


_LAST = _LastState()


def check_reaches_cpdata(name: str, config: Any, layout: ShardLayout, group: Any) -> None:
    """``ValueError`` on every CP rank when any rank's ``name`` kwargs would not reach the ``name`` attention;
    call before building this step's state and :func:`remember` it after (at cp 1: no collective)."""
    configured = getattr(getattr(config, "config", config), "_attn_implementation", None)  # a model or its config
    wrong_config, unconsumed = isinstance(configured, str) and configured != name, False
    anywhere: tuple[bool, ...] = (wrong_config,)
    if layout.cp_size > 1:  # at cp 1 no peer to hang, no state to track: the configured name only
        if dist.is_available() and dist.is_initialized():  # without a group the attention's collective refuses
            check_cp_group(layout, group)
        previous = _LAST.state
        # kwargs rebuilt for the same batch (e.g. to read num_items_in_batch first) replace the previous ones
        unconsumed = previous is not None and not previous.verified and previous.layout is not layout
        _LAST.state = None  # release the previous batch's masks before this step builds its own
        due = _LAST.calls < 2 or _LAST.calls % DEFAULT_CHECK_EVERY == 0
        _LAST.calls += 1
        anywhere = any_rank_flags((wrong_config, unconsumed), group) if due else (wrong_config, unconsumed)
    if not any(anywhere):
        return
    what = (
        f"this rank's model is configured with attn_implementation={configured!r}"
        if wrong_config
        else "the previous batch's kwargs never reached a 'cpdata' layer on this rank"
        if unconsumed
        else "this rank is fine, another rank of the CP group is not"
    )
    raise ValueError(
        f"hf_model_kwargs(batch, {name!r}) at cp_size={layout.cp_size} (cp_rank {layout.cp_rank}): {what}. A model "
        f"not on the {name!r} attention ignores the batch's state and attends to each rank's own tokens only "
        f"(a wrong loss, or a hang when only some ranks slipped). Call model.set_attn_implementation({name!r}) "
        f"on every rank's model (a config object shared between models shares the setting), or from_pretrained"
        f"(..., attn_implementation={name!r}); pass config=model so the check runs before the first step. "
        "(Kwargs built and then not run through the model also count as not reached.)"
    )


def remember(state: HFAttentionState) -> None:
    """Keep this step's cp > 1 state, checked at the next call for having reached the attention."""
    _LAST.state = state
