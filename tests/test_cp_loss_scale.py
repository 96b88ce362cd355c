"""The CP trainer's loss scale makes DDP's mean over dp x cp ranks the loss cp 1 would train on.

Brute force over every rank of a dp x cp world: rank (d, c) holds the target
sum ``S[d, c]`` of its share of DP group d's pack; its loss is ``S[d, c] / N``
with ``N`` the DP group's count (``average_tokens_across_devices=False``) or
every rank's (True), times the scale; DDP averages over the ``dp * cp`` ranks.
That mean must be the mean over DP groups of each pack's mean loss (False), or
the token mean over every pack (True), for dp 1, 2, 4 and cp 1, 2, 4.
"""

from __future__ import annotations

import numpy as np
import pytest

from cpdata.integrations.cp_trainer import cp_loss_scale


@pytest.mark.parametrize("average_tokens", [False, True])
@pytest.mark.parametrize(("dp", "cp"), [(1, 1), (1, 2), (2, 1), (2, 2), (4, 2), (2, 4)])
def test_ddp_mean_of_scaled_losses_is_the_cp1_loss(dp, cp, average_tokens):
    rng = np.random.default_rng(dp * 10 + cp)
    counts = rng.integers(5, 50, (dp, cp)).astype(float)  # targets per rank
    sums = counts * rng.uniform(1.0, 3.0, (dp, cp))  # their cross-entropy sums
    world = dp * cp
    scale = cp_loss_scale(world, cp, average_tokens)
    if average_tokens:
        divisor = np.full((dp, 1), counts.sum())
        expected = sums.sum() / counts.sum()  # the token mean over every pack
    else:
        divisor = counts.sum(axis=1, keepdims=True)
        expected = np.mean(sums.sum(axis=1) / counts.sum(axis=1))  # the mean of the DP groups' pack means
    ddp_mean = np.mean(scale * sums / divisor)
    assert ddp_mean == pytest.approx(expected, rel=1e-12)
