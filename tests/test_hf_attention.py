"""The "cpdata" transformers attention and hf_model_kwargs' per-layer masks at cp 1, against each document alone.

Six families built from tiny random configs (tests/hf_zoo.py): Llama (control),
Mistral (``sliding_window``), Qwen2 (sliding ``layer_types``), Gemma 2 (softcap +
alternating window), Gemma 3 (alternating), gpt-oss (sinks + alternating
window, MoE). The packed loss and every parameter gradient must equal the
documents run alone through HF's eager attention within 1e-6 relative. HF
computes the loss in float32 (``ForCausalLMLoss`` upcasts the logits), so the
figures sit near 1e-8, not 1e-15.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from cpdata.adapters import hf_model_kwargs, register_hf_attention
from cpdata.adapters.attention_kernels import dense_attention, flex_attention_call
from cpdata.adapters.hf_attention import STATE_KEY
from cpdata.bench.hf_reference import full_pack
from cpdata.nodes.loader import shard_graph
from cpdata.nodes.shard import ShardForRank
from cpdata.worker.keys import IGNORE_INDEX
from tests import hf_zoo
from tests.flat_options import graph_options
from tests.hf_zoo import FAMILIES, SLIDING, alone_reference, build, grads, max_rel_error

register_hf_attention()
register_hf_attention("cpdata_flex", kernel="flex")
_REF: dict[tuple, tuple] = {}


def _packs(cp: int = 1, layout: str = "identity", n: int = 2, **kw) -> list[tuple]:
    """The first ``n`` packs holding at least two documents with targets, every rank's batch (no collective)."""
    graph = shard_graph(hf_zoo.docs(), graph_options(capacity=64, cp_size=cp, layout=layout, overflow="split", **kw))
    out = [b for b in ShardForRank(graph, cp_size=cp, cp_rank=0, layout=layout, all_ranks=True)
           if b[0].info["n_documents"] >= 2]  # fmt: skip
    assert len(out) >= n
    return out[:n]


def _reference(family: str, i: int, batches: tuple) -> tuple:
    key = (family, i, batches[0].info["pack_indices"][0] if batches[0].info["pack_indices"] else i)
    if key not in _REF:
        _REF[key] = alone_reference(build(family, "eager"), full_pack(batches))
    return _REF[key]


def _packed(model, kwargs) -> tuple[float, dict]:
    out = model(**kwargs)
    out.loss.backward()
    return out.loss.item(), grads(model)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_cpdata_attention_equals_each_document_alone(family):
    model = build(family, "cpdata")
    worst, docs = 0.0, 0
    for i, batches in enumerate(_packs()):
        kwargs = hf_model_kwargs(batches[0], "cpdata")
        assert isinstance(kwargs[STATE_KEY], object) and "attention_mask" not in kwargs
        loss, g = _packed(model, kwargs)
        ref_loss, ref_grad, n_docs = _reference(family, i, batches)
        worst, docs = max(worst, max_rel_error(loss, g, ref_loss, ref_grad)), docs + n_docs
    print(f"{family}: cpdata attention, cp 1, max relative error {worst:.1e} over {docs} documents")
    assert worst < 1e-6 and docs >= 4


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_sdpa_and_eager_masks_per_layer_type_are_right_or_refused(family, impl):
    model = build(family, impl)
    batches = _packs(n=1)[0]
    with pytest.raises(ValueError, match=r"config=model.*'cpdata' attention"):  # no config: no guessed windows
        hf_model_kwargs(batches[0], impl)
    if impl == "sdpa" and family in ("gemma2", "gpt_oss"):  # softcap / sinks: SDPA cannot compute them
        with pytest.raises(ValueError, match="softcap|sinks|_supports_sdpa"):
            _packed(model, hf_model_kwargs(batches[0], impl, config=model))
        return
    kwargs = hf_model_kwargs(batches[0], impl, config=model)
    mixed = len(set(getattr(model.config, "layer_types", None) or ["one"])) > 1
    assert isinstance(kwargs["attention_mask"], dict) == mixed
    ref_loss, ref_grad, _ = _reference(family, 0, batches)
    err = max_rel_error(*_packed(model, kwargs), ref_loss, ref_grad)
    assert err < (1e-5 if impl == "eager" else 1e-6), err  # HF's eager takes its softmax in float32
    if family in SLIDING:  # what the refusal above prevents, measurably: the masks of a model without windows
        windowless = build("llama", impl)
        dropped = max_rel_error(*_packed(model, hf_model_kwargs(batches[0], impl, config=windowless)), ref_loss,
                                ref_grad)  # fmt: skip
        print(f"{family} {impl}: {err:.1e} with config=, {dropped:.1e} with the window dropped")
        assert dropped > 1e-4, dropped


