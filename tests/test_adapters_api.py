"""``cpdata.adapters`` is a frozen, optional subpackage: nothing in cpdata imports it, it imports no model stack."""

from __future__ import annotations

import subprocess
import sys

import cpdata.adapters

ADAPTERS = [
    "TEAttentionArgs", "document_causal_mask", "flex_block_mask", "global_target_count", "hf_model_kwargs",
    "register_hf_attention", "te_attention_kwargs", "te_forward_kwargs", "token_loss",
]  # fmt: skip


def test_adapters_all_is_frozen_and_sorted():
    assert cpdata.adapters.__all__ == ADAPTERS == sorted(ADAPTERS)
    for name in ADAPTERS:
        assert getattr(cpdata.adapters, name) is not None


def test_cpdata_never_imports_the_adapters_and_they_import_no_model_stack():
    probe = "print(sorted(m for m in ('cpdata.adapters', 'transformers', 'transformer_engine') if m in sys.modules))"
    code = f"import sys, cpdata, cpdata.nodes.loader, cpdata.nemo.sharder, cpdata.nodes.dataset; {probe}; import cpdata.adapters; {probe}"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["[]", "['cpdata.adapters']"]
