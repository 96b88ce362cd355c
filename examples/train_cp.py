"""Train a small causal transformer with context parallelism, fed by cpdata.

    torchrun --standalone --nproc-per-node 2 examples/train_cp.py
    torchrun --standalone --nproc-per-node 4 examples/train_cp.py --dp-size 2 --cp-size 2

Every rank builds the cpdata pipeline for its own (DP rank, CP rank): sources
are sharded by DP rank, and the CP ranks of one DP group run the same plan on
the same documents, so they agree on every pack without communicating (checked
each step by ``verify_layout_consistency``). The model sees only its rank's
tokens plus the batch's ``ShardLayout`` (see ``cp_model.py``).

Gradient scaling. Each rank's loss (``cpdata.adapters.token_loss``) is the
cross-entropy summed over its LOCAL targets divided by the pack's GLOBAL target
count (``global_target_count``: one all-reduce), so the CP ranks' losses sum
to the single-rank loss L. Backward of the K/V gather is a reduce-scatter
(sum): rank r's gathered-K/V gradient, d(loss_r)/dKV, is summed over ranks and
scattered, so rank r' receives sum_r d(loss_r)/dKV_r' = dL/dKV_r' -- the exact
gradient of L with respect to its local K/V. Rank r's parameter gradient is
therefore the part of dL/dθ that flows through its own tokens, and the sum over
the CP group is exactly dL/dθ. One all-reduce (SUM) over all ranks divided by
dp_size gives that sum, averaged over DP groups. (A loss replicated on every
CP rank, e.g. computed from gathered logits, would make that sum cp x dL/dθ.)

Imbalance. Each step prints the busiest CP rank's live attention tiles over
the ideal (``--tile`` x ``--tile``, 128 by default: the blocks flash / flex
kernels compute whole), the ideal being the pack's tiles at cp 1 divided by
cp (``cpdata.layout.tiles``). 1.000 is perfect; token-pair balance is not
what such a kernel pays (``docs/layouts-and-kernels.md``). The default
layout, ``tiled``, balances exactly this count (whole tile-token blocks per
rank, so the capacity must be a multiple of cp x tile).

``--check-parity`` trains a reference copy on the full pack (recovered by
gathering the batch tensors) with no CP, and compares per-step losses
(absolute), gradients and final weights (relative) within 1e-5; the job exits
non-zero otherwise. Both run in float64: they then differ only by summation
order (~1e-15), whereas in float32 Adam amplifies rounding differences over a
few dozen steps. Gradients are compared directly because Adam normalizes away
a wrong gradient scale (a 2x error moves the weights by only ~1e-4).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from corpus import BYTE_VOCAB, PAD_ID, StdlibDefinitions, load_jsonl  # noqa: E402
from cp_model import CPTransformer, ModelConfig, TokenView  # noqa: E402

from cpdata.adapters import global_target_count, token_loss  # noqa: E402
from cpdata.device.consistency import verify_layout_consistency  # noqa: E402
from cpdata.layout.maps import layout_spec  # noqa: E402
from cpdata.layout.tiles import live_tiles  # noqa: E402
from cpdata.nemo.sharder import ContextParallelSharder  # noqa: E402
from cpdata.nodes.loader import build_loader, close_loader  # noqa: E402
from cpdata.nodes.options import DataPolicy, SchedulePlan  # noqa: E402
from cpdata.offline.store import read_store  # noqa: E402
from cpdata.recipes import balanced_allgather, precomputed  # noqa: E402

TOKEN_KEYS = ("input_ids", "labels", "position_ids", "document_ids")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dp-size", type=int, default=1)
    p.add_argument("--cp-size", type=int, default=None, help="default: world size / dp size")
    p.add_argument("--layout", default=None, help="CP layout (default tiled, or a precomputed plan's), "
                   "or a comma-separated list trained one after another")
    p.add_argument("--capacity", type=int, default=4096, help="tokens per pack (before CP sharding)")
    p.add_argument("--tile", type=int, default=128, help="attention tile the printed imbalance counts (and the "
                   "tile of --layout tiled: 64, 128 or 256; packs are then multiples of cp x tile)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--data", default=None, help="JSONL file or `cpdata precompute` directory (default: stdlib)")
    p.add_argument("--documents", default=None, help="token source of a precomputed --data directory")
    p.add_argument("--schedule", choices=("none", "balanced", "in_order"), default="none",
                   help="plan every document's length first: equal steps per DP rank, cost-balanced packs, "
                        "each rank reads only its own documents (default none: each DP rank packs i %% dp_size)")
    p.add_argument("--check-parity", action="store_true", help="compare with a cp_size=1 reference (float64)")
    p.add_argument("--summary-json", default=None, help="with several layouts, must contain '{layout}'")
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--ckpt-dir", default="checkpoints")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def setup(args):
    """Process group, (dp, cp) mesh and this rank's coordinates."""
    if args.device.startswith("cuda"):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
    world = dist.get_world_size()
    cp = args.cp_size or world // args.dp_size
    if args.dp_size * cp != world:
        raise ValueError(f"--dp-size {args.dp_size} x --cp-size {cp} must equal the world size {world}")
    mesh = init_device_mesh(args.device.split(":")[0], (args.dp_size, cp), mesh_dim_names=("dp", "cp"))
    return mesh, mesh["dp"].get_local_rank(), mesh["cp"].get_local_rank(), mesh["cp"].get_group()


