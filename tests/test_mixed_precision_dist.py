"""Every CP attention path under bfloat16 at cp 1, 2 and 4 on gloo: each equals cp 1 under the same precision.

Two precisions, as users run them:

- ``autocast``: float32 weights under ``torch.autocast("cpu", torch.bfloat16)`` (TRL's default ``bf16=True``):
  HF's RoPE returns float32 q/k while v is bfloat16, so K and V reach the movers in different dtypes;
- ``bf16``: bfloat16 weights, no autocast.

Paths, on one tiny Llama (tests/hf_zoo.py, float32 master copy) and one pack of several documents
(balanced layout; the same tokens at every cp, checked):

- ``cpdata``: the registered ``"cpdata"`` attention, dense kernel, K/V all-gathered;
- ``cpdata_flex``: the same with the flex kernel (torch's eager flex on CPU: forward only, so loss only);
- ``exchange``: ``"cpdata"`` over batches built with ``kv_exchange=True`` (one all-to-all per layer);
- ``ctx``: HF ``sdpa`` inside the sharder's ctx (its SDPA gathers K/V; the document mask comes as
  ``attention_mask`` over the global keys);
- ``ctx_exchange``: HF ``sdpa`` inside the ctx without a mask from cpdata, over exchange batches (the ctx
  replaces the model's own local mask by its document-causal one and exchanges K/V).

cp 1 is the ``"cpdata"`` dense attention on the whole pack, in the same precision. Tolerance (relative):
loss 2e-3 (half of bfloat16's 2^-8 = 3.9e-3 rounding step; the loss itself is taken in float32 by HF's
``ForCausalLMLoss``), each parameter's gradient 5e-2 (norm of the difference over the norm: the
gradients are bfloat16 tensors summed over ranks in a different order than at cp 1, a few roundings per
layer). Not vacuous: the same model at cp 2 with each rank attending its own tokens only (the bug a
missing CP attention makes) is off by more than the loss tolerance.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from cpdata.adapters import hf_model_kwargs, register_hf_attention
from cpdata.adapters.hf_attention import STATE_KEY
from cpdata.device.batch_context import AttentionContextFactory
from cpdata.device.kv_exchange import move_keys_values
from cpdata.nodes.loader import shard_graph
from cpdata.nodes.shard import ShardForRank
from tests import hf_zoo
from tests.dist_utils import run_ranks
from tests.flat_options import graph_options
from tests.hf_zoo import build, grads
from tests.test_gather_dist import counting_collectives
from tests.test_hf_attention import full_pack

PRECISIONS = ("autocast", "bf16")
PATHS = ("cpdata", "cpdata_flex", "exchange", "ctx", "ctx_exchange")
LOSS_TOL, GRAD_TOL = 2e-3, 5e-2
LAYOUT = "balanced"


def _batches(cp: int, exchange: bool) -> tuple:
    """Every rank's batch of the first pack holding at least three documents (no collective)."""
    graph = shard_graph(hf_zoo.docs(), graph_options(capacity=64, cp_size=cp, layout=LAYOUT, overflow="split"))
    for batches in ShardForRank(graph, cp_size=cp, cp_rank=0, layout=LAYOUT, all_ranks=True, kv_exchange=exchange):
        if batches[0].info["n_documents"] >= 3:
            return batches
    raise AssertionError("no pack with three documents")


def _model(precision: str, impl: str) -> torch.nn.Module:
    model = build("llama", impl).float()  # float32 master weights, the same on every rank
    return model.to(torch.bfloat16) if precision == "bf16" else model


def _precision(precision: str) -> contextlib.AbstractContextManager:
    return torch.autocast("cpu", dtype=torch.bfloat16) if precision == "autocast" else contextlib.nullcontext()


def _not_run() -> contextlib.AbstractContextManager:
    """Kwargs built for "cpdata" that this test runs through an sdpa model on purpose: the guard that a built
    state reaches a "cpdata" layer (``cpdata.adapters.hf_attention``) neither checks nor remembers them."""
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch("cpdata.adapters.hf_attention.check_reaches_cpdata"))
    stack.enter_context(mock.patch("cpdata.adapters.hf_attention.remember"))
    return stack


def _run(path: str, precision: str, cp: int, rank: int, group) -> tuple[float, dict | None, torch.Tensor]:
    """This rank's loss and gradients for one path (gradients None on the forward-only flex path)."""
    exchange = path in ("exchange", "ctx_exchange")
    batches = _batches(cp, exchange)
    batch = batches[rank]
    name = "cpdata_flex" if path == "cpdata_flex" else "cpdata"
    if path.startswith("ctx"):
        model = _model(precision, "sdpa")
        with _not_run():  # the loss arguments and the pack's target count; the state is dropped
            kwargs = hf_model_kwargs(batch, name, group=group)
        kwargs.pop(STATE_KEY)
        ctx = contextlib.nullcontext()
        if cp > 1:
            factory = AttentionContextFactory.of_batch(batch.layout, group, batch)
            ctx = factory(document_mask=True, local_attn_mask="causal")
        with ctx:
            if path == "ctx" or cp == 1:  # cpdata's document mask (over the global keys at cp > 1)
                kwargs = hf_model_kwargs(batch, "sdpa", group=group, config=model,
                                         num_items_in_batch=kwargs.get("num_items_in_batch"))  # fmt: skip
            with _precision(precision):
                loss = model(**kwargs).loss
            loss.backward()
    else:
        model = _model(precision, name)
        grad = torch.enable_grad() if path != "cpdata_flex" else torch.no_grad()
        with grad, _precision(precision):
            loss = model(**hf_model_kwargs(batch, name, group=group)).loss
        if path != "cpdata_flex":
            loss.backward()
    g = grads(model) if path != "cpdata_flex" else None
    return loss.detach().float(), g, full_pack(batches)["input_ids"]