def test_flex_kernel_forward_equals_the_dense_one():
    """The flex wiring (BlockMask, softcap score_mod, sinks through the LSE) on CPU: torch's eager flex, no grad."""
    for family in FAMILIES:
        batches = _packs(n=1)[0]
        dense, flex = build(family, "cpdata"), build(family, "cpdata_flex")
        with torch.no_grad():
            a = dense(**hf_model_kwargs(batches[0], "cpdata")).logits
            b = flex(**hf_model_kwargs(batches[0], "cpdata_flex")).logits
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=family)


def test_rows_of_a_bshd_batch_are_one_stream():
    model = build("gemma3", "cpdata")
    batches = _packs(batch_size=2, n=1)[0]
    assert batches[0]["input_ids"].shape == (2, 64)
    loss, g = _packed(model, hf_model_kwargs(batches[0], "cpdata"))
    ref_loss, ref_grad, _ = alone_reference(build("gemma3", "eager"), full_pack(batches))
    assert max_rel_error(loss, g, ref_loss, ref_grad) < 1e-6


def _hf_eager(module_path: str):
    import importlib

    return importlib.import_module(module_path).eager_attention_forward


@pytest.mark.parametrize("variant", ["softcap", "sinks"])
def test_kernels_equal_hf_eager_for_softcap_and_sinks(variant):
    """Both kernels against transformers' own Gemma 2 (softcap) / gpt-oss (sinks) eager attention, GQA."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 10, 8, generator=g, dtype=torch.float64) * 3
    k, v = (torch.randn(1, 2, 10, 8, generator=g, dtype=torch.float64) * 3 for _ in range(2))
    keep = torch.ones(10, 10, dtype=torch.bool).tril()[None, None]
    additive = torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, torch.finfo(torch.float64).min)
    module = torch.nn.Module()
    module.num_key_value_groups, module.head_dim, module.training = 2, 8, False
    if variant == "softcap":
        ref, _ = _hf_eager("transformers.models.gemma2.modeling_gemma2")(module, q, k, v, additive, scaling=0.3,
                                                                          softcap=0.7)  # fmt: skip
        kw = {"softcap": 0.7}
    else:
        module.sinks = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64))
        ref, _ = _hf_eager("transformers.models.gpt_oss.modeling_gpt_oss")(module, q, k, v, additive, scaling=0.3)
        kw = {"sinks": module.sinks}
    ref = ref.transpose(1, 2)
    torch.testing.assert_close(dense_attention(q, k, v, keep, scale=0.3, **kw), ref, rtol=1e-6, atol=1e-7)
    from cpdata.device.attention_masks import block_mask

    bm = block_mask(torch.zeros(1, 10, dtype=torch.int64), torch.arange(10)[None], 10)
    with torch.no_grad():
        torch.testing.assert_close(flex_attention_call(q, k, v, bm, scale=0.3, **kw), ref, rtol=1e-6, atol=1e-7)
    plain = dense_attention(q, k, v, keep, scale=0.3)
    assert (plain - ref).abs().max() > 1e-2, "the variant changes the result (the comparison is not vacuous)"


# -- flash_attention_* varlen: transformers' own wiring, with a reference kernel in place of flash-attn ---------
def _varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                      softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, deterministic=False):  # fmt: skip
    """flash_attn_varlen_func's documented semantics: per cu_seqlens segment, causal, window (left, right), softcap."""
    assert torch.equal(cu_seqlens_q, cu_seqlens_k) and causal
    out = torch.empty_like(q)
    groups = q.shape[1] // k.shape[1]
    for a, b in zip(cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist(), strict=True):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))  # [H, n, D]
        ks, vs = ks.repeat_interleave(groups, 0), vs.repeat_interleave(groups, 0)
        s = qs @ ks.transpose(-1, -2) * (softmax_scale or qs.shape[-1] ** -0.5)
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        i = torch.arange(b - a)
        keep = i[None, :] <= i[:, None]
        left, right = window_size
        if left >= 0:
            keep &= i[None, :] >= i[:, None] - left
        if right >= 0:
            keep &= i[None, :] <= i[:, None] + right
        out[a:b] = (s.masked_fill(~keep, -math.inf).softmax(-1) @ vs).transpose(0, 1)
    return out


@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma2"])
def test_flash_varlen_kwargs_apply_each_layers_window_per_document(family, monkeypatch):
    import transformers.modeling_flash_attention_utils as fa

    process = fa._lazy_define_process_function(_varlen_reference)
    monkeypatch.setattr(fa, "lazy_import_flash_attention",
                        lambda *a, **k: ((None, _varlen_reference, None, None, None), (process, dict)))  # fmt: skip
    model = build(family, "flash_attention_2")
    batches = _packs(n=1)[0]
    kwargs = hf_model_kwargs(batches[0], "flash_attention_2", config=model)
    assert kwargs["max_length_q"] > hf_zoo.WINDOW, "documents longer than the window"
    ref_loss, ref_grad, _ = _reference(family, 0, batches)
    assert max_rel_error(*_packed(model, kwargs), ref_loss, ref_grad) < 1e-6


