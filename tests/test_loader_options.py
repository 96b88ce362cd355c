"""Options travel as typed records: few keywords, one spelling per concept, every 0.3 keyword named on refusal."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import numpy as np
import pytest

import cpdata
from cpdata import precompute
from cpdata.nodes.dataset import CPDataset
from cpdata.nodes.loader import GraphOptions, build_loader, build_node
from cpdata.nodes.options import RENAMED, DataPolicy, Delivery, SchedulePlan, StreamPlan
from cpdata.schedule import CostModel

ROOT = Path(__file__).resolve().parents[1]
DOCS = [{"input_ids": np.arange(1, n, dtype=np.int64)} for n in (5, 9, 20, 7, 30, 3, 12, 17)]
CORE = {"capacity": 32, "cp_size": 2, "cp_rank": 0, "layout": "thd"}
MAX_KEYWORDS = 12

OLD_KEYWORDS = (  # build_loader's 31 keywords in cpdata 0.3, and precompute's own
    "capacity", "cp_size", "layout", "algorithm", "overflow", "padding_token_id", "dp_rank", "dp_size", "seed",
    "batch_size", "qkv_format", "vocab_size", "window", "labels_alignment", "shuffle", "num_epochs",
    "shuffle_buffer", "micro_batches", "schedule", "max_delay", "cost", "lengths", "tail", "schedule_window",
    "tile", "cp_rank", "pin_memory", "prefetch", "block_size", "kv_exchange", "restart_on_stop_iteration",
    "epochs", "overwrite", "progress",
)  # fmt: skip
RECORDS = {"StreamPlan": StreamPlan, "SchedulePlan": SchedulePlan, "DataPolicy": DataPolicy, "Delivery": Delivery}


def _keywords(func) -> list[str]:
    """The keywords ``func`` accepts by name (``source``/``self`` and the refusing ``**removed`` left out)."""
    params = list(inspect.signature(func).parameters.values())
    var = [p.name for p in params if p.kind is inspect.Parameter.VAR_KEYWORD]
    assert var == ["removed"], f"{func.__qualname__}: the only **kwargs is the refusing **removed, got {var}"
    return [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]


@pytest.mark.parametrize("func", [build_loader, build_node, CPDataset.__init__], ids=lambda f: f.__qualname__)
def test_the_entry_points_take_at_most_twelve_keywords(func):
    names = _keywords(func)
    assert 0 < len(names) <= MAX_KEYWORDS, (func.__qualname__, len(names), names)
    assert {"plan", "data", "delivery", "capacity", "cp_size", "cp_rank", "layout"} <= set(names)


def test_build_loader_and_cp_dataset_share_their_keywords():
    assert _keywords(build_loader) == _keywords(build_node) + ["restart_on_stop_iteration"]
    assert _keywords(CPDataset.__init__) == _keywords(build_node)
    assert len(_keywords(build_loader)) == 12 and len(_keywords(CPDataset.__init__)) == 11


def test_no_signature_is_rewritten_anywhere_in_the_package():
    written = []
    for path in sorted((ROOT / "cpdata").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            if any(isinstance(t, ast.Attribute) and t.attr == "__signature__" for t in targets):
                written.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" and any(
                    isinstance(a, ast.Constant) and a.value == "__signature__" for a in node.args):  # fmt: skip
                written.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert written == []
    assert len(list((ROOT / "cpdata").rglob("*.py"))) > 100  # the scan saw the package


@pytest.mark.parametrize("old", sorted(RENAMED))
@pytest.mark.parametrize("entry", ["build_loader", "build_node", "CPDataset"])
def test_every_old_keyword_is_refused_naming_its_record_and_field(entry, old):
    func = {"build_loader": build_loader, "build_node": build_node, "CPDataset": CPDataset}[entry]
    keyword, field = RENAMED[old]
    record, _, attr = field.partition(" or ")[0].partition(".")
    assert attr in {f.name for f in dataclasses.fields(RECORDS[record])}, field
    with pytest.raises(TypeError) as err:
        func(DOCS, **CORE, **{old: 1})
    assert str(err.value) == f"{entry}() no longer takes {old}=; pass {keyword}={record}({attr}=...) ({field})"


@pytest.mark.parametrize("old", ["algorithm", "overflow", "window", "seed", "vocab_size", "labels_alignment",
                                 "dp_size", "micro_batches", "schedule", "max_delay", "epochs"])  # fmt: skip
def test_precompute_refuses_its_old_keywords_the_same_way(tmp_path, old):
    with pytest.raises(TypeError, match=rf"^precompute\(\) no longer takes {old}=; pass (plan|data)="):
        precompute(DOCS, tmp_path / "plan", capacity=32, cp_size=2, layout="thd", **{old: 1})
    assert not (tmp_path / "plan").exists()


def test_every_keyword_of_before_is_kept_or_renamed_and_the_readme_lists_the_renames():
    kept = set(_keywords(build_loader)) | set(_keywords(precompute))
    assert sorted(k for k in OLD_KEYWORDS if k not in kept and k not in RENAMED) == []
    assert set(RENAMED) <= set(OLD_KEYWORDS)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme[readme.index("## Keywords that became records in 0.4"):]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    for old, (keyword, field) in RENAMED.items():
        (row,) = [r for r in rows if f"`{old}=`" in r]  # listed once
        record, _, attr = field.partition(" or ")[0].partition(".")
        assert f"`{keyword}={record}(...)`" in row, (old, row)
        assert attr == old or f"(`{attr}`)" in row, (old, row)  # a field spelt otherwise says its name


def test_unknown_and_internal_keywords_are_refused_as_python_refuses_them():
    with pytest.raises(TypeError, match=r"^build_loader\(\) got an unexpected keyword argument 'capacty'; "
                                        r"did you mean 'capacity'\?$"):  # fmt: skip
        build_loader(DOCS, **CORE, capacty=3)
    for internal in ("worker", "packs"):  # shard_graph's own: not reachable from the public entries
        for entry in (CPDataset, build_loader):
            with pytest.raises(TypeError, match=rf"^{entry.__name__}\(\) got an unexpected keyword argument "
                                                rf"'{internal}'; it takes capacity, cp_size, cp_rank, layout, ") as err:
                entry(DOCS, **CORE, **{internal: (0, 2)})
            assert str(err.value).count(internal) == 1
    with pytest.raises(TypeError, match=r"missing 1 required keyword-only argument: 'cp_rank'"):
        CPDataset(DOCS, capacity=32, cp_size=2, layout="thd")


@pytest.mark.parametrize("make, error, match", [
    (lambda: StreamPlan(algorithm="best"), ValueError, r"unknown StreamPlan.algorithm 'best'; choose one of"),
    (lambda: StreamPlan(overflow="wrap"), ValueError, r"unknown StreamPlan.overflow 'wrap'"),
    (lambda: StreamPlan(window=0), ValueError, r"StreamPlan.window must be an int >= 1 or None, got 0$"),
    (lambda: StreamPlan(window=2.5), TypeError, r"StreamPlan.window must be an int >= 1 or None, got float 2.5$"),
    (lambda: StreamPlan(shuffle_buffer=True), TypeError,
     r"StreamPlan.shuffle_buffer must be an int >= 1, got bool True$"),
    (lambda: StreamPlan(micro_batches=2), TypeError, r"unexpected keyword argument 'micro_batches'"),
    (lambda: SchedulePlan(kind="fair"), ValueError, r"unknown SchedulePlan.kind 'fair'; choose one of \['balanced'"),
    (lambda: SchedulePlan(micro_batches=0), ValueError, r"SchedulePlan.micro_batches must be an int >= 1, got 0$"),
    (lambda: SchedulePlan(max_delay=-1), ValueError, r"SchedulePlan.max_delay must be an int >= 0, got -1$"),
    (lambda: SchedulePlan(tail="keep"), ValueError, r"unknown SchedulePlan.tail 'keep'"),
    (lambda: SchedulePlan(cost=(1.0, 2.0)), TypeError, r"SchedulePlan.cost must be a cpdata.CostModel"),
    (lambda: SchedulePlan(kind="in_order", cost=CostModel()), ValueError, r"kind='in_order' deals them in order"),
    (lambda: SchedulePlan(window=8, lengths=[3, 4]), ValueError, r"give one of them"),
    (lambda: SchedulePlan(shuffle_buffer=8), TypeError, r"unexpected keyword argument 'shuffle_buffer'"),
    (lambda: DataPolicy(dp_rank=2, dp_size=2), ValueError, r"need 0 <= dp_rank < dp_size, got dp_rank=2, dp_size=2"),
    (lambda: DataPolicy(dp_size=0), ValueError, r"DataPolicy.dp_size must be an int >= 1, got 0$"),
    (lambda: DataPolicy(dp_rank=np.float64(1)), TypeError,
     r"DataPolicy.dp_rank must be an int >= 0, got float64 np.float64\(1.0\)$"),
    (lambda: DataPolicy(seed=-1), ValueError, r"DataPolicy.seed must be an int >= 0, got -1$"),
    (lambda: DataPolicy(shuffle=1), TypeError, r"DataPolicy.shuffle must be True or False, got int 1"),
    (lambda: DataPolicy(epochs=0), ValueError, r"DataPolicy.epochs must be an int >= 1 or None, got 0$"),
    (lambda: DataPolicy(vocab_size=0), ValueError, r"DataPolicy.vocab_size must be an int >= 1 or None, got 0$"),
    (lambda: DataPolicy(labels_alignment="shifted"), ValueError, r"unknown labels_alignment 'shifted'"),
    (lambda: DataPolicy(num_epochs=2), TypeError, r"unexpected keyword argument 'num_epochs'"),
    (lambda: Delivery(prefetch=-1), ValueError, r"Delivery.prefetch must be an int >= 0 or None, got -1$"),
    (lambda: Delivery(pin_memory="yes"), TypeError, r"Delivery.pin_memory must be True or False, or None"),
    (lambda: Delivery(block_size=0), ValueError, r"Delivery.block_size must be an int >= 1 or None, got 0$"),
    (lambda: Delivery(kv_exchange=None), TypeError, r"Delivery.kv_exchange must be True or False, got NoneType"),
    (lambda: StreamPlan("bfd"), TypeError, r"positional argument"),  # keyword-only
])  # fmt: skip
def test_records_refuse_bad_values_when_built(make, error, match):
    with pytest.raises(error, match=match):
        make()


@pytest.mark.parametrize("call, error, match", [
    (lambda: build_loader(DOCS, **CORE, plan=DataPolicy()), TypeError,
     r"plan must be a StreamPlan or a SchedulePlan, got DataPolicy"),
    (lambda: build_loader(DOCS, **CORE, data={"dp_size": 2}), TypeError, r"data must be a DataPolicy, got dict"),
    (lambda: build_loader(DOCS, **CORE, delivery=StreamPlan()), TypeError, r"delivery must be a Delivery"),
    (lambda: build_loader(DOCS, **CORE, plan=SchedulePlan(window=4), data=DataPolicy(shuffle=True)), ValueError,
     r"SchedulePlan.window plans each window of the stream in stream order"),
    (lambda: build_loader(DOCS, **CORE, data=DataPolicy(vocab_size=8), padding_token_id=8), ValueError,
     r"padding_token_id"),
    (lambda: CPDataset(DOCS, **CORE, delivery=Delivery(pin_memory=True)), TypeError, r"CPDataset does not pin"),
    (lambda: CPDataset(DOCS, **CORE, layout_tile=1), TypeError, r"unexpected keyword argument 'layout_tile'"),
])  # fmt: skip
def test_combinations_that_do_not_apply_are_refused_at_the_entry(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("plan, data, match", [
    (StreamPlan(), DataPolicy(dp_size=2), r"DataPolicy\(dp_size=2\) with a StreamPlan"),
    (StreamPlan(), DataPolicy(dp_rank=1, dp_size=2), r"leave DataPolicy.dp_rank and shuffle out"),
    (StreamPlan(), DataPolicy(shuffle=True), r"leave DataPolicy.dp_rank and shuffle out"),
    (StreamPlan(shuffle_buffer=8), DataPolicy(), r"StreamPlan.shuffle_buffer shuffles a stream online"),
    (SchedulePlan(lengths=[4] * 8), DataPolicy(dp_size=2), r"SchedulePlan.lengths and SchedulePlan.window do not"),
    (SchedulePlan(), DataPolicy(epochs=2), r"epochs=2 plans the epochs of a cpdata.mix"),
])  # fmt: skip
def test_precompute_refuses_the_options_a_written_plan_cannot_honour(tmp_path, plan, data, match):
    with pytest.raises(ValueError, match=match):
        precompute(DOCS, tmp_path / "plan", capacity=32, cp_size=2, layout="thd", plan=plan, data=data)
    assert not (tmp_path / "plan").exists()


def test_records_are_frozen_keyword_only_and_exported():
    for name, record in RECORDS.items():
        assert getattr(cpdata, name) is record and name in cpdata.__all__
        params = inspect.signature(record).parameters.values()
        assert params and all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params)
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(record(), dataclasses.fields(record)[0].name, None)
    assert GraphOptions(capacity=32, cp_size=2, layout="tiled", tile=256).layout == "tiled:256"


def test_the_records_build_the_graph_the_options_describe():
    """A schedule record plans equal steps for every DP rank; ``DataPolicy.epochs`` passes per ``iter()``."""
    lengths = [len(d["input_ids"]) for d in DOCS]
    plan = SchedulePlan(lengths=lengths, micro_batches=2, overflow="split")
    steps = [sum(1 for _ in build_loader(DOCS, **CORE, plan=plan, data=DataPolicy(dp_rank=r, dp_size=2),
                                         delivery=Delivery(prefetch=0))) for r in range(2)]  # fmt: skip
    assert steps[0] == steps[1] > 0
    one = {"capacity": 32, "cp_size": 1, "cp_rank": 0, "layout": "identity", "delivery": Delivery(prefetch=0)}
    tokens = [sum(int((b["input_ids"] != 0).sum()) for b in build_loader(DOCS, **one, data=DataPolicy(epochs=e)))
              for e in (1, 3)]  # fmt: skip
    assert tokens[0] == sum(len(d["input_ids"]) for d in DOCS) and tokens[1] == 3 * tokens[0]
