"""A small causal transformer whose attention runs under any cpdata layout.

Each CP rank holds ``S_loc = S / cp`` tokens of a pack in whatever order the
layout chose. Attention needs three facts, and cpdata supplies all of them:

* queries stay local; keys and values of every rank are gathered into global
  order with ``cpdata.gather.gather_token_tensor`` (one collective per layer,
  K and V stacked);
* the causal document mask compares global positions: the layout's
  ``local_token_global_indices`` for queries, ``arange(S)`` for gathered keys,
  and document ids gathered once per forward;
* rotary position ids come from the batch (they restart per document).

Nothing here knows a layout's name. With ``TokenView.full(S)`` the same model
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

from cpdata.gather import gather_token_tensor, layout_tensor_on
from cpdata.shard_layout import ShardLayout

__all__ = ["ModelConfig", "TokenView", "CPTransformer", "document_causal_mask", "local_token_loss"]


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

    query_positions: torch.Tensor
    """int64 ``[S_loc]``: global pack position of each local token."""
    gather: Callable[[torch.Tensor], torch.Tensor]
    """``[B, S_loc, ...] -> [B, S, ...]`` in global order; differentiable."""

    @classmethod
    def from_layout(cls, layout: ShardLayout, group=None, device: torch.device | str | None = None) -> TokenView:
        """A view of one CP rank's shard; ``gather`` is one collective on ``group``.

        The layout's index tensors may stay on the host: they are copied to the
        compute device once per batch (``layout_tensor_on`` caches them).
        """
        return cls(
            query_positions=(layout.local_token_global_indices if device is None
                             else layout_tensor_on(layout, "local_token_global_indices", device)),
            gather=lambda t: gather_token_tensor(t, layout, group=group, seq_dim=1),
        )

    @classmethod
    def full(cls, seq_len: int, device: torch.device | str = "cpu") -> TokenView:
        """The whole pack on one rank: every token is local, gathering is the identity."""
        return cls(query_positions=torch.arange(seq_len, device=device), gather=lambda t: t)


def document_causal_mask(view: TokenView, document_ids: torch.Tensor) -> torch.Tensor:
    """Boolean ``[B, 1, S_loc, S]`` mask (True = attend) for local queries over global keys.

    A query attends to keys of its own document at global positions not after
    its own. Pads carry their slot's document id and sit after its real
    tokens, so real queries never see them and every row keeps its diagonal.
    """
    doc_k = view.gather(document_ids)  # [B, S]: one collective, once per forward
    k_pos = torch.arange(doc_k.shape[1], device=doc_k.device)
    same_doc = document_ids[:, :, None] == doc_k[:, None, :]
    causal = k_pos[None, None, :] <= view.query_positions[None, :, None]
    return (same_doc & causal)[:, None]


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
                view: TokenView) -> torch.Tensor:
        """Logits ``[B, S_loc, vocab]`` for this rank's tokens (all inputs ``[B, S_loc]``, int64)."""
        x = self.embed(input_ids)
        # Angles in float64: position ids of split documents can exceed 1e5.
        angles = (position_ids.to(torch.float64)[..., None] * self.inv_freq)[:, :, None, :]
        rope = (angles.cos().to(x.dtype), angles.sin().to(x.dtype))
        mask = document_causal_mask(view, document_ids)
        for block in self.blocks:
            x = block(x, rope, mask, view)
        return self.head(self.norm(x))


def local_token_loss(logits: torch.Tensor, labels: torch.Tensor, global_targets: int | torch.Tensor
                     ) -> torch.Tensor:
    """Summed cross-entropy of this rank's targets divided by the pack's target count.

    Labels equal to -100 are ignored. Summing this over the CP ranks of a group
    gives the single-rank mean loss over the whole pack.
    """
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    return ce / global_targets
