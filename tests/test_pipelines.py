"""Every ready-made pipeline yields per-rank shards that reassemble to a correct full pack.

Documents encode their own coordinates: token ``k`` of document ``d`` is
``d * 1000 + k``. A brute-force check of the reassembled pack (concatenate the
ranks' shards, apply ``layout.gather_index``) then needs no second
implementation: every real token must sit at its document position, carry the
right target, and every document's tokens must appear exactly once per epoch.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from cpdata.nodes.loader import close_loader, closing_loader
from cpdata.nodes.options import DataPolicy, Delivery, StreamPlan
from cpdata.recipes import balanced_allgather, precomputed, pretrain_concat, sft_thd
from cpdata.worker.keys import METADATA_KEYS

CP = 2
PAD = 999_999
STRIDE = 1000


def make_docs(n: int = 40, seed: int = 0, max_len: int = 150, sft: bool = False) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    docs = []
    for d in range(n):
        length = int(rng.integers(1, max_len))
        doc = {"input_ids": d * STRIDE + np.arange(length, dtype=np.int64)}
        if sft:  # prompt (no loss) then response; labels are the next token inside the response
            prompt = length // 3
            labels = np.append(doc["input_ids"][1:], -100)
            labels[:prompt] = -100
            doc["labels"] = labels
            doc["loss_mask"] = (np.arange(length) >= prompt).astype(np.int64)
        docs.append(doc)
    return docs


def reassemble(shards) -> dict[str, torch.Tensor]:
    """The full batch from every rank's shard: ``concat(shards)[gather_index]`` on the token dim."""
    layout = shards[0].layout
    assert [s.layout.cp_rank for s in shards] == list(range(layout.cp_size))
    assert len({s.layout.digest for s in shards}) == 1, "CP ranks disagree on the plan"
    full = {}
    for key, value in shards[0].items():
        if key in METADATA_KEYS:
            assert all(torch.equal(s[key], value) for s in shards), f"metadata {key!r} differs across ranks"
            full[key] = value
            continue
        cat = torch.cat([s[key] for s in shards], dim=-1)
        full[key] = cat.index_select(-1, layout.gather_index)
        for s in shards:  # each shard is the full pack at its global positions
            assert torch.equal(full[key].index_select(-1, s.layout.local_token_global_indices), s[key])
    return full


def check_full_pack(full, docs, *, seen: dict[int, list[int]], sft: bool = False, limit: int | None = None) -> int:
    """Brute-force check of one reassembled batch; returns the number of document pieces in it."""
    rows = full["input_ids"].reshape(-1, full["input_ids"].shape[-1])
    keys = ("input_ids", "labels", "position_ids", "padding_mask", "document_ids") + (("loss_mask",) if sft else ())
    tensors = {k: full[k].reshape(rows.shape).numpy() for k in keys}
    pieces = 0
    for r in range(rows.shape[0]):
        ids, labels, pos = tensors["input_ids"][r], tensors["labels"][r], tensors["position_ids"][r]
        pad, doc_ids = tensors["padding_mask"][r], tensors["document_ids"][r]
        assert (ids[pad] == PAD).all() and (labels[pad] == -100).all()
        real = np.flatnonzero(~pad)
        d, k = ids[real] // STRIDE, ids[real] % STRIDE
        assert (pos[real] == k).all(), "position ids must be the token's offset in its document"
        for t, dd, kk in zip(real, d, k, strict=True):
            source = docs[dd]
            want = source["labels"][kk] if sft else (ids[t] + 1 if kk + 1 < len(source["input_ids"]) else -100)
            if sft and kk + 1 == limit < len(source["input_ids"]):
                want = -100  # truncated: the last kept token's target was cut off
            assert labels[t] == want, f"label of doc {dd} token {kk}: {labels[t]} != {want}"
            if sft:
                assert tensors["loss_mask"][r][t] == (want != -100), "loss_mask is labels != -100"
            seen.setdefault(int(dd), []).append(int(kk))
        # one document id per piece, pieces contiguous and in increasing document-id order
        starts = np.flatnonzero(np.diff(doc_ids[real], prepend=-1))
        pieces += len(starts)
        assert (np.diff(doc_ids) >= 0).all()
        for a, b in zip(starts, list(starts[1:]) + [len(real)], strict=True):
            assert len(set(d[a:b].tolist())) == 1 and (np.diff(k[a:b]) == 1).all()
    return pieces


