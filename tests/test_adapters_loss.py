"""``token_loss`` / ``global_target_count``: CP ranks' losses and gradients add up to the single-rank ones.

The gradient contract through the K/V gather (a model that attends across
ranks) is tested with the example model in
``tests/test_train_example.py::test_local_loss_gradients_sum_to_the_single_rank_gradient``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from cpdata.adapters import global_target_count, token_loss
from cpdata.gather import gather_token_tensor
from cpdata.nodes.loader import GraphOptions, shard_graph
from cpdata.nodes.options import DataPolicy, StreamPlan
from cpdata.nodes.shard import ShardForRank
from tests.dist_utils import run_ranks

LENS = [7, 30, 3, 12, 45, 1, 9, 20, 16, 5]
VOCAB = 50


def _shards(cp: int, layout: str, dp_rank: int = 0, dp_size: int = 1):
    g = torch.Generator().manual_seed(0)
    docs = [{"input_ids": torch.randint(1, VOCAB, (n,), generator=g).tolist()} for n in LENS]
    graph = shard_graph(docs, GraphOptions(capacity=64, cp_size=cp, layout=layout, plan=StreamPlan(overflow="split"), data=DataPolicy(dp_rank=dp_rank, dp_size=dp_size)))  # fmt: skip
    return list(ShardForRank(graph, cp_size=cp, cp_rank=0, layout=layout, all_ranks=True))


def _logits(table: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """A stand-in model: logits depend on the token only (float64)."""
    return table[input_ids]


def test_cp1_is_the_mean_over_targets_and_zero_without_targets():
    (batch,) = _shards(1, "identity")[0]
    table = torch.randn(VOCAB, VOCAB, dtype=torch.float64)
    logits = _logits(table, batch["input_ids"])
    expected = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
    assert token_loss(logits, batch).item() == pytest.approx(expected.item(), rel=1e-6)
    assert int(global_target_count(batch)) == int(batch["labels"].ne(-100).sum()) > 0
    none = batch.replace(labels=torch.full_like(batch["labels"], -100))
    assert token_loss(logits, none).item() == 0.0
    with pytest.raises(ValueError, match="hold"):
        token_loss(logits[:, :-1], batch)



def test_labels_override_sets_both_the_loss_and_the_target_count():
    """``labels=`` (a device copy, or labels masked further) replaces the batch's labels in the cross-entropy
    and in the count it divides by: the mean over the override's own targets."""
    (batch,) = _shards(1, "identity")[0]
    table = torch.randn(VOCAB, VOCAB, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    logits = _logits(table, batch["input_ids"])
    labels = batch["labels"].clone()
    labels[..., ::2] = -100  # drop every other target: the override has about half the batch's targets
    kept = int(labels.ne(-100).sum())
    assert 0 < kept < int(batch["labels"].ne(-100).sum())
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    assert token_loss(logits, batch, labels=labels).item() == pytest.approx(expected.item(), rel=1e-12)
    assert int(global_target_count(batch, labels=labels)) == kept


def test_low_precision_logits_are_reduced_in_float32():
    """bfloat16 logits: the loss is float32, the cross-entropy of the logits upcast (not bfloat16's own
    log-softmax, whose rounding a 50-way softmax shows); float64 logits stay float64."""
    (batch,) = _shards(1, "identity")[0]
    table = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(2)) * 4
    logits = _logits(table, batch["input_ids"]).to(torch.bfloat16)
    loss = token_loss(logits, batch)
    assert loss.dtype == torch.float32
    wide = F.cross_entropy(logits.double().flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
    assert loss.item() == pytest.approx(wide.item(), rel=1e-6)
    narrow = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
    assert abs(narrow.item() - wide.item()) > 1e-6 * wide.item()  # bfloat16's own reduction would differ
    assert token_loss(logits.double(), batch).dtype == torch.float64

def _cp_rank(rank: int, world: int, layout: str) -> dict:
    torch.manual_seed(0)
    table = torch.randn(VOCAB, VOCAB, dtype=torch.float64, requires_grad=True)
    out = {"loss": [], "full": [], "grad": [], "full_grad": []}
    for shards in _shards(world, layout)[:3]:
        batch = shards[rank]
        loss = token_loss(_logits(table, batch["input_ids"]), batch, dist.group.WORLD)  # counts the pack itself
        loss.backward()
        grad, table.grad = table.grad.clone(), None
        dist.all_reduce(grad)
        total = loss.detach().clone()
        dist.all_reduce(total)
        full_ids = gather_token_tensor(batch["input_ids"], batch.layout, seq_dim=1)
        full_labels = gather_token_tensor(batch["labels"], batch.layout, seq_dim=1)
        ref = F.cross_entropy(_logits(table, full_ids).flatten(0, 1), full_labels.flatten(), ignore_index=-100)
        ref.backward()
        out["loss"].append(total.item())
        out["full"].append(ref.item())
        out["grad"].append(grad)
        out["full_grad"].append(table.grad.clone())
        table.grad = None
    try:
        token_loss(_logits(table, shards[1 - rank]["input_ids"]), shards[1 - rank], dist.group.WORLD)
        out["refused"] = False
    except ValueError:
        out["refused"] = True
    return out


@pytest.mark.parametrize("layout", ["balanced", "thd"])
def test_cp_ranks_losses_and_gradients_sum_to_the_single_rank_ones(layout):
    for r in run_ranks(_cp_rank, 2, layout):
        assert r["refused"], "another rank's batch must be refused"
        assert len(r["loss"]) == 3
        for loss, full, grad, full_grad in zip(r["loss"], r["full"], r["grad"], r["full_grad"], strict=True):
            assert loss == pytest.approx(full, rel=1e-12)
            torch.testing.assert_close(grad, full_grad, rtol=1e-12, atol=1e-14)


def _dp_rank(rank: int, world: int) -> tuple[float, float]:
    torch.manual_seed(0)
    table = torch.randn(VOCAB, VOCAB, dtype=torch.float64)
    (batch,) = _shards(1, "identity", dp_rank=rank, dp_size=world)[0]
    loss = token_loss(_logits(table, batch["input_ids"]), batch, dp_group=dist.group.WORLD)
    total = loss.clone()
    dist.all_reduce(total)
    ce_sum = F.cross_entropy(_logits(table, batch["input_ids"]).flatten(0, 1), batch["labels"].flatten(),
                             ignore_index=-100, reduction="sum")  # fmt: skip
    sums = torch.stack([ce_sum, batch["labels"].ne(-100).sum().double()])
    dist.all_reduce(sums)
    return total.item(), (sums[0] / sums[1]).item()


def test_dp_group_normalises_over_every_dp_ranks_targets():
    for total, token_mean in run_ranks(_dp_rank, 2):
        assert total == pytest.approx(token_mean, rel=1e-12)
