"""``hf_model_kwargs`` at cp = 2 on gloo: a transformers Llama inside the sharder's ctx.

Each rank runs the model on its own shard inside the ctx
``ContextParallelSharder.shard`` returns (its SDPA gathers K/V); the document
mask is ``hf_model_kwargs``' local-queries x global-keys mask. The ranks'
losses (``num_items_in_batch`` = the pack's target count) sum to the cp = 1
loss of the whole pack, and their parameter gradients sum to its gradient.

The pack's target count comes from ``batch.info["n_targets"]``, which the worker
records on every path (live, scheduled, windowed, mix, precomputed): it equals
:func:`global_target_count`'s all-reduce, and ``hf_model_kwargs`` fills it in
without any collective.
"""

from __future__ import annotations

import json
from unittest import mock

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torchdata.nodes import Loader
from transformers import LlamaConfig, LlamaForCausalLM

import cpdata
from cpdata.adapters import document_causal_mask, global_target_count, hf_model_kwargs, register_hf_attention
from cpdata.gather import gather_token_tensor
from cpdata.nemo.sharder import ContextParallelSharder
from cpdata.nodes.collate import Collate
from cpdata.nodes.loader import build_loader, closing_loader
from cpdata.nodes.options import DataPolicy, Delivery, StreamPlan
from cpdata.nodes.shard import ShardForRank
from cpdata.offline import PrecomputedPacks, precompute
from cpdata.sources.open import open_dataset
from tests.dist_utils import run_ranks
from tests.flat_options import records

VOCAB = 64
LENS = [5, 23, 9, 40, 3, 17, 30, 11, 2, 26]


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      attn_implementation="sdpa")  # fmt: skip
    return LlamaForCausalLM(cfg).double()


def _grads(model) -> torch.Tensor:
    g = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return g


def _rank(rank: int, world: int, layout: str, qkv_format: str) -> list[tuple[float, float, float, int]]:
    g = torch.Generator().manual_seed(0)
    docs = [{"input_ids": torch.randint(1, VOCAB, (n,), generator=g).tolist()} for n in LENS]
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    group = mesh.get_group()
    model = _model()
    out = []
    loader = build_loader(docs, capacity=32, cp_size=world, cp_rank=rank, layout=layout, qkv_format=qkv_format, plan=StreamPlan(overflow="split"), delivery=Delivery(prefetch=0))  # fmt: skip
    with closing_loader(loader):
        for batch in list(loader)[:3]:
            sharder = ContextParallelSharder(None, mesh, batch)
            ctx, local = sharder.shard(batch)
            with ctx():  # no num_items_in_batch: the pack's count from batch.info["n_targets"]
                loss = model(**hf_model_kwargs(batch, "sdpa", tensors=local, config=model)).loss
            loss.backward()
            grad = _grads(model)
            dist.all_reduce(grad)
            total = loss.detach().clone()
            dist.all_reduce(total)
            # the cp = 1 reference: the whole pack, gathered from the shards, on one rank
            full = {k: gather_token_tensor(local[k].reshape(1, -1), batch.layout, group, seq_dim=1)
                    for k in ("input_ids", "position_ids", "labels", "document_ids")}  # fmt: skip
            mask = document_causal_mask(None, full["document_ids"], local["cu_seqlens_padded"])
            ref = model(input_ids=full["input_ids"], position_ids=full["position_ids"], attention_mask=mask,
                        labels=full["labels"], shift_labels=full["labels"], use_cache=False).loss  # fmt: skip
            ref.backward()
            ref_grad = _grads(model)
            out.append((total.item(), ref.item(), ((grad - ref_grad).norm() / ref_grad.norm()).item(),
                        batch.info["n_documents"]))  # fmt: skip
    return out


@pytest.mark.parametrize("layout,qkv_format", [("balanced", "bshd"), ("thd", "thd")])
def test_cp2_losses_and_gradients_sum_to_the_cp1_ones(layout, qkv_format):
    results = run_ranks(_rank, 2, layout, qkv_format, timeout=240)
    assert results[0] == results[1] and len(results[0]) == 3, "every figure is all-reduced or replicated"
    for total, ref, grad_diff, _ in results[0]:
        assert total == pytest.approx(ref, rel=1e-6)  # HF computes the loss in float32
        assert grad_diff < 1e-6
    assert max(r[3] for r in results[0]) > 1, "a pack with several documents"