def run_epoch(build, docs, *, sft=False, **kwargs):
    """Iterate one epoch on CP ranks 0..CP-1 in lockstep; brute-force check every batch."""
    loaders = [build(docs, cp_size=CP, cp_rank=r, padding_token_id=PAD, **kwargs) for r in range(CP)]
    seen: dict[int, list[int]] = {}
    fulls, pieces = [], 0
    try:
        for shards in zip(*loaders, strict=True):
            full = reassemble(shards)
            pieces += check_full_pack(full, docs, seen=seen, sft=sft, limit=kwargs.get("capacity") if sft else None)
            fulls.append((full, shards[0].layout))
    finally:
        for loader in loaders:
            close_loader(loader)
    assert fulls and pieces > len(fulls), "expected packs holding several documents"
    return fulls, seen


def assert_every_token_once(docs, seen, limit=None):
    for d, doc in enumerate(docs):
        n = len(doc["input_ids"]) if limit is None else min(limit, len(doc["input_ids"]))
        assert sorted(seen.get(d, [])) == list(range(n)), f"document {d} not served exactly once"


def cp1_reference(build, docs, **kwargs):
    loader = build(docs, cp_size=1, cp_rank=0, padding_token_id=PAD, **kwargs)
    try:
        return [dict(b) for b in loader]
    finally:
        close_loader(loader)


def test_balanced_allgather_reassembles_to_cp1_pack():
    docs = make_docs()
    fulls, seen = run_epoch(balanced_allgather.build, docs, capacity=128)
    assert_every_token_once(docs, seen)
    assert any(not torch.equal(layout.local_token_global_indices, torch.arange(64)) for _, layout in fulls)
    reference = cp1_reference(balanced_allgather.build, docs, capacity=128)
    assert len(reference) == len(fulls)
    for (full, _), ref in zip(fulls, reference, strict=True):
        for key in ("input_ids", "labels", "position_ids", "padding_mask", "document_ids", "cu_seqlens"):
            assert torch.equal(full[key], ref[key]), key


def test_pretrain_concat_is_full_round_robin_packs():
    docs = make_docs(seed=1)
    fulls, seen = run_epoch(pretrain_concat.build, docs, capacity=256, batch_size=2)
    assert_every_token_once(docs, seen)
    pads = [int(full["padding_mask"].sum()) for full, _ in fulls]
    assert pads[:-1] == [0] * (len(pads) - 1), "concat packs are full except the last"
    # round robin, cp=2: rank 0 holds chunks 0 and 3 of the 256-token pack
    expected = torch.cat([torch.arange(0, 64), torch.arange(192, 256)])
    assert torch.equal(fulls[0][1].local_token_global_indices, expected)
    reference = cp1_reference(pretrain_concat.build, docs, capacity=256, batch_size=2)
    for (full, _), ref in zip(fulls, reference, strict=True):
        for key in ("input_ids", "labels", "position_ids", "document_ids"):
            assert torch.equal(full[key], ref[key]), key


def test_sft_thd_passes_labels_and_loss_mask_through():
    docs = make_docs(seed=2, max_len=300, sft=True)
    fulls, seen = run_epoch(sft_thd.build, docs, sft=True, capacity=256, batch_size=2,
                            data=DataPolicy(labels_alignment="targets"))
    assert_every_token_once(docs, seen, limit=256)  # over-long examples are truncated to the capacity
    assert any(len(d["input_ids"]) > 256 for d in docs), "no example exercised truncation"
    for full, layout in fulls:
        assert full["input_ids"].dim() == 1, "THD shards are flat streams"
        padded = full["cu_seqlens_padded"].numpy()
        assert (np.diff(padded) % (2 * CP) == 0).all(), "thd slots are multiples of 2*cp"
        assert padded[-1] == full["input_ids"].numel() == layout.padded_seq_len
        real = full["cu_seqlens"].numpy()
        assert (np.diff(real) == np.bincount(full["document_ids"][~full["padding_mask"]].numpy(),
                                             minlength=len(real) - 1)).all()


