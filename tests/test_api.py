"""The public API is frozen: additions and removals are deliberate."""

from __future__ import annotations

import subprocess
import sys

import cpdata
import cpdata.nodes

PUBLIC = [
    "CPDataLoader", "CPDataset", "Collate", "CollatedPack", "ContextParallelAttention",
    "ContextParallelSharder", "CostModel", "DataPolicy", "Delivery", "DocPiece", "Document", "Documents",
    "LAYOUTS", "Mix", "Pack", "PackPlan", "PackingResult", "PackingStats", "PrecomputedDataset",
    "PrecomputedPacks", "Schedule", "SchedulePlan", "ShardForRank", "ShardLayout", "ShardedBatch", "StreamPlan",
    "Tokenize", "TokenizedDataset", "alignment",
    "all_ranks_have_batch", "build_loader", "build_node", "close_loader", "closing_loader", "collate_pack",
    "collate_rank", "exchange_tokens", "exchanged_key_positions", "exit_with_parent", "gather_token_tensor",
    "inverse_indices", "keep_heap", "maybe_pin", "mix",
    "open_dataset", "plan_lengths", "plan_schedule", "precompute", "rank_indices", "verify_layout_consistency",
]  # fmt: skip


def test_all_is_frozen_and_sorted():
    assert cpdata.__all__ == PUBLIC
    assert PUBLIC == sorted(PUBLIC)


def test_every_public_name_resolves():
    for name in cpdata.__all__:
        assert getattr(cpdata, name) is not None, name
    for name in cpdata.nodes.__all__:
        assert getattr(cpdata.nodes, name) is getattr(cpdata, name)


def test_unknown_attribute_is_an_attribute_error():
    try:
        cpdata.no_such_thing  # noqa: B018
    except AttributeError as e:
        assert "no_such_thing" in str(e)
    else:
        raise AssertionError("expected AttributeError")


def test_import_cpdata_is_light():
    code = "import sys, cpdata; print(sorted(m for m in ('torch', 'numpy', 'torchdata') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
