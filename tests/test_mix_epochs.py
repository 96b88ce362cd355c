"""A precomputed mix serves each epoch the documents the live mix draws in that epoch, or refuses the epoch."""

from __future__ import annotations

import json

import numpy as np
import pytest
from state_contract import run_save_load_contract

from cpdata import (
    DataPolicy,
    Documents,
    PrecomputedDataset,
    PrecomputedPacks,
    build_loader,
    closing_loader,
    mix,
    open_dataset,
)
from cpdata import precompute as precompute_plan
from cpdata.cli import main as cli
from cpdata.nodes.pack import Pack
from tests.flat_options import precompute_records, records
from tests.test_mix import _plans

OPTS = dict(capacity=256, cp_size=2, layout="thd", overflow="split")


def _write(path, n, lo, seed):
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"input_ids": rng.integers(lo, lo + 100, int(rng.integers(1, 200))).tolist()}) + "\n")
    return path


@pytest.fixture
def sources(tmp_path):
    return _write(tmp_path / "web.jsonl", 120, 0, 0), _write(tmp_path / "chat.jsonl", 50, 100, 4)


def _mixed(sources, stop="first_exhausted"):
    web, chat = sources
    return mix({"web": open_dataset(web), "chat": open_dataset(chat)}, {"web": 0.7, "chat": 0.3}, seed=6, stop=stop)


@pytest.mark.parametrize("stop", ["first_exhausted", "all_exhausted"])
def test_each_precomputed_epoch_is_the_live_epoch(tmp_path, sources, stop):
    store = precompute_plan(_mixed(sources, stop), tmp_path / "plan", **precompute_records(epochs=3, **OPTS))
    online = Pack(Documents(_mixed(sources, stop)), **OPTS)
    live = []
    for _ in range(3):
        live.append(_plans(online))
        assert store.manifest["epochs"]["sources"][len(live) - 1] == online.stats.sources
    assert live[0] != live[1] != live[2] and min(map(len, live)) > 10, "the mix draws other documents every epoch"
    served = PrecomputedPacks(tmp_path / "plan", _mixed(sources, stop))
    assert served.epochs == 3
    assert [_plans(served) for _ in range(3)] == live
    with pytest.raises(ValueError, match=r"holds 3 epoch\(s\) of its mix, this is epoch 3.*--epochs 4"):
        served.reset()
    first = store.manifest["epochs"]["first_pack"]
    assert first == [0, len(live[0]), len(live[0]) + len(live[1]), store.n_packs]
    totals = {n: sum(e[n]["documents"] for e in store.manifest["epochs"]["sources"]) for n in ("web", "chat")}
    assert totals == {n: c["documents"] for n, c in store.manifest["stats"]["sources"].items()}
    # set_epoch (a process that rebuilds the node) and random access reach any planned epoch
    fresh = PrecomputedPacks(tmp_path / "plan", _mixed(sources, stop))
    fresh.set_epoch(2)
    assert _plans(fresh) == live[2]
    with pytest.raises(ValueError, match="this is epoch 3"):
        fresh.plan(0, epoch=3)


def test_a_one_epoch_plan_of_a_mix_refuses_the_second_epoch_instead_of_repeating_the_first(tmp_path, sources):
    precompute_plan(_mixed(sources), tmp_path / "plan", **precompute_records(**OPTS))
    served = PrecomputedPacks(tmp_path / "plan", _mixed(sources))
    assert served.epochs == 1 and _plans(served) == _plans(Pack(Documents(_mixed(sources)), **OPTS))
    with pytest.raises(ValueError, match=r"holds 1 epoch\(s\) of its mix, this is epoch 1: the mix draws other"):
        served.reset()


def test_a_restore_inside_a_later_epoch_continues_that_epoch(tmp_path, sources):
    precompute_plan(_mixed(sources), tmp_path / "plan", **precompute_records(epochs=2, **OPTS))
    node = PrecomputedPacks(tmp_path / "plan", _mixed(sources))
    _plans(node)
    node.reset()
    for _ in range(5):
        next(node)
    state = node.state_dict()
    rest = [p.columns.tolist() for p in node]
    other = PrecomputedPacks(tmp_path / "plan", _mixed(sources))
    other.reset(state)
    assert other.epoch == 1 and [p.columns.tolist() for p in other] == rest and len(rest) > 5
    n0 = len(_plans(PrecomputedPacks(tmp_path / "plan", _mixed(sources))))
    points = [0, 3, n0, n0 + 4]
    run_save_load_contract(lambda: PrecomputedPacks(tmp_path / "plan", _mixed(sources)), points, epochs=2)
    store = _mixed(sources)  # a worker's packs: batches 1, 4, ... of two packs each, epoch after epoch
    plans = PrecomputedPacks(tmp_path / "plan", store)
    run_save_load_contract(lambda: plans.with_worker((1, 3), batch=2), [0, 3, 7, 12], epochs=2)