@pytest.mark.parametrize("dp_size", [1, 2])
def test_precomputed_matches_online_packing(tmp_path, dp_size):
    from cpdata.offline.precompute_plan import precompute

    docs = make_docs(seed=3, max_len=200)
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"input_ids": d["input_ids"].tolist()}) + "\n" for d in docs))
    plan_dir = tmp_path / "plan"
    precompute(path, plan_dir, capacity=128, cp_size=CP, layout="balanced", plan=StreamPlan(overflow="split"))
    seen: dict[int, list[int]] = {}
    for dp_rank in range(dp_size):
        fulls, part = run_epoch(
            lambda _docs, dp_rank=dp_rank, **kw: precomputed.build(
                plan_dir, path, data=DataPolicy(dp_rank=dp_rank, dp_size=dp_size), **kw),
            docs,
        )
        for d, ks in part.items():
            seen.setdefault(d, []).extend(ks)
        if dp_size == 1:  # same packs as the online pipeline over the same documents
            online = cp1_reference(balanced_allgather.build, docs, capacity=128)
            assert len(online) == len(fulls)
            for (full, _), ref in zip(fulls, online, strict=True):
                assert torch.equal(full["input_ids"], ref["input_ids"])
    if dp_size == 1:
        assert_every_token_once(docs, seen)
    else:  # DP ranks serve disjoint packs
        assert all(len(ks) == len(set(ks)) for ks in seen.values())


def test_precomputed_recipe_serves_labelled_documents_in_the_plans_convention(tmp_path):
    from cpdata.offline.precompute_plan import precompute

    rng = np.random.default_rng(5)
    rows = []
    for n in rng.integers(5, 60, 20):
        ids = rng.integers(1, 500, int(n)).tolist()
        rows.append({"input_ids": ids, "labels": [*ids[1:], -100]})  # Megatron-style: already next-token targets
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    plan_dir = tmp_path / "plan"
    precompute(path, plan_dir, capacity=128, cp_size=CP, layout="balanced", data=DataPolicy(labels_alignment="targets"))
    with pytest.raises(ValueError, match="labels_alignment='targets'"):
        precomputed.build(plan_dir, path, cp_size=CP, cp_rank=0, data=DataPolicy(labels_alignment="inputs"))
    local = 0
    for cp_rank in range(CP):
        with closing_loader(precomputed.build(plan_dir, path, cp_size=CP, cp_rank=cp_rank, delivery=Delivery(prefetch=0),
                                              data=DataPolicy(labels_alignment="targets"))) as loader:  # fmt: skip
            batches = list(loader)
        local += sum(int((b["labels"] != -100).sum()) for b in batches)
    expected = sum(len(r["input_ids"]) - 1 for r in rows)  # every given target, trained once
    assert local == sum(b.info["n_targets"] for b in batches) == expected
    # the recipe's graph is PrecomputedDataset's: a pad id outside the vocabulary is refused before serving
    with pytest.raises(ValueError, match="padding_token_id=500 is >= vocab_size=500"):
        precomputed.build(plan_dir, path, cp_size=CP, cp_rank=0, padding_token_id=500,
                          data=DataPolicy(labels_alignment="targets", vocab_size=500))  # fmt: skip


def test_recipes_have_one_home_and_pipelines_is_its_entry():
    from pathlib import Path

    import cpdata.recipes
    import pipelines

    assert pipelines.__all__ == cpdata.recipes.__all__ and len(pipelines.__all__) == 4
    for name in pipelines.__all__:  # the same module object, not a second copy or a wrapper around build
        assert getattr(pipelines, name) is getattr(cpdata.recipes, name), name
        assert getattr(pipelines, name).__name__ == f"cpdata.recipes.{name}"
    folder = Path(pipelines.__file__).parent
    assert sorted(p.name for p in folder.glob("*.py")) == ["__init__.py"], "a recipe module belongs in cpdata/recipes"


