"""GPU check parts around the attention: pinned batches and the H2D overlap, a tiny HF model step, bf16
autocast.

Each returns a dict of figures with ``ok`` and its thresholds (what each checks: docs/benchmarks.md, "GPU
check"). The model steps compare against every document alone through HF's own attention
(:mod:`cpdata.bench.hf_reference`).
"""

from __future__ import annotations

import numpy as np
import torch

from cpdata.adapters import hf_model_kwargs, register_hf_attention
from cpdata.bench.hf_reference import documents_alone, full_pack, model_grads

__all__ = ["autocast_cp2", "copy_overlap", "hf_step", "pinned_batches"]

FP32_TOL, BF16_TOL = 1e-4, 5e-2
STEP_CASES: tuple[tuple[torch.dtype, str, float], ...] = ((torch.float32, "flex", FP32_TOL),
                                                          (torch.bfloat16, "varlen", BF16_TOL))  # fmt: skip


def _docs(n: int = 64, seed: int = 0, vocab: int = 1000, longest: int = 400) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(1, vocab, int(rng.integers(20, longest)))} for _ in range(n)]


def pinned_batches() -> dict:
    from cpdata.nodes.loader import build_loader, closing_loader
    from cpdata.nodes.options import Delivery

    with closing_loader(build_loader(_docs(), capacity=2048, cp_size=2, cp_rank=0, layout="balanced",
                                     delivery=Delivery(pin_memory=True))) as loader:  # fmt: skip
        batch = next(iter(loader))
    pinned = all(t.is_pinned() for t in batch.values()) and batch.layout.gather_index.is_pinned()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        moved = batch.to("cuda", non_blocking=True)
    stream.synchronize()
    same = all(moved[k].is_cuda and torch.equal(moved[k].cpu(), t) for k, t in batch.items())
    return {"pinned": pinned, "copied_unchanged": same, "ok": pinned and same}


def copy_overlap() -> dict:
    host = torch.empty(64 * 1024 * 1024 // 8, dtype=torch.int64).pin_memory()
    x = torch.randn(4096, 4096, device="cuda")
    copy_stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    start, end, copy_start, copy_end = (torch.cuda.Event(enable_timing=True) for _ in range(4))
    start.record()
    for _ in range(8):
        x = x @ x
        x = x / x.norm()
    with torch.cuda.stream(copy_stream):
        copy_start.record(copy_stream)
        host.to("cuda", non_blocking=True)
        copy_end.record(copy_stream)
    end.record()
    torch.cuda.synchronize()
    copy_done, compute_done = start.elapsed_time(copy_end), start.elapsed_time(end)
    return {"copy_ms": copy_start.elapsed_time(copy_end), "copy_done_ms": copy_done, "compute_done_ms": compute_done,
            "ok": copy_done < compute_done}  # fmt: skip


def _model(dtype: torch.dtype, device: str | torch.device) -> torch.nn.Module:
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                        sliding_window=96, attention_dropout=0.0)  # fmt: skip
    return MistralForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def _shards(cp: int, layout: str, exchange: bool) -> tuple:
    from cpdata.bench.distributions import split_graph
    from cpdata.nodes.shard import ShardForRank

    graph = split_graph(_docs(), 1024 * cp, cp, layout)
    for batches in ShardForRank(graph, cp_size=cp, cp_rank=0, layout=layout, all_ranks=True, kv_exchange=exchange):
        if batches[0].info["n_documents"] >= 3:
            return batches
    raise RuntimeError("no pack with three documents")


def _rel_error(loss: float, grads: dict, ref_loss: float, ref_grads: dict) -> float:
    errs = [abs(loss - ref_loss) / abs(ref_loss)]
    errs += [float((grads[n].float() - g.float()).norm() / g.float().norm().clamp_min(1e-30)) for n, g in
             ref_grads.items()]  # fmt: skip
    return max(errs)


def hf_step(device: str = "cuda") -> dict:
    """A compiled ``"cpdata"`` step at cp 1 against the documents alone, per :data:`STEP_CASES`."""
    batches = _shards(1, "identity", False)
    full = full_pack(batches)
    out = {}
    for dtype, kernel, tol in STEP_CASES:
        name = register_hf_attention(f"cpdata_{kernel}", kernel=kernel)
        model = _model(dtype, device)
        ref_loss, ref_grads, n_docs = documents_alone(model, full)
        model.config._attn_implementation = name
        compiled = torch.compile(model)
        loss = compiled(**hf_model_kwargs(batches[0].to(device), name)).loss
        loss.backward()
        err = _rel_error(loss.item(), model_grads(model), ref_loss, ref_grads)
        tag = f"{str(dtype).removeprefix('torch.')}_{kernel}"
        out.update({f"{tag}_max_rel_error": err, f"{tag}_tolerance": tol, f"{tag}_ok": err < tol, "documents": n_docs})
    out["ok"] = all(v for k, v in out.items() if k.endswith("_ok"))
    return out


def _autocast_rank(rank: int, world: int, device: str) -> dict | None:
    import torch.distributed as dist

    register_hf_attention()
    batches = _shards(world, "tiled", True)
    model = _model(torch.float32, device)
    model.config._attn_implementation = "cpdata"
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        loss = model(**hf_model_kwargs(batches[rank].to(device), "cpdata", group=dist.group.WORLD,
                                       config=model)).loss  # fmt: skip
    loss.backward()
    grads = model_grads(model)
    flat = torch.cat([g.reshape(-1).float() for g in grads.values()] + [loss.detach().float().reshape(1)])
    dist.all_reduce(flat)
    if rank:
        return None
    parts = flat[:-1].split([g.numel() for g in grads.values()])
    summed = {n: part.view_as(g).cpu() for (n, g), part in zip(grads.items(), parts, strict=True)}
    return {"loss": flat[-1].item(), "grads": summed, "full": full_pack(batches)}


def autocast_cp2(device: str = "cuda") -> dict:
    """cp 2 under bf16 autocast (the ``"cpdata"`` attention's auto kernel: varlen on CUDA) against cp 1."""
    from cpdata.bench.ranks import run_on_ranks

    gpus = torch.cuda.device_count()
    backend = "nccl" if gpus >= 2 else "gloo"
    cp2 = run_on_ranks(_autocast_rank, 2, device, timeout=300, backend=backend, start_method="spawn")[0]
    model = _model(torch.float32, device)
    ref_loss, ref_grads, n_docs = documents_alone(model, cp2["full"], autocast=torch.bfloat16)
    err = _rel_error(cp2["loss"], cp2["grads"], ref_loss, {n: g.cpu() for n, g in ref_grads.items()})
    return {"backend": backend, "ranks_on": device if device != "cuda" else "two GPUs" if gpus >= 2 else "GPU 0",
            "max_rel_error": err, "tolerance": BF16_TOL, "documents": n_docs, "ok": err < BF16_TOL}  # fmt: skip