def test_precomputed_dataset_serves_each_epoch_of_the_mix_as_the_live_loader(tmp_path, sources):
    precompute_plan(_mixed(sources), tmp_path / "plan", **precompute_records(epochs=2, **OPTS))
    kw = dict(capacity=256, cp_size=2, cp_rank=1, layout="thd", overflow="split", prefetch=0)

    def ids(batches):
        return [b.tensors()["input_ids"].tolist() for b in batches]

    with closing_loader(build_loader(_mixed(sources), **records(**kw))) as loader:
        live = [ids(loader), ids(loader)]
    assert live[0] != live[1]
    ds = PrecomputedDataset(tmp_path / "plan", _mixed(sources), cp_rank=1)
    assert [ids(ds), ids(ds)] == live
    with pytest.raises(ValueError, match="this is epoch 2"):
        ids(ds)
    fresh = PrecomputedDataset(tmp_path / "plan", _mixed(sources), cp_rank=1)
    fresh.set_epoch(1)  # non-persistent workers: each epoch from a fresh copy of the dataset
    assert ids(fresh) == live[1] and len(fresh) == len(live[1])


def test_epochs_on_the_command_line_and_its_refusals(tmp_path, sources, capsys):
    web, chat = sources
    base = ["precompute", "--mix", f"web={web}:0.7", "--mix", f"chat={chat}:0.3", "--mix-seed", "6", "--capacity",
            "256", "--cp-size", "2", "--layout", "thd", "--overflow", "split", "--quiet"]  # fmt: skip
    assert cli([*base, "--epochs", "2", "--out", str(tmp_path / "cli")]) == 0
    assert "mix epochs planned: 2" in capsys.readouterr().out
    precompute_plan(_mixed(sources), tmp_path / "api", **precompute_records(epochs=2, **OPTS))
    cli_node, api_node = (PrecomputedPacks(tmp_path / n, _mixed(sources)) for n in ("cli", "api"))
    assert [_plans(cli_node), _plans(cli_node)] == [_plans(api_node), _plans(api_node)]
    assert cli([*base, "--epochs", "0", "--out", str(tmp_path / "o")]) == 1
    assert "DataPolicy.epochs must be an int >= 1 or None, got 0" in capsys.readouterr().err
    assert cli([*base, "--epochs", "2", "--dp-size", "2", "--out", str(tmp_path / "o")]) == 1
    assert "a global schedule over a mix plans epoch 0's draws for every epoch" in capsys.readouterr().err
    assert cli(["precompute", str(web), "--epochs", "2", "--capacity", "256", "--cp-size", "2", "--layout", "thd",
                "--overflow", "split", "--quiet", "--out", str(tmp_path / "o")]) == 1  # fmt: skip
    assert "is not a mix: it gives the same packs every epoch; precompute it once (--epochs 1)" in capsys.readouterr().err


def test_a_precomputed_schedule_of_a_mix_serves_epoch_0_draws_every_epoch_as_the_live_schedule(tmp_path, sources,
                                                                                               capsys):  # fmt: skip
    assert cli(["precompute", "--mix", f"web={sources[0]}:0.7", "--mix", f"chat={sources[1]}:0.3", "--mix-seed", "6",
                "--capacity", "256", "--cp-size", "2", "--layout", "thd", "--overflow", "split", "--dp-size", "2",
                "--quiet", "--out", str(tmp_path / "s")]) == 0  # fmt: skip
    assert "epoch 0's draws are planned once and served every epoch" in capsys.readouterr().out
    node = PrecomputedPacks(tmp_path / "s", _mixed(sources), data=DataPolicy(dp_rank=1, dp_size=2))
    assert node.epochs is None and _plans(node) == _plans(node)