@pytest.mark.parametrize("recipe", [balanced_allgather, pretrain_concat, sft_thd])
@pytest.mark.parametrize(("old", "record"), [("dp_rank", "data=DataPolicy(dp_rank=...)"),
                                             ("seed", "data=DataPolicy(seed=...)"),
                                             ("prefetch", "delivery=Delivery(prefetch=...)")])
def test_recipes_take_the_option_records_and_name_them_for_an_old_keyword(recipe, old, record):
    name = recipe.__name__.rsplit(".", 1)[1]
    with pytest.raises(TypeError, match=rf"{name}.build\(\) no longer takes {old}=; pass {re.escape(record)}"):
        recipe.build(make_docs(4), capacity=128, cp_size=1, cp_rank=0, **{old: 1})
    with pytest.raises(TypeError, match="unexpected keyword argument 'padding_tokn_id'; did you mean 'padding_token_id'"):
        recipe.build(make_docs(4), capacity=128, cp_size=1, cp_rank=0, padding_tokn_id=0)
    # the records reach the loader: DP rank 1 of 2 serves other documents than rank 0
    docs = make_docs(12)
    firsts = []
    for dp_rank in (0, 1):
        with closing_loader(recipe.build(docs, capacity=512, cp_size=1, cp_rank=0, delivery=Delivery(prefetch=0),
                                         data=DataPolicy(dp_rank=dp_rank, dp_size=2))) as loader:  # fmt: skip
            firsts.append(next(iter(loader))["input_ids"].flatten()[:8].tolist())
    assert firsts[0] != firsts[1]


def test_precomputed_recipe_refuses_an_order_the_plan_fixed(tmp_path):
    from cpdata.offline.precompute_plan import precompute

    docs = make_docs(seed=4, max_len=100)
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"input_ids": d["input_ids"].tolist()}) + "\n" for d in docs))
    precompute(path, tmp_path / "plan", capacity=128, cp_size=CP, layout="balanced", plan=StreamPlan(overflow="split"))
    with pytest.raises(ValueError, match=r"DataPolicy\(seed=3, shuffle=True\) does not apply here"):
        precomputed.build(tmp_path / "plan", path, cp_size=CP, cp_rank=0, data=DataPolicy(seed=3, shuffle=True))
    with pytest.raises(TypeError, match=r"precomputed.build\(\) no longer takes dp_size=; pass data=DataPolicy"):
        precomputed.build(tmp_path / "plan", path, cp_size=CP, cp_rank=0, dp_size=2)


def test_precomputed_recipe_reads_the_documents_in_any_form_precompute_took(tmp_path):
    """A ``datasets.Dataset`` (not a path) reaches the plan as ``PrecomputedDataset`` takes it, and serves the
    same batches as a plan of the same rows read from a file; each plan refuses the other's documents."""
    datasets = pytest.importorskip("datasets")
    from cpdata.offline.precompute_plan import precompute

    docs = make_docs(seed=7, max_len=120)
    rows = [{"input_ids": d["input_ids"].tolist()} for d in docs]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = datasets.Dataset.from_list(rows)
    served = {}
    for name, documents in (("table", table), ("file", path)):
        precompute(documents, tmp_path / name, capacity=128, cp_size=CP, layout="balanced")
        with closing_loader(precomputed.build(tmp_path / name, documents, cp_size=CP, cp_rank=1,
                                              delivery=Delivery(prefetch=0))) as loader:  # fmt: skip
            served[name] = [b["input_ids"].clone() for b in loader]
    assert len(served["table"]) == len(served["file"]) > 1
    assert all(torch.equal(a, b) for a, b in zip(served["table"], served["file"], strict=True))
    with pytest.raises(ValueError, match="was precomputed from"):
        precomputed.build(tmp_path / "table", path, cp_size=CP, cp_rank=0)
    with pytest.raises(ValueError, match="needs the documents it was computed over"):
        precomputed.build(tmp_path / "table", None, cp_size=CP, cp_rank=0)