def make_loader(args, layout: str, cp_size: int, cp_rank: int, dp_rank: int):
    common = dict(cp_size=cp_size, cp_rank=cp_rank, padding_token_id=PAD_ID)
    data = DataPolicy(dp_rank=dp_rank, dp_size=args.dp_size, seed=args.seed, vocab_size=BYTE_VOCAB)
    if args.data and Path(args.data).is_dir():  # capacity, layout and order come from the plan's manifest
        return precomputed.build(args.data, args.documents, layout=layout,
                                 data=DataPolicy(dp_rank=dp_rank, dp_size=args.dp_size, vocab_size=BYTE_VOCAB),
                                 **common)  # fmt: skip
    source = load_jsonl(args.data) if args.data else StdlibDefinitions()
    if args.schedule != "none":  # the recipe's pipeline, planned globally from the lengths
        lengths = getattr(source, "lengths", None)
        if lengths is None:
            lengths = np.array([len(d["input_ids"]) for d in source], dtype=np.int64)
        return build_loader(source, capacity=args.capacity, cp_size=cp_size, cp_rank=cp_rank, layout=layout,
                            qkv_format="bshd", padding_token_id=PAD_ID,
                            plan=SchedulePlan(kind=args.schedule, lengths=lengths, overflow="split"),
                            data=data)  # fmt: skip
    return balanced_allgather.build(source, capacity=args.capacity, layout=layout, data=data, **common)


def tile_imbalance(batch, cp_group, tile: int) -> float:
    """Busiest CP rank's live ``tile x tile`` attention tiles over the pack's tiles at cp 1 / cp.

    Each rank counts its own queries (its row, local order) against the global keys of the batch's
    document-causal mask; one MAX all-reduce over the CP group.
    """
    layout = batch.layout
    stream = layout.padded_seq_len
    slots = np.diff(batch["cu_seqlens_padded"].numpy().astype(np.int64))
    row = layout.local_token_global_indices.numpy()[None]
    mine = torch.tensor([float(live_tiles(row, slots, stream, tile)[0])], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=cp_group)
    ideal = float(live_tiles(np.arange(stream)[None], slots, stream, tile)[0]) / layout.cp_size
    return mine.item() / ideal if ideal else 1.0


def describe_stdlib() -> str:
    corpus = StdlibDefinitions()
    return f"stdlib ({len(corpus):,} definitions from {len(corpus.files):,} .py files)"


