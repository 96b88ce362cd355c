"""``examples/hf_cp_train.py`` in the world mode (``--layout world --node-size 2``) on 4 gloo ranks as 2
"nodes" x 2.

Per pack, beside every other layout that ships a K/V exchange plan: the example's own loader, model and
``forward_backward`` (the "cpdata" attention over the exchange) give the loss and every gradient of the pack
run on one process with each document alone (the document-causal mask over the whole pack, float64),
to 1e-6 relative.

Per optimizer step (``--micro-batches 2``, the loader dealing each step's two world micro-batches together):
the example's ``train`` keeps every step's loss and reduced gradient equal to its cp 1 reference accumulating
the same packs; step 1's loss equals every document of both packs run alone, over the step's target count
(so the normalisation is the step's, not each pack's); the packs really were dealt by steps (some pack's
layout is not the per-pack deal of its slot lengths) with documents over several ranks (the exchange moves
keys); and a resume from the step-2 checkpoint repeats step 3.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import numpy as np
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
        n_targets = batch.info["n_targets"]
        loss, local = ex.forward_backward(model, batch, sharder, mesh["cp"].get_group(), n_targets)
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


STEP_ARGS = ["--layout", "world", "--node-size", "2", "--micro-batches", "2", "--attention", "cpdata", "--files", "6",
             "--capacity", "512", "--workers", "0", "--check-parity"]  # fmt: skip


def _owner_of_each_position(batch) -> np.ndarray:
    """int64 ``[pack_len]``: the rank holding each global position (``gather_index[g]``: position ``g``'s place
    in the rank-major concatenation of the shards)."""
    gather = batch.layout.gather_index.numpy()
    return gather // (gather.size // batch.layout.cp_size)


def _documents_alone(model, full: dict, cu_seqlens: list[int]) -> float:
    """Summed cross-entropy (float64) of every document of a gathered pack run by itself."""
    total = 0.0
    for lo, hi in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True):
        if hi == lo:  # (an all-pad pack's empty slot)
            continue
        logits = model(input_ids=full["input_ids"][:, lo:hi], position_ids=full["position_ids"][:, lo:hi],
                       use_cache=False).logits  # fmt: skip
        total += torch.nn.functional.cross_entropy(logits[0], full["labels"][0, lo:hi].long(), ignore_index=-100,
                                                   reduction="sum").item()  # fmt: skip
    return total


def _steps(rank: int, world: int, ckpt: str, steps: int) -> dict:
    sys.path.insert(0, str(ROOT / "examples"))
    import hf_cp_train as ex

    from cpdata import ContextParallelSharder
    from cpdata.layout.maps import rank_indices

    args = ex.parse_args([*STEP_ARGS, "--steps", str(steps), "--save-every", "2", "--ckpt-dir", ckpt])
    straight = ex.train(args)
    resumed = ex.train(ex.parse_args([*STEP_ARGS, "--steps", str(steps), "--resume", "--ckpt-dir", ckpt]))
    # the same loader and initial weights again: what the steps were made of
    mesh = ex.build_mesh(args)
    texts = ex.corpus(args.files)
    tokenizer = ex.build_tokenizer(args, texts)
    alone = ex.build_model(args, tokenizer.get_vocab_size(), tokenizer.token_to_id(ex.PAD) or 0, torch.float64)
    alone.set_attn_implementation("sdpa")
    pad_id, eos_id = ex.special_ids(tokenizer, alone.config)
    loader = ex.build_loader(args, ex.tokenize(tokenizer, texts, eos_id), mesh, pad_id, tokenizer.get_vocab_size())
    packs, it = [], None
    for step in range(steps):
        batches, it = ex.step_batches(loader, it, args.micro_batches)
        n_targets = sum(b.info["n_targets"] for b in batches)
        summed = 0.0
        for batch in batches:
            assert batch.layout.kv_exchange is not None
            cu = batch["cu_seqlens"].tolist()
            lens = np.diff(cu)
            owner = _owner_of_each_position(batch)
            per_pack = np.full_like(owner, -1)
            for r, row in enumerate(rank_indices(ex.layout_of(args, world), world, lens[lens > 0], owner.size)):
                per_pack[row] = r
            packs.append({"step": step + 1, "docs": batch.info["n_documents"], "targets": batch.info["n_targets"],
                          "own_deal": bool((owner != per_pack).any()),
                          "ranks": [len(set(owner[lo:hi].tolist())) for lo, hi in zip(cu[:-1], cu[1:], strict=True)],
                          "recv": int(batch.layout.kv_exchange.n_recv)})  # fmt: skip
            if step == 0:
                sharder = ContextParallelSharder(None, mesh, batch)
                _, local = sharder.shard(batch)
                full = {k: sharder.gather_token_tensor(local[k].reshape(1, -1), seq_dim=1) for k in ex.TOKEN_KEYS}
                with torch.no_grad():
                    summed += _documents_alone(alone, full, cu)
        if step == 0:
            step1_alone = summed / n_targets
    return {"straight": straight, "resumed": resumed, "packs": packs, "step1_alone": step1_alone}


def test_world_steps_accumulate_two_micro_batches_like_each_document_alone(tmp_path):
    steps = 3
    results = run_ranks(_steps, 4, str(tmp_path / "ckpt"), steps, timeout=600)
    first = results[0]
    straight, resumed, packs = first["straight"], first["resumed"], first["packs"]
    print({"parity": straight["parity"], "losses": straight["losses"], "step1_alone": first["step1_alone"],
           "packs": packs})  # fmt: skip
    # every step's loss and gradient, and the final weights, equal the cp 1 reference accumulating the same packs
    assert straight["parity_ok"] is True, straight["parity"]
    assert straight["parity"]["loss"] < 1e-6 and straight["parity"]["grad"] < 1e-6, straight["parity"]
    assert sorted(straight["losses"]) == [1, 2, 3] and len(set(straight["losses"].values())) == 3, "the loss moved"
    # step 1 (the initial weights): every document of both packs alone, over the step's target count
    assert abs(straight["losses"][1] - first["step1_alone"]) <= 1e-6 * first["step1_alone"]
    # the loader's steps are the optimizer's: 2 packs each, some with documents in both
    assert [p["step"] for p in packs] == [1, 1, 2, 2, 3, 3]
    assert any(all(p["targets"] for p in packs if p["step"] == s) for s in range(1, steps + 1))
    assert sum(p["docs"] for p in packs) >= 6, "several documents: the mask and the deal matter"
    assert any(p["own_deal"] for p in packs), "some pack laid out from the step's deal, not its own slot lengths"
    assert any(max(p["ranks"], default=0) > 1 for p in packs), "a document over several ranks"
    assert sum(p["recv"] for r in results for p in r["packs"]) > 0, "keys crossed ranks: the exchange was exercised"
    plans = [[{k: v for k, v in p.items() if k != "recv"} for p in r["packs"]] for r in results]
    assert all(plan == plans[0] for plan in plans)  # every rank saw the same plans
    # resumed from the step-2 checkpoint: step 3 again, exactly
    assert resumed["losses"] == {3: straight["losses"][3]}, (resumed["losses"], straight["losses"])
    assert resumed["parity_ok"] is True, resumed["parity"]
