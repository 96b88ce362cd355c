"""``hf_model_kwargs``: a randomly initialised ``transformers`` Llama on cpdata's packed batch.

The packed loss must equal the loss of every document run alone (documents
split across packs included), for each attention implementation that can run
on CPU: ``sdpa`` and ``eager`` with the explicit document mask, and the
flash-attention varlen kwargs (``cu_seq_lens_q/k``, ``max_length_q/k``)
consumed by a reference varlen attention registered with transformers (the
real flash-attn kernels need CUDA).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

from cpdata.adapters import hf_model_kwargs
from cpdata.nodes.loader import shard_graph
from cpdata.nodes.shard import ShardForRank
from cpdata.worker.keys import IGNORE_INDEX
from tests.flat_options import graph_options

VOCAB = 64
LENS = [5, 23, 9, 40, 3, 17, 30, 11, 2, 26]
CPDATA_KEYS = {"padding_mask", "document_ids", "cu_seqlens", "cu_seqlens_padded", "seq_lens", "seq_lens_padded",
               "max_seqlen"}  # fmt: skip


def _docs(lens=LENS) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(1, VOCAB, (n,), generator=g).tolist()} for n in lens]


def _batches(cp_size: int = 1, layout: str = "identity", lens=LENS, **kw) -> list[tuple]:
    graph = shard_graph(_docs(lens), graph_options(capacity=32, cp_size=cp_size, layout=layout, algorithm="concat", overflow="split", **kw))  # fmt: skip
    return list(ShardForRank(graph, cp_size=cp_size, cp_rank=0, layout=layout, all_ranks=True))


def _model(impl: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
    model = LlamaForCausalLM(cfg).double().eval()
    model.config._attn_implementation = impl
    return model


def _varlen_reference(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """What flash_attn_varlen_func computes, from the kwargs transformers forwards: causal per cu_seq_lens slot.

    Without the kwargs (a document run alone) the row is one causal sequence.
    """
    assert attention_mask is None, "transformers builds no mask for this attention"
    if "cu_seq_lens_q" not in kwargs:
        n = query.shape[2]
        kwargs = {**kwargs, "cu_seq_lens_q": torch.tensor([0, n], dtype=torch.int32), "max_length_q": n}
        kwargs.update(cu_seq_lens_k=kwargs["cu_seq_lens_q"], max_length_k=n)
    cu_q, cu_k = kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"]
    max_q, max_k = kwargs["max_length_q"], kwargs["max_length_k"]
    assert type(max_q) is int and type(max_k) is int, "max_length_q/k must be Python ints (no device sync)"
    assert cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k)
    assert int(cu_q[-1]) == query.shape[2], "cu_seq_lens must cover every token of the [1, T] row"
    assert max_q == int((cu_q[1:] - cu_q[:-1]).max())
    key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    value = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
    out = torch.empty_like(query)
    bounds = cu_q.tolist()
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        out[:, :, a:b] = F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b],
                                                        is_causal=True, scale=scaling)  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("cpdata_varlen_reference", _varlen_reference)


def _alone_loss_sum(model: LlamaForCausalLM, batch, packed_logits=None, tol=1e-10) -> tuple[float, int, int]:
    """Sum of CE over the batch's targets, each document slot run alone; (sum, targets, split pieces).

    With ``packed_logits`` ``[T, V]`` each slot's logits must equal them to ``tol``.
    """
    ids, pos, labels = (batch[k].reshape(-1) for k in ("input_ids", "position_ids", "labels"))
    real = ~batch["padding_mask"].reshape(-1)
    doc = batch["document_ids"].reshape(-1)
    total, count, split = 0.0, 0, 0
    for d in doc.unique().tolist():
        sel = (doc == d) & real
        if not sel.any():
            continue
        split += int(pos[sel][0] > 0)
        logits = model(input_ids=ids[sel][None], position_ids=pos[sel][None], use_cache=False).logits[0]
        if packed_logits is not None:
            torch.testing.assert_close(packed_logits[sel], logits, rtol=tol, atol=tol)
        total += F.cross_entropy(logits.float(), labels[sel], ignore_index=IGNORE_INDEX, reduction="sum").item()
        count += int(labels[sel].ne(IGNORE_INDEX).sum())
    return total, count, split


@pytest.mark.parametrize("impl", ["sdpa", "eager", "cpdata_varlen_reference"])
def test_packed_loss_equals_each_document_alone(impl):
    model = _model(impl)
    name = "flash_attention_2" if impl == "cpdata_varlen_reference" else impl  # the kwargs flash-attn gets
    splits = 0
    with torch.no_grad():
        for (batch,) in _batches():
            kwargs = hf_model_kwargs(batch, name, config=model)
            assert not CPDATA_KEYS & kwargs.keys()
            assert kwargs["input_ids"].shape == kwargs["position_ids"].shape == kwargs["shift_labels"].shape
            assert kwargs["input_ids"].shape[0] == 1 and kwargs["use_cache"] is False
            out = model(**kwargs)  # float64 model; HF's loss upcasts the logits to float32, hence 1e-6
            tol = 1e-6 if impl == "eager" else 1e-10  # eager takes its softmax in float32
            total, count, split = _alone_loss_sum(model, batch, out.logits[0], tol)
            splits += split
            assert out.loss.item() == pytest.approx(total / count, rel=1e-6)
    assert splits >= 2, "the corpus must exercise documents continued from an earlier pack (positions > 0)"


def test_shift_labels_are_not_shifted_again():
    """An unsplit document's packed targets give exactly HF's own loss with labels aligned to the inputs."""
    model = _model("sdpa")
    lens = [5, 23, 4]  # fills one pack exactly: whole documents only
    docs = _docs(lens)
    (batch,) = _batches(lens=lens)[0]
    ids = batch["input_ids"].reshape(-1)
    starts = batch["cu_seqlens"][:-1].tolist()
    lens = batch["seq_lens"].tolist()
    with torch.no_grad():
        packed = model(**hf_model_kwargs(batch, "sdpa", config=model)).loss.item()
        total, count = 0.0, 0
        for s, n in zip(starts, lens, strict=True):
            doc = ids[s : s + n]
            assert any(doc.tolist() == d["input_ids"] for d in docs)
            loss = model(input_ids=doc[None], labels=doc[None]).loss.item()  # HF shifts these itself
            total, count = total + loss * (n - 1), count + n - 1
    assert count == sum(lens) - len(lens) and packed == pytest.approx(total / count, rel=1e-6)


@pytest.mark.parametrize("impl", ["sdpa", "cpdata_varlen_reference"])
def test_bshd_rows_become_one_stream(impl):
    model = _model(impl)
    (batch,) = _batches(batch_size=2)[0]
    assert batch["input_ids"].shape == (2, 32)
    kwargs = hf_model_kwargs(batch, "sdpa" if impl == "sdpa" else "flash_attention_2", config=model)
    assert kwargs["input_ids"].shape == (1, 64)
    assert kwargs["attention_mask"].shape == (1, 1, 64, 64) if impl == "sdpa" else kwargs["max_length_q"] > 0
    with torch.no_grad():
        out = model(**kwargs)
        total, count, _ = _alone_loss_sum(model, batch, out.logits[0])
        assert out.loss.item() == pytest.approx(total / count, rel=1e-6)


def test_flex_kwargs_carry_a_block_mask():
    from torch.nn.attention.flex_attention import BlockMask

    (batch,) = _batches()[1]
    kwargs = hf_model_kwargs(batch, "flex_attention", config=LlamaConfig())
    assert isinstance(kwargs["attention_mask"], BlockMask)
    assert kwargs["attention_mask"].shape == (1, 1, 32, 32)


def test_refusals_name_the_fix():
    (batch,) = _batches()[0]
    with pytest.raises(ValueError, match="unknown attn_implementation"):
        hf_model_kwargs(batch, "paged_attention")
    with pytest.raises(TypeError, match="ShardedBatch"):
        hf_model_kwargs(dict(batch), "sdpa")
    for impl in ("sdpa", "eager", "flex_attention"):  # masks need the model's windows: never built without them
        with pytest.raises(ValueError, match=rf"attn_implementation='{impl}'.*config=model.*'cpdata' attention"):
            hf_model_kwargs(batch, impl)
    assert "cu_seq_lens_q" in hf_model_kwargs(batch, "flash_attention_2")  # the kernel applies the window itself
    shards = _batches(cp_size=2, layout="thd", qkv_format="thd")[0]
    with pytest.raises(ValueError, match="sdpa"):
        hf_model_kwargs(shards[0], "flash_attention_2")
