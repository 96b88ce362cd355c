"""``examples/hf_cp_train.py`` in the world mode (``--layout world --node-size 2``) on 4 gloo ranks as 2
"nodes" x 2, beside every other layout that ships a K/V exchange plan: the example's own loader, model and
``forward_backward`` (the "cpdata" attention over the exchange) give the loss and every gradient of the pack
run on one process with each document alone (the document-causal mask over the whole pack, float64),
to 1e-6 relative."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from dist_utils import run_ranks

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = ("world", "tiled", "balanced", "contiguous", "round_robin", "thd")


def _rank(rank: int, world: int) -> list[tuple]:
    sys.path.insert(0, str(ROOT / "examples"))
    import hf_cp_train as ex

    from cpdata import ContextParallelSharder
    from cpdata.adapters import document_causal_mask

    out = []
    args = ex.parse_args(["--files", "6", "--capacity", "512", "--node-size", "2", "--workers", "0",
                          "--check-parity"])  # fmt: skip
    mesh = ex.build_mesh(args)
    texts = ex.corpus(args.files)
    tokenizer = ex.build_tokenizer(args, texts)
    model = ex.build_model(args, tokenizer.get_vocab_size(), tokenizer.token_to_id(ex.PAD) or 0, torch.float64)
    pad_id, eos_id = ex.special_ids(tokenizer, model.config)
    docs = ex.tokenize(tokenizer, texts, eos_id)
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    for layout in LAYOUTS:
        args.layout = layout
        loader = ex.build_loader(args, docs, mesh, pad_id, tokenizer.get_vocab_size())
        batch = next(b for b in loader if b.info["n_documents"] >= 3)  # the pack's count: the same on every rank
        assert batch.layout.kv_exchange is not None, layout
        sharder = ContextParallelSharder(None, mesh, batch)
        model.zero_grad(set_to_none=True)
        loss, local, n_targets = ex.forward_backward(model, batch, sharder, mesh["cp"].get_group())
        ex.all_reduce_grads(model, 1)
        summed = loss.reshape(1).clone()
        dist.all_reduce(summed)
        full = {k: sharder.gather_token_tensor(local[k].reshape(1, -1), seq_dim=1) for k in ex.TOKEN_KEYS}
        mask = document_causal_mask(None, full["document_ids"], local["cu_seqlens_padded"])
        reference.zero_grad(set_to_none=True)
        ref = reference(input_ids=full["input_ids"], position_ids=full["position_ids"], attention_mask=mask,
                        labels=full["labels"], shift_labels=full["labels"], num_items_in_batch=n_targets,
                        use_cache=False).loss  # fmt: skip
        ref.backward()
        grad_err = max(((p.grad - q.grad).norm() / q.grad.norm()).item()
                       for p, q in zip(model.parameters(), reference.parameters(), strict=True) if q.grad.norm() > 0)
        out.append((layout, ex.layout_of(args, 4), summed.item(), ref.item(), grad_err, batch.info["n_documents"],
                    int(batch.layout.kv_exchange.n_recv)))  # fmt: skip
    return out


def test_the_world_mode_of_the_example_gives_each_document_alone_on_2_nodes_of_2():
    results = run_ranks(_rank, 4, timeout=600)
    assert [r[0] for r in results[0]] == list(LAYOUTS)
    for layout, _, loss, ref, grad_err, docs, _ in results[0]:
        assert abs(loss - ref) <= 1e-6 * abs(ref) and grad_err < 1e-6, (layout, loss, ref, grad_err)
        assert docs >= 3, (layout, docs)  # several documents: the mask and the deal matter
    assert results[0][0][1] == "world:2"
    assert sum(r[6] for rank in results for r in rank) > 0  # keys crossed ranks: the exchange was exercised
    print({r[0]: (f"{abs(r[2] - r[3]) / abs(r[3]):.1e}", f"{r[4]:.1e}", sum(x[i][6] for x in results))
           for i, r in enumerate(results[0])})  # layout: (loss error, worst gradient error, keys received)