def all_reduce_grads(model: torch.nn.Module, divisor: int) -> None:
    """Sum every gradient over all ranks in one flat all-reduce, then divide."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= divisor
    for g, chunk in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(chunk.view_as(g))


def train_step(model, opt, tensors, view, n_targets, divisor) -> torch.Tensor:
    logits = model(tensors["input_ids"], tensors["position_ids"], tensors["document_ids"],
                   tensors["cu_seqlens_padded"], view)
    loss = token_loss(logits, tensors, num_targets=n_targets)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    all_reduce_grads(model, divisor)
    opt.step()
    return loss.detach()


def relative_diff(model, reference, attr: str) -> float:
    """Largest ``|a - b| / |b|`` (L2 norms) over parameters, of ``.data`` or ``.grad``."""
    return max(((getattr(a, attr) - getattr(b, attr)).norm() / getattr(b, attr).norm().clamp_min(1e-30)).item()
               for a, b in zip(model.parameters(), reference.parameters(), strict=True))


def checkpoint_path(args, layout: str, step: int) -> Path:
    return Path(args.ckpt_dir) / layout / f"step_{step:06d}" / f"rank{dist.get_rank()}.pt"


def latest_checkpoint(args, layout: str) -> Path | None:
    steps = sorted(Path(args.ckpt_dir, layout).glob(f"step_*/rank{dist.get_rank()}.pt"))
    return steps[-1] if steps else None


def run_layout(args, layout: str, mesh, dp_rank: int, cp_rank: int, cp_group) -> tuple[dict, bool]:
    """Train ``args.steps`` steps under ``layout``; return the summary and whether parity held."""
    cp_size, world, rank0 = mesh["cp"].size(), dist.get_world_size(), dist.get_rank() == 0
    device = torch.device(args.device)
    dtype = torch.float64 if args.check_parity else torch.float32
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    cfg = ModelConfig(d_model=args.d_model, n_layers=args.layers, n_heads=max(1, args.d_model // 32),
                      d_ff=3 * args.d_model)
    model = CPTransformer(cfg).to(device=device, dtype=dtype)
    models = {"model": model, "reference": copy.deepcopy(model)} if args.check_parity else {"model": model}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=args.lr, weight_decay=0.01) for k, m in models.items()}
    loader = make_loader(args, layout, cp_size, cp_rank, dp_rank)
    start = 0
    if args.resume and (ckpt := latest_checkpoint(args, layout)) is not None:
        state = torch.load(ckpt, map_location=device, weights_only=False)
        for k in models:
            models[k].load_state_dict(state[k])
            opts[k].load_state_dict(state[f"{k}_opt"])
        loader.load_state_dict(state["loader"])
        start = state["step"]
        if rank0:
            print(f"resumed from {ckpt.parent} at step {start}")
    elif args.resume and rank0:
        print(f"no checkpoint under {Path(args.ckpt_dir, layout)}; starting at step 0")
    if rank0:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"layout={layout} dp={args.dp_size} cp={cp_size} capacity={args.capacity} device={device} "
              f"dtype={str(dtype).removeprefix('torch.')} params={n_params:,} "
              f"data={args.data or describe_stdlib()}")
        print(f"imbalance = busiest CP rank's live {args.tile}x{args.tile} attention tiles / (the pack's tiles at "
              "cp 1 / cp): what a flash / flex-style kernel computes; 1.000 is ideal")
    it, sharder = iter(loader), None
    totals = torch.zeros(5, dtype=torch.float64)  # real tokens, pack tokens, step s, wait s, steps (after 1st)
    loss_value, max_diff, max_grad_diff, imbalances = float("nan"), 0.0, 0.0, []
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        batch = next(it)
        t_data = time.perf_counter() - t0
        verify_layout_consistency(batch, mesh)  # one 16-byte all-reduce: the CP group holds one plan
        sharder = sharder or ContextParallelSharder(None, mesh, batch)  # resolved once, from the first batch
        ctx, tensors = sharder.shard(batch)  # host-to-device copy only: the workers already sharded it
        n_targets = global_target_count(batch, cp_group, labels=tensors["labels"])  # one all-reduce, no sync
        with ctx():
            view = TokenView.from_layout(sharder.shard_layout, cp_group)
            loss = train_step(model, opts["model"], tensors, view, n_targets, args.dp_size)
        stats = torch.tensor([loss.item(), 0.0, batch.info["real_tokens"] / cp_size,
                              batch.info["pack_tokens"] / cp_size], dtype=torch.float64, device=device)
        if args.check_parity:  # the full pack, recovered from the shards (one gather per tensor)
            full = {k: sharder.gather_token_tensor(tensors[k], seq_dim=1) for k in TOKEN_KEYS}
            full["cu_seqlens_padded"] = tensors["cu_seqlens_padded"]
            ref_view = TokenView.full()
            # the reference's grads are equal on a group's CP ranks: sum over all / world = DP mean
            stats[1] = train_step(models["reference"], opts["reference"], full, ref_view, n_targets, world).item()
            # Adam hides a wrong gradient scale (it normalizes), so compare the gradients themselves too
            max_grad_diff = max(max_grad_diff, relative_diff(model, models["reference"], "grad"))
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.all_reduce(stats)
        t_step = time.perf_counter() - t0
        loss_value = stats[0].item() / args.dp_size
        if args.check_parity:
            max_diff = max(max_diff, abs(loss_value - stats[1].item() / world))
        imbalances.append(tile_imbalance(batch, cp_group, args.tile))
        if step > start:  # the first step includes pipeline start-up
            totals += torch.tensor([stats[2].item(), stats[3].item(), t_step, t_data, 1.0])
        if rank0:
            print(f"step {step + 1:4d} | loss {loss_value:.6f} | tok/s {stats[2].item() / t_step:9,.0f} | "
                  f"data wait {t_data / t_step:6.1%} | pad {1 - stats[2].item() / stats[3].item():6.1%} | "
                  f"imbalance {imbalances[-1]:.3f} | docs {batch.info['n_documents']:3d}", flush=True)
        if args.save_every and (step + 1) % args.save_every == 0:
            state = {k: m.state_dict() for k, m in models.items()}
            state.update({f"{k}_opt": o.state_dict() for k, o in opts.items()})
            state.update(loader=loader.state_dict(), step=step + 1)
            path = checkpoint_path(args, layout, step + 1)
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(state, path)
    close_loader(loader)
    real, pack, t_total, t_wait, _ = totals.tolist()
    summary = {
        "steps": args.steps, "cp_size": cp_size, "layout": layout, "final_loss": loss_value,
        "max_abs_loss_diff": max_diff if args.check_parity else None,
        "tokens_per_s": real / t_total if t_total else None,
        "data_wait_fraction": t_wait / t_total if t_total else None,
        "padding_pct": 100 * (1 - real / pack) if pack else None,
        "imbalance": sum(imbalances) / len(imbalances) if imbalances else None,
    }
    ok = True
    if args.check_parity:
        rel = relative_diff(model, models["reference"], "data")
        ok = max_diff <= 1e-5 and rel <= 1e-5 and max_grad_diff <= 1e-5
        if rank0:
            print(f"parity {'OK' if ok else 'FAILED'}: max |loss - reference| = {max_diff:.2e}, max relative "
                  f"gradient difference = {max_grad_diff:.2e}, relative weight difference = {rel:.2e} (tol 1e-5)")
    return summary, ok


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.data and Path(args.data).is_dir():  # a precomputed plan fixes capacity and layout
        plan = read_store(args.data, verify=False).config
        args.capacity, args.layout = int(plan["capacity"]), args.layout or str(plan["layout"])
    layouts = (args.layout or "tiled").split(",")
    if args.summary_json and len(layouts) > 1 and "{layout}" not in args.summary_json:
        raise ValueError(f"--summary-json {args.summary_json!r} must contain '{{layout}}' with several layouts")
    mesh, dp_rank, cp_rank, cp_group = setup(args)
    ok = True
    for layout in layouts:
        if layout == "tiled" and args.tile != 128:  # the tile joins the layout string ("tiled:256")
            layout = layout_spec(layout, args.tile)
        summary, parity_ok = run_layout(args, layout, mesh, dp_rank, cp_rank, cp_group)
        ok &= parity_ok
        if args.summary_json and dist.get_rank() == 0:
            path = Path(args.summary_json.replace("{layout}", layout))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(summary, indent=2) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    code = main()
    # torch's gloo backend can abort in a static destructor at interpreter exit ("terminate called without an
    # active exception", ~1 run in 30 with torch 2.13 on CPU, with or without cpdata) after the process group
    # was destroyed cleanly; the run's work is done and its output flushed, so leave without those destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
