"""Labels in the other convention are refused on the first documents of a source, naming both conventions.

Real-looking data: HF/TRL labels (``labels == input_ids``, prompts -100) and
Megatron targets (``labels[i] == input_ids[i + 1]``, prompts -100). Each is
accepted under its own ``labels_alignment`` (the batch's targets then equal the
next token of every trained position: checked against a brute force) and
refused under the other one; ``unchecked_alignment`` turns the check off and
gives the batch the declared (wrong) meaning.
"""

from __future__ import annotations

import numpy as np
import pytest

from cpdata.nodes.loader import shard_graph
from cpdata.worker.targets import CONVENTION_CHECK, unchecked_alignment
from tests.flat_options import graph_options

PACK = dict(capacity=256, cp_size=1, layout="identity", algorithm="next_fit")


def _chats(convention: str, n: int = 6, seed: int = 0) -> list[dict]:
    """Chat-like rows: a prompt of -100 labels, then a trained reply, in ``convention``'s labels."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = rng.integers(3, 500, int(rng.integers(20, 40)))
        prompt = int(rng.integers(4, 10))
        if convention == "inputs":  # HF: the label of each token is the token itself
            labels = ids.copy()
            labels[:prompt] = -100
        else:  # Megatron: the label of each token is the next one
            labels = np.append(ids[1:], -100)
            labels[: prompt - 1] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def _targets(docs, alignment) -> list[tuple[int, int]]:
    """(input token, its target) at every trained position of the packed batches."""
    node = shard_graph(docs, graph_options(labels_alignment=alignment, **PACK))
    node.reset()
    pairs = []
    for batch in node:
        t = batch.tensors()
        ids, labels = t["input_ids"].reshape(-1), t["labels"].reshape(-1)
        pairs += [(int(ids[i]), int(labels[i])) for i in np.flatnonzero(labels != -100)]
    return pairs


def _next_token_pairs(docs) -> list[tuple[int, int]]:
    """Brute force: every reply token's (previous token, token) pair, document by document."""
    pairs = []
    for d in docs:
        ids = d["input_ids"]
        reply_start = int(np.flatnonzero(d["labels"] != -100)[0])
        first = reply_start if d["labels"][reply_start] == ids[reply_start] else reply_start + 1  # HF or Megatron
        pairs += [(int(ids[i - 1]), int(ids[i])) for i in range(first, len(ids))]
    return pairs


@pytest.mark.parametrize("convention", ["inputs", "targets"])
def test_masked_chat_data_in_its_declared_convention_passes(convention):
    docs = _chats(convention)
    pairs = _targets(docs, convention)
    assert pairs and pairs == _next_token_pairs(docs)


@pytest.mark.parametrize(("convention", "declared", "says"), [
    ("inputs", "targets", "equal the input at the same position"),
    ("targets", "inputs", "equal the next input"),
])  # fmt: skip
def test_labels_in_the_other_convention_are_refused_with_both_names_and_the_fix(convention, declared, says):
    with pytest.raises(ValueError) as info:
        _targets(_chats(convention), declared)
    message = str(info.value)
    assert f"labels_alignment={declared!r} was declared" in message and says in message
    assert f"Pass labels_alignment={convention!r}" in message and "unchecked_alignment" in message


def test_unchecked_alignment_keeps_the_declared_meaning():
    docs = _chats("inputs")
    pairs = _targets(docs, unchecked_alignment("targets"))
    assert pairs and all(token == target for token, target in pairs)  # copies of the input, as declared


def test_only_the_first_documents_are_judged_and_short_ones_not_at_all():
    wrong = _chats("inputs", n=CONVENTION_CHECK.documents + 2)
    right = _chats("targets", n=CONVENTION_CHECK.documents, seed=1)
    assert _targets(right + wrong[-2:], "targets")  # past the checked documents: not judged
    short = [{"input_ids": np.arange(3, 3 + CONVENTION_CHECK.min_trained), "labels": np.arange(3, 3 + 8)}]
    short[0]["labels"][0] = -100  # fewer than min_trained trained labels before the last token
    assert _targets(short, "targets")