# -- refusals --------------------------------------------------------------------------------------------------
def test_refusals_name_the_field_or_the_fix():
    batch = _packs(n=1)[0][0]
    model = build("qwen2", "cpdata")
    with pytest.raises(ValueError, match="needs the batch's cpdata state"):
        model(input_ids=batch["input_ids"].reshape(1, -1), use_cache=False)
    with pytest.raises(ValueError, match="got an attention_mask"):
        model(**hf_model_kwargs(batch, "cpdata"), attention_mask=torch.ones(1, 1, 64, 64, dtype=torch.bool))
    model.config.sliding_window = 9  # the layers were built with 6: the model's masks and kernels would disagree
    with pytest.raises(ValueError, match="config.sliding_window"):
        model(**hf_model_kwargs(batch, "cpdata"))
    model.config.sliding_window = hf_zoo.WINDOW
    types = model.config.layer_types
    model.config.layer_types = ["chunked_attention", "full_attention"]
    with pytest.raises(ValueError, match=r"config.layer_types holds \['chunked_attention'\]"):
        hf_model_kwargs(batch, "cpdata", config=model)
    model.config.layer_types = types
    model.model.layers[1].self_attn.layer_type = "linear_attention"  # a layer of a type cpdata does not compute
    with pytest.raises(ValueError, match=r"config.layer_types\[1\]='linear_attention'"):
        model(**hf_model_kwargs(batch, "cpdata"))
    gemma3 = build("gemma3", "cpdata")
    gemma3.config.use_bidirectional_attention = True
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        gemma3(**hf_model_kwargs(batch, "cpdata"))
    with pytest.raises(ValueError, match="unknown attn_implementation.*register_hf_attention"):
        hf_model_kwargs(batch, "cpdata_never_registered")  # an unknown name: the list of known ones
    with pytest.raises(ValueError, match="kernel="):
        register_hf_attention("x", kernel="ring")


def test_cp2_without_a_group_or_ctx_is_loud():
    """cp 2 in one process (every rank's batch, no process group): nothing silently local or cp x the loss."""
    ranks = _packs(cp=2, layout="balanced", n=1)[0]
    batch, llama = ranks[0], build("llama", "sdpa")
    # the worker records the pack's target count (both ranks' targets): no collective, no group needed
    assert batch.info["n_targets"] == sum(int(b["labels"].ne(IGNORE_INDEX).sum()) for b in ranks) > 0
    assert hf_model_kwargs(batch, "cpdata")["num_items_in_batch"] == batch.info["n_targets"]
    relabelled = batch.replace(labels=batch["labels"].clone())  # new labels: the recorded count is dropped
    assert "n_targets" not in relabelled.info
    copied = batch.replace()  # the same labels as another tensor (a pinned copy): the count holds
    copied["labels"] = batch["labels"].clone()
    assert copied.info["n_targets"] == batch.info["n_targets"]
    edited = batch.replace()
    edited["labels"] = torch.full_like(batch["labels"], IGNORE_INDEX)  # other labels assigned: the count is dropped
    assert "n_targets" not in edited.info and "n_targets" in batch.info
    with pytest.raises(ValueError, match=r"cp x the loss.*num_items_in_batch"):
        hf_model_kwargs(relabelled, "cpdata")
    with pytest.raises(ValueError, match=r"config=model"):
        hf_model_kwargs(batch, "sdpa", num_items_in_batch=10)
    with pytest.raises(ValueError, match=r"inside the ctx.*'cpdata' attention"):
        hf_model_kwargs(batch, "sdpa", num_items_in_batch=10, config=llama)
    with pytest.raises(ValueError, match="'cpdata' attention"):
        hf_model_kwargs(batch, "eager", num_items_in_batch=10, config=llama)


def test_labels_and_target_count_match_the_reference():
    """The reference's target count is the pack's: the alone sum and the packed mean divide by the same N."""
    batches = _packs(n=1)[0]
    full = full_pack(batches)
    real = ~full["padding_mask"]
    assert int(full["labels"].ne(IGNORE_INDEX).sum()) == int(full["labels"][real].ne(IGNORE_INDEX).sum()) > 0
    model = build("llama", "cpdata")
    with torch.no_grad():
        out = model(**hf_model_kwargs(batches[0], "cpdata"))
        mine = F.cross_entropy(out.logits[0].float(), full["labels"], ignore_index=IGNORE_INDEX)
    assert out.loss.item() == pytest.approx(mine.item(), rel=1e-6)