def _labelled_docs() -> list[dict]:
    """Every third document with labels of its own (some -100), the rest targets derived from the ids."""
    rng = np.random.default_rng(3)
    docs = []
    for i, n in enumerate(LENS * 2):
        ids = rng.integers(1, VOCAB, n)
        targets = np.append(ids[1:], -100)  # labels_alignment="targets": the next token, some masked
        docs.append({"input_ids": ids, "labels": np.where(targets % 4 == 0, -100, targets)} if i % 3 == 0 else
                    {"input_ids": ids})  # fmt: skip
    return docs


class _Stream:  # a re-iterable without lengths (the windowed schedule reads it window by window)
    def __init__(self, docs: list[dict]) -> None:
        self.docs = docs

    def __iter__(self):
        return iter(self.docs)


def _no_collective(*args, **kwargs):
    raise AssertionError("hf_model_kwargs ran a collective for the target count")


def _targets_rank(rank: int, world: int, plan: str, jsonl: str) -> list[tuple[str, int, int, int, int]]:
    register_hf_attention()
    group = dist.group.WORLD
    docs = _labelled_docs()
    common = dict(capacity=32, cp_size=world, cp_rank=rank, layout="balanced", overflow="split", prefetch=0,
                  qkv_format="thd", batch_size=2, labels_alignment="targets")  # fmt: skip
    lengths = [len(d["input_ids"]) for d in docs]
    loaders = {
        "live": lambda: build_loader(docs, **records(**common)),
        "scheduled": lambda: build_loader(docs, **records(schedule="balanced", lengths=lengths, micro_batches=2, **common)),
        "windowed": lambda: build_loader(_Stream(docs), **records(schedule="balanced", schedule_window=6, **common)),
        "mix": lambda: build_loader(cpdata.mix({"a": docs[:7], "b": docs[7:]}, {"a": 1, "b": 2}, seed=1),
                                    **records(**common)),  # fmt: skip
        "precomputed": lambda: Loader(ShardForRank(Collate(PrecomputedPacks(plan, open_dataset(jsonl),
                                                                            data=DataPolicy(labels_alignment="targets")),
                                                           batch_size=2, qkv_format="thd"),
                                                   cp_size=world, cp_rank=rank, layout="balanced")),  # fmt: skip
    }
    out = []
    for name, make in loaders.items():
        with closing_loader(make()) as loader:
            for batch in loader:
                counted = int(global_target_count(batch, group))  # the all-reduce the recorded count replaces
                # kwargs read, never run through a model: the guard that they reach a "cpdata" layer is off here
                with mock.patch.object(dist, "all_reduce", _no_collective), \
                        mock.patch("cpdata.adapters.hf_attention.check_reaches_cpdata"):
                    filled = hf_model_kwargs(batch, "cpdata", group=group)["num_items_in_batch"]
                derived = batch.info["real_tokens"] - batch.info["n_documents"]  # targets if nothing were masked
                out.append((name, batch.info["n_targets"], counted, filled, derived))
    return out


def test_the_recorded_target_count_is_the_all_reduced_one_on_every_path(tmp_path):
    docs = _labelled_docs()
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({k: v.tolist() for k, v in d.items()}) + "\n" for d in docs))
    plan = tmp_path / "plan"
    precompute(open_dataset(jsonl), plan, capacity=32, cp_size=2, layout="balanced", plan=StreamPlan(overflow="split"), data=DataPolicy(labels_alignment="targets"))  # fmt: skip
    results = run_ranks(_targets_rank, 2, str(plan), str(jsonl), timeout=240)
    assert results[0] == results[1], "both CP ranks record the same count"
    for name in ("live", "scheduled", "windowed", "mix", "precomputed"):
        rows = [r for r in results[0] if r[0] == name]
        assert len(rows) >= 2, name
        for _, recorded, counted, filled, _ in rows:
            assert type(recorded) is int and recorded == counted == filled > 0, (name, recorded, counted, filled)
        assert any(n < derived for _, n, _, _, derived in rows), f"{name}: no batch with masked labels"
