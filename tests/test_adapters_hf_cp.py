"""``hf_model_kwargs`` at cp = 2 on gloo: a transformers Llama inside the sharder's ctx.

Each rank runs the model on its own shard inside the ctx
``ContextParallelSharder.shard`` returns (its SDPA gathers K/V); the document
mask is ``hf_model_kwargs``' local-queries x global-keys mask. The ranks'
losses (``num_items_in_batch`` = the pack's target count) sum to the cp = 1
loss of the whole pack, and their parameter gradients sum to its gradient.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import LlamaConfig, LlamaForCausalLM

from cpdata.adapters import document_causal_mask, global_target_count, hf_model_kwargs
from cpdata.device.sharder import ContextParallelSharder
from cpdata.gather import gather_token_tensor
from cpdata.nodes.loader import build_loader, closing_loader
from tests.dist_utils import run_ranks

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
    loader = build_loader(docs, capacity=32, cp_size=world, cp_rank=rank, layout=layout, qkv_format=qkv_format,
                          overflow="split", prefetch=0)  # fmt: skip
    with closing_loader(loader):
        for batch in list(loader)[:3]:
            sharder = ContextParallelSharder(None, mesh, batch)
            ctx, local = sharder.shard(batch)
            n = global_target_count(batch, group, labels=local["labels"])
            with ctx():
                loss = model(**hf_model_kwargs(batch, "sdpa", tensors=local, num_items_in_batch=n, config=model)).loss
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