def _summed(loss: torch.Tensor, g: dict | None, cp: int) -> tuple[float, dict | None]:
    """Loss and gradients summed over the CP ranks (float32, one all-reduce), as the optimizer sees them."""
    parts = [loss.reshape(1)] + ([t.float().reshape(-1) for t in g.values()] if g is not None else [])
    flat = torch.cat(parts)
    if cp > 1:
        dist.all_reduce(flat)
    if g is None:
        return flat[0].item(), None
    out, at = {}, 1
    for name, t in g.items():
        out[name], at = flat[at : at + t.numel()].view(t.shape), at + t.numel()
    return flat[0].item(), out


def _rank(rank: int, cp: int) -> list:
    register_hf_attention()
    register_hf_attention("cpdata_flex", kernel="flex")
    group = dist.group.WORLD if cp > 1 else None
    out = []
    for precision in PRECISIONS:
        for path in PATHS:
            loss, g, tokens = _run(path, precision, cp, rank, group)
            out.append((precision, path, *_summed(loss, g, cp), tokens))
    if cp == 2:  # local-only attention at cp 2 (every rank attends its own tokens): what the figures must rule out
        batch = _batches(cp, False)[rank]
        model = _model("autocast", "sdpa")
        with _not_run():
            kwargs = hf_model_kwargs(batch, "cpdata", group=group)
        kwargs.pop(STATE_KEY)
        with _precision("autocast"):
            loss = model(**kwargs).loss
        out.append(("autocast", "local_only", _summed(loss.detach().float(), None, cp)[0], None, None))
        out.append(("autocast", "moved", _moved(batch, group), None, None))
    return out if rank == 0 else []


def _moved(batch, group) -> list:
    """The collectives moving a float32 key and a bfloat16 value under autocast, for each mover."""
    lay = batch.layout
    key = torch.randn(1, 2, lay.local_token_global_indices.numel(), 8, requires_grad=True)
    value = torch.randn(1, 2, key.shape[2], 8, dtype=torch.bfloat16)
    seen = []
    for exchange in (False, True):
        layout = _batches(2, exchange)[dist.get_rank()].layout if exchange else lay
        with counting_collectives() as calls, _precision("autocast"):
            k, v = move_keys_values(key, value, layout, group, exchange=exchange, seq_dim=2)
        seen.append(([(n, [d for d, _ in t]) for n, t in calls], k.dtype, v.dtype))
    return seen


def _rel(a: dict, b: dict) -> float:
    return max(((a[n] - b[n]).norm() / b[n].norm().clamp_min(1e-12)).item() for n in b)


@pytest.fixture(scope="module")
def results() -> dict[int, dict]:
    out = {1: {(p, path): (loss, g, t) for p, path, loss, g, t in _rank(0, 1)}}
    for cp in (2, 4):
        out[cp] = {(p, path): (loss, g, t) for p, path, loss, g, t in run_ranks(_rank, cp, timeout=240)[0]}
    return out


def test_every_path_at_cp_2_and_4_equals_cp_1_in_bfloat16(results):
    print(f"\n{'precision':<9} {'path':<12} {'cp':>2} {'loss':>10} {'dloss vs cp1':>13} {'vs ref':>9} "
          f"{'grad rel':>9}")
    checked = 0
    for precision in PRECISIONS:
        ref_loss, ref_grad, ref_tokens = results[1][(precision, "cpdata")]
        for path in PATHS:
            for cp in (1, 2, 4):
                loss, g, tokens = results[cp][(precision, path)]
                assert torch.equal(tokens, ref_tokens), "the pack differs between cp sizes: not the same batch"
                own = loss - results[1][(precision, path)][0]  # this path at cp 1
                d_loss = abs(loss - ref_loss)
                d_grad = _rel(g, ref_grad) if g is not None else float("nan")
                print(f"{precision:<9} {path:<12} {cp:>2} {loss:>10.6f} {own:>13.2e} {d_loss:>9.2e} {d_grad:>9.2e}")
                assert max(abs(own), d_loss) <= LOSS_TOL * abs(ref_loss), (precision, path, cp, loss, ref_loss)
                assert g is None or d_grad <= GRAD_TOL, (precision, path, cp, d_grad)
                checked += 1
    assert checked == len(PRECISIONS) * len(PATHS) * 3
    gather, exchange = results[2][("autocast", "moved")][0]
    for calls, k_dtype, v_dtype in (gather, exchange):  # one collective each, in the kernel's dtype
        assert len(calls) == 1 and all(d == torch.bfloat16 for d in calls[0][1]), calls
        assert k_dtype == v_dtype == torch.bfloat16
    assert gather[0][0][0] != exchange[0][0][0] == "batch_isend_irecv"
    local_only = results[2][("autocast", "local_only")][0]
    ref = results[1][("autocast", "cpdata")][0]
    print(f"autocast  local-only    2 {local_only:>10.6f} {local_only - ref:>13.2e}")
    assert abs(local_only - ref) > LOSS_TOL * abs(ref), "the tolerance would not catch local-only attention"
