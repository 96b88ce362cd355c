"""A small causal transformer whose attention runs under any cpdata layout.

Each CP rank holds ``S_loc = S / cp`` tokens of a pack in whatever order the
layout chose. Attention needs three facts, and cpdata supplies all of them:

* queries stay local; keys and values of every rank are gathered into global
  order with ``cpdata.gather.gather_token_tensor`` (one collective per layer,
  K and V stacked);
* the causal document mask is ``cpdata.adapters.document_causal_mask``: a
  query sees the keys of its own document slot up to its global position (the
  layout's ``local_token_global_indices``), slot bounds from the batch's
  global ``cu_seqlens_padded``, so it costs no collective;
* rotary position ids come from the batch (they restart per document);
* the loss is ``cpdata.adapters.token_loss`` (see ``train_cp.py``).

Nothing here knows a layout's name. With ``TokenView.full()`` the same model
runs on a whole pack without a process group (the parity reference).

Cost per layer and rank: ``O(S_loc · S · d)`` attention against the full key
set, so compute divides by ``cp`` while memory for K/V does not (all-gather
attention, the trade-off ring attention avoids).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cpdata.adapters import document_causal_mask
from cpdata.gather import gather_token_tensor
from cpdata.layout.shard_layout import ShardLayout

__all__ = ["ModelConfig", "TokenView", "CPTransformer"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """Shape of the model; the defaults are the demo's (~0.4 M parameters)."""

    vocab_size: int = 257
    """Byte vocabulary (256) plus one padding token."""
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 384
    rope_base: float = 10_000.0


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenView:
    """Where this rank's tokens sit in the pack and how to see every rank's tokens."""

    layout: ShardLayout | None
    """The batch's layout (global position of each local token); None for a whole pack on one rank."""
    gather: Callable[[torch.Tensor], torch.Tensor]
    """``[B, S_loc, ...] -> [B, S, ...]`` in global order; differentiable."""

    @classmethod
    def from_layout(cls, layout: ShardLayout, group=None) -> TokenView:
        """A view of one CP rank's shard; ``gather`` is one collective on ``group``.

        The layout's index tensors may stay on the host: they are copied to the
        compute device once per batch (``layout_tensor_on`` caches them).
        """
        return cls(layout=layout, gather=lambda t: gather_token_tensor(t, layout, group=group, seq_dim=1))

    @classmethod
    def full(cls) -> TokenView:
        """The whole pack on one rank: every token is local, gathering is the identity."""
        return cls(layout=None, gather=lambda t: t)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, S, H, hd]`` by per-token angles ``[B, S, 1, hd/2]`` (half-split)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.out = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor,
                view: TokenView) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.n_heads, d // self.n_heads).unbind(2)
        q, k = _rope(q, *rope), _rope(k, *rope)  # rotate locally: positions are this rank's
        k, v = view.gather(torch.stack([k, v], dim=2)).unbind(2)  # [B, S, H, hd] each, global order
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(b, s, d))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_ff), nn.GELU(), nn.Linear(cfg.d_ff, cfg.d_model))

    def forward(self, x, rope, mask, view):
        x = x + self.attn(self.norm1(x), rope, mask, view)
        return x + self.mlp(self.norm2(x))


class CPTransformer(nn.Module):
    """Pre-norm decoder with rotary positions; parameters are replicated on every rank."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.d_model % cfg.n_heads or (cfg.d_model // cfg.n_heads) % 2:
            raise ValueError(f"d_model={cfg.d_model} must split into n_heads={cfg.n_heads} heads of even size")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        half = cfg.d_model // cfg.n_heads // 2
        inv_freq = cfg.rope_base ** (-torch.arange(half, dtype=torch.float64) / half)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, document_ids: torch.Tensor,
                cu_seqlens_padded: torch.Tensor, view: TokenView) -> torch.Tensor:
        """Logits ``[B, S_loc, vocab]`` for this rank's tokens (token inputs ``[B, S_loc]``, int64;
        ``cu_seqlens_padded`` the batch's global slot offsets)."""
        x = self.embed(input_ids)
        # Angles in float64: position ids of split documents can exceed 1e5.
        angles = (position_ids.to(torch.float64)[..., None] * self.inv_freq)[:, :, None, :]
        rope = (angles.cos().to(x.dtype), angles.sin().to(x.dtype))
        mask = document_causal_mask(view.layout, document_ids, cu_seqlens_padded)  # no collective
        for block in self.blocks:
            x = block(x, rope, mask, view)
        return self.head(self.norm(x))

