"""Train a Hugging Face causal LM with context parallelism, fed by cpdata: the whole recipe in one file.

    torchrun --standalone --nproc-per-node 2 examples/hf_cp_train.py                     # cp 2
    torchrun --standalone --nproc-per-node 4 examples/hf_cp_train.py --cp-size 2         # dp 2 x cp 2
    torchrun --standalone --nproc-per-node 2 examples/hf_cp_train.py --check-parity      # each step vs cp 1
    torchrun --standalone --nproc-per-node 2 examples/hf_cp_train.py --steps 4 --save-every 2
    torchrun --standalone --nproc-per-node 2 examples/hf_cp_train.py --steps 4 --resume  # steps 3-4 again
    torchrun --nnodes 2 --nproc-per-node 8 ... examples/hf_cp_train.py --layout world  # one CP group of 16
    torchrun ... examples/hf_cp_train.py --layout world --micro-batches 4  # 4 world micro-batches a step

The eight steps, each one function below:

1. tokenizer: a byte-level BPE trained in-process on Python standard-library
   definitions (``tokenizers``, no download), or ``--model DIR``'s own.
2. model: a tiny random ``LlamaForCausalLM``, or ``--model DIR`` (local weights
   only), with cpdata's registered attention (``--attention cpdata``, the
   default: every layer's window, softcap and sinks) or ``sdpa``.
3. mesh: ``(dp, cp)`` from the world size; CP ranks are neighbours.
4. loader: a ``CPDataLoader`` over this rank's ``CPDataset`` (the documents are
   sharded by DP rank; every CP rank of a DP group packs the same documents and
   keeps only its own share of each pack, laid out on the dataloader worker).
   ``--layout world``: the whole world one CP group, each pack planned as
   per-rank bins (short documents whole on one rank, long ones over the
   fewest ranks of one node); ``--node-size`` defaults to torchrun's
   ``LOCAL_WORLD_SIZE``, read here, never on the worker. Each batch's
   ``verify_layout_consistency`` is a check, not part of the training: one
   16-byte all-reduce (MAX of the plan digest and its negation) over the CP
   group, so ranks fed different plans raise instead of training on garbage.
5. attention (:func:`forward_backward`): ``"cpdata"`` needs no ctx; each layer
   brings the keys its rank's documents need in one collective (the all-to-all
   of the batch's exchange plan, ``--kv-exchange``, on by default with the
   ``tiled`` layout; else an all-gather). ``sdpa`` runs inside the sharder's
   ctx, whose SDPA override gathers K/V over the CP group, with
   ``hf_model_kwargs``' mask over the global keys.
6. loss: each rank's target sum over the step's GLOBAL target count (the
   sum of its micro-batches' ``batch.info["n_targets"]``, counted on the
   worker: no collective), so the CP ranks' losses add up to the cp 1 loss of
   the step's documents.
7. gradients: the K/V exchange's (or gather's) backward sends every key's
   gradient back to its owner, so each rank's gradient is its tokens' share of
   the step's gradient, accumulated over its micro-batches: SUM over CP, then
   average over DP (one flat all-reduce over every rank per optimizer step,
   divided by dp).
8. checkpoint: model, optimizer and the loader's state, per rank, between
   optimizer steps; ``--resume`` continues with exactly the batches an
   uninterrupted run would see.

``--micro-batches G`` accumulates G batches into each optimizer step. With
``--layout world`` the loader deals them together
(``StreamPlan(world_step=G)``): each step's G world micro-batches are planned
at once so that every rank's attention tiles SUMMED over the step balance (a
rank holding a long document's piece in one micro-batch holds less in
another), and each pack carries the ranks that own each of its documents.
That sum is the step time only because the ranks meet once a step: the
gradients are all-reduced once, after the G backward passes, and within a
micro-batch the only collective is the K/V exchange between the ranks that
need each other's keys. Trade-off: the worker holds up to G packs until a
step closes, and a micro-batch may be part pad (or all pad) where balance asks
for it. A step never spans epochs (an epoch's last step may be shorter), so
every epoch's first step is the loader's first world step.

``--check-parity`` trains a cp 1 reference (HF's sdpa on the whole pack,
gathered from the shards, accumulating the same micro-batches with the same
normalisation) beside the CP model, in float64, and exits non-zero unless every
optimizer step's loss and every gradient (1e-6 relative) and the final weights
(1e-5 relative) match.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from corpus import StdlibDefinitions  # noqa: E402

from cpdata import (  # noqa: E402
    ContextParallelSharder,
    CPDataLoader,
    CPDataset,
    DataPolicy,
    Delivery,
    StreamPlan,
    verify_layout_consistency,
)
from cpdata.adapters import document_causal_mask, hf_model_kwargs, register_hf_attention  # noqa: E402
from cpdata.layout.maps import layout_spec  # noqa: E402

PAD, EOS = "<pad>", "<eos>"
TOKEN_KEYS = ("input_ids", "position_ids", "labels", "document_ids")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a local HF model folder (weights + tokenizer); default: tiny Llama")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--cp-size", type=int, default=None, help="default: the world size (dp 1)")
    p.add_argument("--layout", default="tiled", help="tiled: whole 128-token blocks, balanced kernel tiles; world: "
                   "the whole world one CP group, short documents whole on one rank (with --cp-size = the world)")
    p.add_argument("--node-size", type=int, default=None,
                   help="ranks per node for --layout world (default: torchrun's LOCAL_WORLD_SIZE)")
    p.add_argument("--attention", choices=("cpdata", "sdpa"), default="cpdata",
                   help="cpdata: the registered attention (no ctx); sdpa: inside the sharder's ctx")
    p.add_argument("--kv-exchange", action=argparse.BooleanOptionalAction, default=True,
                   help="ship each batch's K/V exchange plan (the 'cpdata' attention moves only the keys needed)")
    p.add_argument("--capacity", type=int, default=512, help="tokens per pack, before CP sharding")
    p.add_argument("--micro-batches", type=int, default=1, metavar="G",
                   help="batches accumulated per optimizer step (--layout world: dealt together)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--files", type=int, default=40, help="standard-library files to read definitions from")
    p.add_argument("--vocab", type=int, default=512, help="BPE vocabulary size")
    p.add_argument("--workers", type=int, default=1, help="dataloader worker processes")
    p.add_argument("--check-parity", action="store_true")
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--ckpt-dir", default="checkpoints/hf_cp_train")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.micro_batches < 1:
        raise ValueError(f"--micro-batches {args.micro_batches}: an optimizer step takes at least one batch; "
                         "pass --micro-batches 1 or more")  # fmt: skip
    return args


# 1. tokenizer ----------------------------------------------------------------------------------------
def corpus(files: int) -> list[str]:
    """Python standard-library definitions (functions, methods, class headers) as text: no download."""
    return [bytes(doc["input_ids"]).decode("utf-8", "replace") for doc in StdlibDefinitions(limit=files)]


def build_tokenizer(args, texts: list[str]):
    """``tokenizers.Tokenizer``: ``--model``'s own, else a byte-level BPE trained here (~0.5 s)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if args.model:
        return Tokenizer.from_file(str(Path(args.model) / "tokenizer.json"))
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab, special_tokens=[PAD, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    bpe.train_from_iterator(texts, trainer=trainer)
    return bpe


def special_ids(tokenizer, config) -> tuple[int, int]:
    """``(pad, eos)``: this script's ``<pad>``/``<eos>``, else the model's own ids (pads are never trained on,
    so any id works there; EOS ends every document)."""
    eos = tokenizer.token_to_id(EOS)
    if eos is None:
        eos = config.eos_token_id[0] if isinstance(config.eos_token_id, list) else config.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no <eos> and the model config no eos_token_id; pass a model that has one")
    pad = tokenizer.token_to_id(PAD)
    pad = pad if pad is not None else (config.pad_token_id if config.pad_token_id is not None else eos)
    return int(pad), int(eos)


def tokenize(tokenizer, texts: list[str], eos_id: int) -> list[dict[str, np.ndarray]]:
    """One document per text: its ids plus EOS (int32)."""
    return [{"input_ids": np.array([*enc.ids, eos_id], dtype=np.int32)} for enc in tokenizer.encode_batch(texts)]


# 2. model --------------------------------------------------------------------------------------------
def build_model(args, vocab_size: int, pad_id: int, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa", local_files_only=True)
    else:
        config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.capacity,
                             pad_token_id=pad_id, attn_implementation="sdpa")  # fmt: skip
        model = LlamaForCausalLM(config)
    if args.attention == "cpdata":
        model.set_attn_implementation(register_hf_attention())
    return model.to(device=args.device, dtype=dtype)


# 3. mesh ---------------------------------------------------------------------------------------------
def build_mesh(args):
    """``(dp, cp)`` mesh; rank = dp_rank * cp + cp_rank, so a CP group is neighbouring ranks."""
    if args.device.startswith("cuda"):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():  # (a test may have started the group already)
        dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
    world = dist.get_world_size()
    cp = args.cp_size or world
    if world % cp:
        raise ValueError(f"--cp-size {cp} must divide the world size {world}")
    return init_device_mesh(args.device.split(":")[0], (world // cp, cp), mesh_dim_names=("dp", "cp"))


# 4. loader -------------------------------------------------------------------------------------------
def layout_of(args, cp: int) -> str:
    """``--layout``; ``world`` with its node size (``--node-size``, else torchrun's ``LOCAL_WORLD_SIZE``, read
    here: the worker half never reads the environment), e.g. ``"world:8"``."""
    if args.layout != "world":
        return args.layout
    return layout_spec("world", node_size=args.node_size or int(os.environ.get("LOCAL_WORLD_SIZE", cp)))


def stream_plan(args) -> StreamPlan:
    """Split documents longer than a pack; under ``--layout world``, deal each step's ``--micro-batches``
    together (the module docstring)."""
    return StreamPlan(overflow="split", world_step=args.micro_batches if args.layout == "world" else 1)


def build_loader(args, docs, mesh, pad_id: int, vocab_size: int) -> CPDataLoader:
    cp = mesh["cp"].size()
    dataset = CPDataset(docs, capacity=args.capacity, cp_size=cp, cp_rank=mesh["cp"].get_local_rank(),
                        layout=layout_of(args, cp), padding_token_id=pad_id, plan=stream_plan(args),
                        data=DataPolicy(dp_rank=mesh["dp"].get_local_rank(), dp_size=mesh["dp"].size(), shuffle=True,
                                        seed=args.seed, vocab_size=vocab_size),
                        delivery=Delivery(kv_exchange=args.kv_exchange))  # fmt: skip
    context = {"multiprocessing_context": "fork", "persistent_workers": True} if args.workers else {}
    return CPDataLoader(dataset, num_workers=args.workers, pin_memory=args.device.startswith("cuda"), **context)


def step_batches(loader: CPDataLoader, it, micro_batches: int) -> tuple[list, object]:
    """The next optimizer step's batches and the iterator to go on with (None: the epoch ended).

    ``micro_batches`` batches, fewer when the epoch ends first: a step never spans epochs, so every epoch
    starts on the loader's first world step. A new epoch is shuffled from ``(seed, epoch)``; a loader resumed
    at the end of an epoch may end it at once, so one empty epoch is passed over."""
    batches, empty = [], 0
    while len(batches) < micro_batches:
        fresh = it is None
        if fresh:
            it = iter(loader)
        try:
            batches.append(next(it))
        except StopIteration:
            it = None
            if batches:
                break
            empty = empty + 1 if fresh else 0
            if empty > 1:
                raise ValueError("the loader yields no batch in an epoch: give it more documents (--files) or a "
                                 "smaller --capacity") from None  # fmt: skip
    return batches, it


# 5.-7. attention, loss, gradients -----------------------------------------------------------------------
def forward_backward(model, batch, sharder: ContextParallelSharder, cp_group, n_targets: int
                     ) -> tuple[torch.Tensor, dict]:  # fmt: skip
    """This rank's loss (its target sum over ``n_targets``, the targets of the step's packs over every CP rank)
    and its gradient, added to the step's; the only place that chooses the attention."""
    ctx, local = sharder.shard(batch)  # one host-to-device copy: the worker already sharded the pack
    impl = model.config._attn_implementation
    if impl != "sdpa":  # "cpdata": no ctx, every layer gathers (or exchanges) its own K/V
        kwargs = hf_model_kwargs(batch, impl, tensors=local, num_items_in_batch=n_targets, group=cp_group)
        loss = model(**kwargs).loss
        loss.backward()
        return loss.detach(), local
    with ctx():  # cp > 1: SDPA gathers K/V over the CP group (1 collective per layer); backward in it too
        kwargs = hf_model_kwargs(batch, "sdpa", tensors=local, num_items_in_batch=n_targets, config=model)
        loss = model(**kwargs).loss
        loss.backward()
    return loss.detach(), local


def all_reduce_grads(model, divisor: int) -> None:
    """SUM every gradient over all ranks in one flat all-reduce, then divide by ``divisor`` (dp: mean over DP)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= divisor
    for g, chunk in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(chunk.view_as(g))


def reference_forward_backward(reference, local: dict, sharder: ContextParallelSharder, n_targets: int) -> float:
    """cp 1 on the whole pack (gathered from the shards the sharder last moved, ``local``), normalised as the CP
    model's: the loss and gradient every CP micro-batch must reproduce. Its gradients are equal on a group's CP
    ranks, so after a step the sum over all ranks / world is the DP mean."""
    full = {k: sharder.gather_token_tensor(local[k].reshape(1, -1), seq_dim=1) for k in TOKEN_KEYS}
    mask = document_causal_mask(None, full["document_ids"], local["cu_seqlens_padded"])
    loss = reference(input_ids=full["input_ids"], position_ids=full["position_ids"], attention_mask=mask,
                     labels=full["labels"], shift_labels=full["labels"], num_items_in_batch=n_targets,
                     use_cache=False).loss  # fmt: skip
    loss.backward()
    return loss.item()


def relative_difference(tensors, references) -> float:
    """The largest ``|a - b| / |b|`` over pairs (``|a|`` where ``b`` is zero; a missing tensor is zero)."""
    worst = 0.0
    for a, b in zip(tensors, references, strict=True):
        if a is None and b is None:
            continue
        a = torch.zeros_like(b) if a is None else a
        b = torch.zeros_like(a) if b is None else b
        scale = b.norm().item()
        worst = max(worst, (a - b).norm().item() / (scale if scale > 0 else 1.0))
    return worst


# 8. checkpoint ---------------------------------------------------------------------------------------
def checkpoint_path(args, step: int) -> Path:
    return Path(args.ckpt_dir) / f"step_{step:06d}" / f"rank{dist.get_rank()}.pt"


def latest_checkpoint(args) -> Path | None:
    found = sorted(Path(args.ckpt_dir).glob(f"step_*/rank{dist.get_rank()}.pt"))
    return found[-1] if found else None


def train(args: argparse.Namespace) -> dict:
    """Train ``args.steps`` optimizer steps of ``args.micro_batches`` batches (from the last checkpoint with
    ``--resume``); ``{"losses": {step: loss}, "parity_ok": bool | None, "parity": {"loss", "grad", "weight":
    worst relative difference} | None}``, the same on every rank (``"grad"``: this rank's reduced gradients,
    equal on every rank)."""
    mesh = build_mesh(args)
    world, dp_size, rank0 = dist.get_world_size(), mesh["dp"].size(), dist.get_rank() == 0
    cp_group = mesh["cp"].get_group()
    texts = corpus(args.files)
    tokenizer = build_tokenizer(args, texts)
    vocab_size = tokenizer.get_vocab_size()
    dtype = torch.float64 if args.check_parity else torch.float32
    model = build_model(args, vocab_size, tokenizer.token_to_id(PAD) or 0, dtype)
    pad_id, eos_id = special_ids(tokenizer, model.config)
    docs = tokenize(tokenizer, texts, eos_id)
    models = {"model": model}
    if args.check_parity:  # the same weights, HF's own sdpa over the whole pack
        models["reference"] = copy.deepcopy(model)
        models["reference"].set_attn_implementation("sdpa")
    opts = {k: torch.optim.AdamW(m.parameters(), lr=args.lr, weight_decay=0.01) for k, m in models.items()}
    loader = build_loader(args, docs, mesh, pad_id, vocab_size)
    start = 0
    if args.resume and (ckpt := latest_checkpoint(args)) is not None:
        state = torch.load(ckpt, map_location=args.device, weights_only=True)
        for k, m in models.items():
            m.load_state_dict(state[k])
            opts[k].load_state_dict(state[f"{k}_opt"])
        loader.load_state_dict(state["loader"])
        start = int(state["step"])
        if rank0:
            print(f"resumed from {ckpt.parent} at step {start}")
    if rank0:
        params = sum(p.numel() for p in model.parameters())
        print(f"dp={dp_size} cp={mesh['cp'].size()} layout={layout_of(args, mesh['cp'].size())} attention={args.attention} "
              f"kv_exchange={args.kv_exchange} capacity={args.capacity} "
              f"params={params:,} vocab={vocab_size} documents={len(docs):,} dtype={str(dtype)[6:]}", flush=True)
    sharder, it, t_last, losses = None, None, time.perf_counter(), {}
    worst = {"loss": 0.0, "grad": 0.0}
    for step in range(start, args.steps):
        batches, it = step_batches(loader, it, args.micro_batches)
        # the step's targets over every CP rank, counted on the worker (max: a step of pad only trains nothing)
        n_targets = max(sum(batch.info["n_targets"] for batch in batches), 1)
        stats = torch.zeros(3, dtype=torch.float64)  # loss, reference loss, real tokens per CP rank
        for batch in batches:
            verify_layout_consistency(batch, mesh)  # a check: one 16-byte all-reduce over the CP group
            sharder = sharder or ContextParallelSharder(None, mesh, batch)  # resolved once, from the first batch
            loss, local = forward_backward(model, batch, sharder, cp_group, n_targets)
            stats[0] += loss.item()
            stats[2] += batch.info["real_tokens"] / mesh["cp"].size()
            if args.check_parity:  # now, while the sharder holds this batch's layout
                stats[1] += reference_forward_backward(models["reference"], local, sharder, n_targets)
        all_reduce_grads(model, dp_size)  # once per optimizer step
        if args.check_parity:
            all_reduce_grads(models["reference"], world)
            worst["grad"] = max(worst["grad"], relative_difference(
                [p.grad for p in model.parameters()], [p.grad for p in models["reference"].parameters()]))
        for opt in opts.values():
            opt.step()
            opt.zero_grad(set_to_none=True)
        dist.all_reduce(stats)
        loss_value, now = stats[0].item() / dp_size, time.perf_counter()
        losses[step + 1] = loss_value
        if args.check_parity:
            reference_loss = stats[1].item() / world
            worst["loss"] = max(worst["loss"], abs(loss_value - reference_loss) / abs(reference_loss))
        if rank0:
            real, slots = (sum(b.info[k] for b in batches) for k in ("real_tokens", "pack_tokens"))
            work = np.sum([b.info["causal_work"] for b in batches], axis=0)  # each rank's, summed over the step
            print(f"step {step + 1:4d} | loss {loss_value:.6f} | tok/s {stats[2].item() / (now - t_last):9,.0f} | "
                  f"pad {1 - real / slots:6.1%} | imbalance {work.max() / max(work.mean(), 1e-9):.3f} | "
                  f"docs {sum(b.info['n_documents'] for b in batches):3d} | micro-batches {len(batches)}",
                  flush=True)  # fmt: skip
        t_last = now
        if args.save_every and (step + 1) % args.save_every == 0:  # between steps: the loader is past the step
            state = {k: m.state_dict() for k, m in models.items()}
            state.update({f"{k}_opt": o.state_dict() for k, o in opts.items()})
            state.update(loader=loader.state_dict(), step=step + 1)
            path = checkpoint_path(args, step + 1)
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(state, path)
    ok, parity = None, None
    if args.check_parity:
        parity = {**worst, "weight": relative_difference(model.parameters(), models["reference"].parameters())}
        ok = parity["loss"] <= 1e-6 and parity["grad"] <= 1e-6 and parity["weight"] <= 1e-5
        if rank0:
            print(f"parity {'OK' if ok else 'FAILED'}: max relative loss difference {parity['loss']:.2e} (tol 1e-6), "
                  f"gradient difference {parity['grad']:.2e} (tol 1e-6), "
                  f"weight difference {parity['weight']:.2e} (tol 1e-5)", flush=True)
    return {"losses": losses, "parity_ok": ok, "parity": parity}


def main(argv=None) -> int:
    result = train(parse_args(argv))
    dist.barrier()
    dist.destroy_process_group()
    return 1 if result["parity_ok"] is False else 0


if __name__ == "__main__":
    code = main()
    # torch's gloo backend can abort in a static destructor at interpreter exit ("terminate called without an
    # active exception", ~1 run in 30 with torch 2.13 on CPU, with or without cpdata) after the process group
    # was destroyed cleanly; the run's work is done and its output flushed, so leave without those destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
