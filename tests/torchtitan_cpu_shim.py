"""Test-side shim of torchtitan 0.3.0's GPU assumptions, so that it trains on CPU over gloo.

Not part of cpdata: the torchtitan tests apply it in each rank (``apply()``
before the first ``import torchtitan``) and edit nothing in the wheel. Each
patch names the one assumption it lifts:

1. device: torchtitan takes ``_get_available_device_type() or "cuda"``; with
   no accelerator the device is ``"cpu"``, and ``torch.cpu`` gains the few
   device-module calls torchtitan's memory monitor and seeding make (a name,
   a capacity of the host's RAM, empty memory statistics, seeds).
2. triton: ``torchtitan.distributed.minimal_async_ep.kernels`` (expert-parallel
   kernels, imported by the trainer, never called by a dense model) imports
   ``triton``; it is replaced by a module whose kernels raise if called.
3. timeouts: after the first step torchtitan's ``set_pg_timeouts`` calls
   ``torch.distributed.set_timeout`` (absent from torch 2.13) after a barrier
   on the accelerator's device id (gloo takes none); it becomes a no-op and
   timeouts stay at the process group's default.
4. flex attention: torchtitan compiles ``flex_attention`` and
   ``create_block_mask``; compiled flex backward fails on CPU and eager flex
   refuses CPU backward. ``create_block_mask`` runs eager and the kernel call
   is :func:`flex_reference`, an exact dense reference of flex's semantics
   behind the same call: keys in *full* blocks attend, keys in *partial*
   blocks attend where ``mask_mod`` says so, every other block is masked
   (so a wrong block table fails the tests as it would fail the kernel);
   then SDPA's math with that mask (differentiable).
5. FSDP's gradient reduce-scatter uses plain ``SUM`` (torchtitan sets the
   divide factor to 1, which FSDP turns into ``PREMUL_SUM(1.0)``, an op gloo
   rejects); a sum is the same value.
"""

from __future__ import annotations

import sys
import types

__all__ = ["apply"]

_applied = False


def _raise(name: str):
    def kernel(*args, **kwargs):
        raise RuntimeError(f"{name} is a triton kernel, stubbed by the CPU test shim")

    return kernel


def _stub_attribute(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _raise(name)


def _complete_cpu_module(cpu: types.ModuleType) -> None:
    import os

    import torch

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    extra = {
        "get_device_name": lambda device=None: "cpu",
        "get_device_properties": lambda device=None: types.SimpleNamespace(total_memory=ram, name="cpu"),
        "memory_stats": lambda device=None: {},
        "reset_peak_memory_stats": lambda device=None: None,
        "empty_cache": lambda: None,
        "manual_seed": torch.manual_seed,
        "manual_seed_all": torch.manual_seed,
    }
    for name, value in extra.items():
        if not hasattr(cpu, name):
            setattr(cpu, name, value)


def _dense_blocks(num_blocks, indices, q_len: int, kv_len: int, block: tuple[int, int]):
    """Bool ``[B, H, q_len, kv_len]``: the tokens of the blocks a (num_blocks, indices) table lists."""
    from torch.nn.attention.flex_attention import _ordered_to_dense

    dense = _ordered_to_dense(num_blocks, indices, indices.shape[-1]).bool()
    dense = dense.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return dense[..., :q_len, :kv_len]


def flex_reference(q, k, v, *, score_mod=None, block_mask=None, scale=None, enable_gqa=False, return_aux=None,
                   kernel_options=None):  # fmt: skip
    """``flex_attention(q, k, v, block_mask=...)`` evaluated densely (see patch 4 in the module docstring)."""
    import torch
    from torch.nn.attention.flex_attention import AuxOutput

    if score_mod is not None:
        raise NotImplementedError("flex_reference covers mask_mod only (no score_mod)")
    batch, _, q_len, _ = q.shape
    kv_len = k.shape[-2]
    device = q.device
    b = torch.arange(batch, device=device)[:, None, None, None]
    h = torch.zeros(1, 1, 1, 1, dtype=torch.int64, device=device)
    q_idx = torch.arange(q_len, device=device)[None, None, :, None]
    kv_idx = torch.arange(kv_len, device=device)[None, None, None, :]
    block = block_mask.BLOCK_SIZE
    partial = _dense_blocks(block_mask.kv_num_blocks, block_mask.kv_indices, q_len, kv_len, block)
    keep = partial & block_mask.mask_mod(b, h, q_idx, kv_idx)
    if block_mask.full_kv_num_blocks is not None:
        keep = keep | _dense_blocks(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, q_len, kv_len, block)
    if enable_gqa and k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.softmax(scores, dim=-1), v)
    want_lse = return_aux is not None and return_aux.lse
    return out, AuxOutput(lse=lse if want_lse else None)


def apply() -> None:
    """Install the five patches (idempotent). Call before importing torchtitan."""
    global _applied
    if _applied:
        return
    import torch
    import torch._utils

    if torch._utils._get_available_device_type() is None:
        torch._utils._get_available_device_type = lambda: "cpu"
        _complete_cpu_module(torch.cpu)

    stub = types.ModuleType("torchtitan.distributed.minimal_async_ep.kernels")
    stub.__getattr__ = _stub_attribute  # type: ignore[method-assign]
    sys.modules[stub.__name__] = stub

    from torchtitan.distributed import utils as dist_utils

    dist_utils.set_pg_timeouts = lambda timeout, parallel_dims: None

    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    divide_factors = _fsdp_collectives._get_gradient_divide_factors

    def sum_only(reduce_scatter_group, all_reduce_group, reduce_dtype, device_type="", factor=None,
                 force_sum_reduction_for_comms=False):  # fmt: skip
        return divide_factors(reduce_scatter_group, all_reduce_group, reduce_dtype, device_type, factor, True)

    _fsdp_collectives._get_gradient_divide_factors = sum_only

    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.models.common import attention

    attention.FlexAttention._compiled_flex_attn = flex_reference
    attention._compiled_create_block_mask = create_block_mask
    _applied = True
