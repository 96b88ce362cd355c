"""Kwargs built for the ``"cpdata"`` attention at cp > 1 reach it on every rank, or every rank refuses.

A model left on ``sdpa``/``eager`` (``set_attn_implementation("cpdata")``
forgotten, or undone through a config object shared with another model)
ignores the ``cpdata_attention_state`` kwarg: each rank attends to its own
tokens only and trains on a wrong loss with no error. If only one rank of the
CP group slipped, the others enter the attention's collectives alone and the
group hangs. :func:`check_reaches_cpdata` (called by ``hf_model_kwargs`` for a
registered name) first checks that ``group`` is the CP group the batch was
sharded for (a dp x cp world with ``group=`` forgotten would otherwise fail in
the layout check, blaming ``dp_rank``), then finds the slip two ways:

1. the model's configured implementation, when ``config=`` is given
   (``config._attn_implementation`` differs from the name asked for);
2. the previous batch's state was never consumed: the ``"cpdata"`` attention
   marks a cp > 1 state ``verified`` on its first call, so a state still
   unverified at the next call for another batch never reached a ``"cpdata"``
   layer (checked one step late, the only way without ``config=``; kwargs
   rebuilt for the same batch replace the previous ones).

Every rank takes the same collective path whatever its findings: one
all-reduce (MAX, 16 bytes) of both flags over the CP group, before any other
collective of the step, so all ranks raise the same ``ValueError`` together
instead of one raising and the rest hanging in the model. The all-reduce and
its device-to-host read (a sync of the CP group) run on the first two calls
of a process and then every :data:`~cpdata.device.consistency.DEFAULT_CHECK_EVERY`
calls, the cadence of the layout check; between them a slip found on one rank
raises on that rank alone (still before the model runs).

Keeping the previous state until the next call keeps its cached masks alive
between two steps; they are released before the next step's masks are built,
so peak memory does not grow.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from cpdata.adapters._batch import check_cp_group
from cpdata.adapters.hf_attention import HFAttentionState
from cpdata.device.consistency import DEFAULT_CHECK_EVERY, any_rank_flags
from cpdata.layout.shard_layout import ShardLayout

__all__ = ["check_reaches_cpdata", "configured_implementation", "remember"]


class _LastState:
    """This process' previous cp > 1 state and how many cp > 1 calls it has made."""

    state: HFAttentionState | None = None
    calls: int = 0


_LAST = _LastState()


def configured_implementation(config: Any) -> str | None:
    """The attention implementation a model or ``PretrainedConfig`` is set to; None when not stated."""
    config = getattr(config, "config", config)  # a model -> its config
    impl = getattr(config, "_attn_implementation", None)
    return impl if isinstance(impl, str) else None


def check_reaches_cpdata(name: str, config: Any, layout: ShardLayout, group: Any) -> None:
    """``ValueError`` on every CP rank when any rank's ``name`` kwargs would not reach the ``name`` attention.

    Call before building this step's state, and :func:`remember` the state
    after. At cp 1 only the configured name is checked (no collective).
    """
    configured = configured_implementation(config)
    wrong_config = configured is not None and configured != name
    if layout.cp_size == 1:  # no peer to hang, no state to track: the configured name only
        _raise_if(name, layout, configured, (wrong_config, False), (wrong_config, False))
        return
    if dist.is_available() and dist.is_initialized():  # without a group the attention's collective refuses
        check_cp_group(group, layout)
    previous = _LAST.state
    # kwargs rebuilt for the same batch (e.g. to read num_items_in_batch first) replace the previous ones
    unconsumed = previous is not None and not previous.verified and previous.layout is not layout
    _LAST.state = None  # release the previous batch's masks before this step builds its own
    due = _LAST.calls < 2 or _LAST.calls % DEFAULT_CHECK_EVERY == 0
    _LAST.calls += 1
    anywhere = any_rank_flags((wrong_config, unconsumed), group) if due else (wrong_config, unconsumed)
    _raise_if(name, layout, configured, (wrong_config, unconsumed), anywhere)


def _raise_if(name: str, layout: ShardLayout, configured: str | None, here: tuple[bool, bool],
              anywhere: tuple[bool, ...]) -> None:  # fmt: skip
    if not any(anywhere):
        return
    wrong_config, unconsumed = here
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
