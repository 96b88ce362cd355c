"""A layer's attention dropout reaches the "cpdata" attention's kernel in training, and only there.

transformers hands each attention call ``dropout=attention_dropout`` in train mode and 0 in eval. The
reference is HF's own ``sdpa`` attention on the same packed batch (cpdata's document mask as its
``attention_mask``), run from the same RNG seed: both draw their dropout inside torch's SDPA kernel over
the same ``[B, H, L, S]`` probabilities, so with the mask equal the losses are equal, dropout included.
"""

from __future__ import annotations

import copy

import torch

from cpdata.adapters import hf_model_kwargs, register_hf_attention
from tests.hf_zoo import build
from tests.test_hf_attention import _packs

register_hf_attention()
DROPOUT = 0.5


def _loss(model, batch, impl: str, seed: int) -> float:
    kwargs = hf_model_kwargs(batch, impl, config=model)
    torch.manual_seed(seed)
    return model(**kwargs).loss.item()


def test_train_mode_dropout_applies_and_eval_does_not():
    batch = _packs(n=1)[0][0]
    ours = build("llama", "cpdata")
    for layer in ours.model.layers:
        layer.self_attn.attention_dropout = DROPOUT  # what config.attention_dropout sets at construction
    ref = copy.deepcopy(ours)
    ref.config._attn_implementation = "sdpa"
    clean = _loss(ours, batch, "cpdata", 0)
    for mode in ("train", "eval"):
        ours.train(mode == "train")
        ref.train(mode == "train")
        got = [_loss(ours, batch, "cpdata", seed) for seed in (1, 2)]
        want = [_loss(ref, batch, "sdpa", seed) for seed in (1, 2)]
        print(f"{mode}: cpdata {got}, HF sdpa {want}, no dropout {clean}")
        assert got == want or max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-10, (mode, got, want)
        if mode == "train":  # dropout applied: each seed its own loss, none the clean one
            assert abs(got[0] - got[1]) > 1e-3 and min(abs(g - clean) for g in got) > 1e-3, got
        else:
            assert max(abs(g - clean) for g in got) < 1e-12, got
