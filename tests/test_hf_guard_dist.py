"""Kwargs built for the "cpdata" attention at cp 2 never reach a model on another attention silently, and never hang.

Two gloo ranks run a tiny Llama (tests/hf_zoo.py). The control: both models on
"cpdata", two steps, no error and the summed loss equals every document alone.
The slips: one rank's model left on sdpa with ``config=`` given (both ranks
raise at ``hf_model_kwargs``, before the model's collectives); both models on
sdpa without ``config=`` (the first step trains each rank on its own tokens, and
the next call raises on both ranks, with a loss that differs from the
reference, which is what the check is there for). A dp 2 x cp 2 world where
``group=`` was forgotten is refused by ``hf_model_kwargs`` naming
``mesh['cp'].get_group()``, not the layout check's dp_rank hint.
"""

from __future__ import annotations

import torch.distributed as dist

from cpdata.adapters import global_target_count, hf_model_kwargs, register_hf_attention
from cpdata.adapters.hf_attention import _LAST
from cpdata.nodes.loader import shard_graph
from cpdata.nodes.shard import ShardForRank
from tests import hf_zoo
from tests.dist_utils import run_ranks
from tests.flat_options import graph_options
from tests.hf_zoo import alone_reference, build
from tests.test_hf_attention import full_pack


def _packs(cp: int, rank: int, n: int = 2) -> list[tuple]:
    graph = shard_graph(hf_zoo.docs(), graph_options(capacity=32, cp_size=cp, layout="balanced", overflow="split"))
    out = []
    for batches in ShardForRank(graph, cp_size=cp, cp_rank=rank, layout="balanced", all_ranks=True):
        out.append(batches)
        if len(out) == n:
            return out
    raise AssertionError("too few packs")


def _summed_loss(model, kwargs) -> float:
    loss = model(**kwargs).loss.detach().reshape(1)
    dist.all_reduce(loss)
    return loss.item()


def _steps(rank: int, world: int, impls: tuple[str, str], with_config: bool,
           rebuild: bool = False) -> tuple[list[float], list, str]:  # fmt: skip
    """Run up to two packs; the summed losses of the steps that ran, the packs, and the refusal (or "");
    ``rebuild``: each step's kwargs are built twice for its batch, the first never run (they are replaced)."""
    register_hf_attention()
    _LAST.state, _LAST.calls = None, 0
    model = build("llama", impls[rank])
    losses, packs = [], _packs(2, rank)
    try:
        for batches in packs:
            if rebuild:
                hf_model_kwargs(batches[rank], "cpdata", group=dist.group.WORLD, config=model if with_config else None)
            kwargs = hf_model_kwargs(batch := batches[rank], "cpdata", group=dist.group.WORLD,
                                     config=model if with_config else None)  # fmt: skip
            assert int(kwargs["num_items_in_batch"]) == int(global_target_count(batch, dist.group.WORLD))
            losses.append(_summed_loss(model, kwargs))
    except ValueError as e:
        return losses, [full_pack(b) for b in packs], str(e)
    return losses, [full_pack(b) for b in packs], ""


def _reference(full) -> float:
    return alone_reference(build("llama", "eager"), full)[0]


def test_both_ranks_on_cpdata_run_and_match_each_document_alone():
    losses, packs, refusal = run_ranks(_steps, 2, ("cpdata", "cpdata"), True, timeout=300)[0]
    assert refusal == "" and len(losses) == 2
    for loss, full in zip(losses, packs, strict=True):
        assert abs(loss - _reference(full)) < 1e-6 * abs(loss)  # HF computes the loss in float32


def test_kwargs_rebuilt_for_the_same_batch_replace_the_unrun_ones():
    """Kwargs built for a batch and built again for it (e.g. to read num_items_in_batch first) are no slip:
    only kwargs of an earlier batch that never reached the attention are."""
    for losses, packs, refusal in run_ranks(_steps, 2, ("cpdata", "cpdata"), True, True, timeout=300):
        assert refusal == "" and len(losses) == 2, refusal
        assert abs(losses[0] - _reference(packs[0])) < 1e-6 * abs(losses[0])


def test_one_rank_on_sdpa_with_config_fails_on_every_rank_before_the_model():
    results = run_ranks(_steps, 2, ("cpdata", "sdpa"), True, timeout=300)
    for rank, (losses, _, refusal) in enumerate(results):
        assert losses == [], (rank, losses)  # no step ran: the refusal came before the model's collectives
        assert "set_attn_implementation('cpdata')" in refusal, refusal
    assert "configured with attn_implementation='sdpa'" in results[1][2]
    assert "another rank of the CP group" in results[0][2]


def test_both_ranks_on_sdpa_without_config_fail_at_the_next_call():
    results = run_ranks(_steps, 2, ("sdpa", "sdpa"), False, timeout=300)
    for rank, (losses, _, refusal) in enumerate(results):
        assert len(losses) == 1, (rank, losses)  # the first step ran, local attention only
        assert "never reached a 'cpdata' layer" in refusal, refusal
    losses, packs, _ = results[0]
    print("sdpa slip: summed loss", losses[0], "reference", _reference(packs[0]))
    assert abs(losses[0] - _reference(packs[0])) > 1e-3 * abs(losses[0])  # what went unnoticed: each rank's own tokens only


def _forgotten_group(rank: int, world: int) -> str:
    register_hf_attention()
    dp_rank, cp_rank = divmod(rank, 2)
    graph = shard_graph(hf_zoo.docs()[dp_rank::2], graph_options(capacity=32, cp_size=2, layout="balanced", overflow="split"))
    batch = next(iter(ShardForRank(graph, cp_size=2, cp_rank=cp_rank, layout="balanced")))
    try:
        hf_model_kwargs(batch, "cpdata")  # group= forgotten: the default group holds all 4 ranks
    except ValueError as e:
        return str(e)
    return ""


def test_group_forgotten_at_dp2_cp2_names_the_cp_group():
    for message in run_ranks(_forgotten_group, 4, timeout=120):
        assert "group=None" in message and "group=mesh['cp'].get_group()" in message, message
        assert "dp_rank" not in message
