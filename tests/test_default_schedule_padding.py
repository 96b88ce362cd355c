"""The loader's default schedule pads within 1 percentage point of the token plan on small datasets.

The scenario: dp 2 x cp 2, capacity 8192 per pack (one pack per CP group),
340 and 460 documents of realistic lengths (the bench's web-like and
ultrachat-like distributions and the standard library's files, one token per
byte). ``schedule="balanced"`` without ``cost=`` (the default) against
``schedule="in_order"`` (the token plan); printed with ``-s``. The explicit
``cost=CostModel()`` keeps the balanced schedule, whose extra steps on these
datasets are why the default falls back.
"""

from __future__ import annotations

import pytest

from cpdata.bench.distributions import sample
from cpdata.nodes.scheduled import ScheduledPacks
from cpdata.schedule import CostModel
from cpdata.schedule.planner import padded_epoch_cost
from tests.flat_options import graph_options

KW = dict(capacity=8192, layout="balanced", cp_size=2, dp_size=2, overflow="split")


def _lengths(name: str, n: int):
    return sample(name, 0)[:n] if name == "stdlib" else sample(name, n, seed=0)


def _schedule(lengths, **kw):
    docs = [{"input_ids": [1] * int(n)} for n in lengths]
    options = graph_options(schedule=kw.pop("schedule", "balanced"), lengths=lengths, **KW, **kw)
    return ScheduledPacks(docs, options).schedule


@pytest.mark.parametrize("n", [340, 460])
@pytest.mark.parametrize("name", ["web", "ultrachat", "stdlib"])
def test_default_pads_within_one_point_of_the_token_plan(name, n):
    lengths = _lengths(name, n)
    default = _schedule(lengths)
    tokens = _schedule(lengths, schedule="in_order")
    balanced = _schedule(lengths, cost=CostModel())
    print(f"{name} {n} docs: default {default.num_steps} steps {default.stats.padding_pct:.2f} % | balanced "
          f"{balanced.num_steps} steps {balanced.stats.padding_pct:.2f} % | token plan {tokens.num_steps} steps "
          f"{tokens.stats.padding_pct:.2f} %")  # fmt: skip
    assert default.stats.padding_pct <= tokens.stats.padding_pct + 1.0
    assert default.num_steps <= tokens.num_steps
    cost = CostModel()
    assert padded_epoch_cost(default, cost) == min(padded_epoch_cost(balanced, cost), padded_epoch_cost(tokens, cost))


def test_the_fallback_matters_here_and_an_explicit_cost_keeps_the_balanced_schedule():
    lengths = _lengths("web", 340)
    balanced, tokens = _schedule(lengths, cost=CostModel()), _schedule(lengths, schedule="in_order")
    assert balanced.stats.padding_pct > tokens.stats.padding_pct + 1.0  # the case the default must not pick
    assert balanced.num_steps > tokens.num_steps
