"""Kwargs built for the ``"cpdata"`` attention at cp > 1 reach it on every rank, or every rank refuses.

A model left on ``sdpa``/``eager`` ignores the state kwarg: a wrong loss, or a hang if only one rank slipped.
The slip shows in the configured implementation (``config=``) or in the previous batch's state never being
consumed (one step late). One 16-byte all-reduce of both flags, on the first two calls and every
:data:`~cpdata.device.consistency.DEFAULT_CHECK_EVERY` after, makes all ranks raise together.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from cpdata.adapters._batch import check_cp_group
from cpdata.adapters.hf_attention import HFAttentionState
from cpdata.device.consistency import DEFAULT_CHECK_EVERY, any_rank_flags
from cpdata.layout.shard_layout import ShardLayout

__all__ = ["check_reaches_cpdata", "remember"]


class _LastState:
    """This process' previous cp > 1 state and how many cp > 1 calls it has made."""

    state: HFAttentionState | None = None
    calls: int = 0


_LAST = _LastState()


def check_reaches_cpdata(name: str, config: Any, layout: ShardLayout, group: Any) -> None:
    """``ValueError`` on every CP rank when any rank's ``name`` kwargs would not reach the ``name`` attention;
    call before building this step's state and :func:`remember` it after (at cp 1: no collective)."""
    configured = getattr(getattr(config, "config", config), "_attn_implementation", None)  # a model or its config
    configured = configured if isinstance(configured, str) else None
    wrong_config, unconsumed = configured is not None and configured != name, False
    anywhere: tuple[bool, ...] = (wrong_config,)
    if layout.cp_size > 1:  # at cp 1 no peer to hang, no state to track: the configured name only
        if dist.is_available() and dist.is_initialized():  # without a group the attention's collective refuses
            check_cp_group(group, layout)
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
