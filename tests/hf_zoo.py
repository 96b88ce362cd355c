"""Tiny random transformers models of the families cpdata's "cpdata" attention is tested on, and the reference.

Each family is built from its config (no download), float64, with weights
large enough (``initializer_range=0.2``) that every variant moves the result
far beyond the tolerance: a window of 6 keys in documents up to 40 tokens,
Gemma 2's logit softcap set to 0.5, gpt-oss' sinks. The reference runs every
document of a pack ALONE through the same weights with HF's own attention
(sdpa, or eager where the class has no sdpa: its own masks, softcap, sinks): the loss is the sum of the
documents' target cross-entropies over the pack's target count, and its
gradient, parameter by parameter.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch

from cpdata.bench.hf_reference import documents_alone, model_grads

VOCAB, WINDOW = 64, 6
LENS = [5, 23, 9, 40, 3, 17, 30, 11, 2, 26, 14, 7]
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, attention_dropout=0.0)  # fmt: skip


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**_COMMON))


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(**_COMMON, sliding_window=WINDOW))


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**_COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    return Qwen2ForCausalLM(cfg)


def _gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(**_COMMON, head_dim=8, sliding_window=WINDOW, attn_logit_softcapping=0.5,
                       query_pre_attn_scalar=8)  # fmt: skip
    return Gemma2ForCausalLM(cfg)


def _gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(**{**_COMMON, "num_hidden_layers": 3}, head_dim=8, sliding_window=WINDOW,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention"])  # fmt: skip
    return Gemma3ForCausalLM(cfg)


def _gpt_oss():
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(**_COMMON, head_dim=8, sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2,
                       experts_implementation="eager")  # fmt: skip  (grouped_mm has no float64 kernel)
    return GptOssForCausalLM(cfg)


FAMILIES: dict[str, Callable[[], torch.nn.Module]] = {
    "llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "gemma2": _gemma2, "gemma3": _gemma3,
    "gpt_oss": _gpt_oss,
}  # fmt: skip
SLIDING = ("mistral", "qwen2", "gemma2", "gemma3", "gpt_oss")


def build(family: str, attn_implementation: str) -> torch.nn.Module:
    """The family's tiny model, seeded (the same weights on every rank), float64, eval (no dropout)."""
    torch.manual_seed(0)
    model = FAMILIES[family]().double().eval()
    model.config._attn_implementation = attn_implementation
    return model


def docs(lens=LENS) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(1, VOCAB, (n,), generator=g).tolist()} for n in lens]


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return model_grads(model)


def alone_reference(model: torch.nn.Module, full: Mapping[str, torch.Tensor]) -> tuple[float, dict, int]:
    """``(loss, grads, documents)``: every document of the pack ``full`` (flat ``[T]`` tensors) alone, through HF's
    own attention (:func:`cpdata.bench.hf_reference.documents_alone`: sdpa where the class has it, float64
    throughout, else eager: Gemma 2, gpt-oss' softcap and sinks). HF computes the loss in float32."""
    return documents_alone(model, full)


def error_against_alone(family: str, full: Mapping[str, torch.Tensor], loss: float, grad: Mapping, cache: dict
                        ) -> tuple[float, int]:  # fmt: skip
    """``(max_rel_error, documents)`` of a packed run of ``family`` on the pack ``full`` against its documents
    alone (:func:`alone_reference`, memoized in ``cache`` per family and pack)."""
    key = (family, tuple(full["input_ids"].tolist()), tuple(full["padding_mask"].tolist()))
    if key not in cache:
        cache[key] = alone_reference(build(family, "eager"), full)
    ref_loss, ref_grad, n_docs = cache[key]
    return max_rel_error(loss, grad, ref_loss, ref_grad), n_docs


def max_rel_error(loss: float, grad: Mapping[str, torch.Tensor], ref_loss: float, ref_grad: Mapping) -> float:
    """Largest relative error of the loss and of each parameter's gradient (norm of the difference / norm)."""
    errs = [abs(loss - ref_loss) / abs(ref_loss)]
    for name, g in ref_grad.items():
        scale = g.norm().item()
        diff = (grad[name] - g).norm().item()
        errs.append(diff / scale if scale > 0 else diff)
    if not all(math.isfinite(e) for e in errs):
        raise AssertionError(f"non-finite figures: loss {loss} vs {ref_loss}")
    return max(errs)
