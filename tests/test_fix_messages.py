"""Messages that name the real fix: an overlong document in a mix, a capacity for tiled, "cpdata" not registered.

Each test runs the slip a user makes and checks the message against what is
true of the input (the source and index the overlong document really has, a
capacity the layout then accepts and that fits the document).
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import cpdata
from cpdata import build_loader, closing_loader, open_dataset, precompute
from cpdata.adapters import hf_attention
from cpdata.integrations.attention import check_attention
from tests.flat_options import records


def test_an_overlong_document_in_a_mix_of_lists_is_named_by_its_source_and_index():
    a = [{"input_ids": np.arange(1, 20)} for _ in range(5)]
    b = [{"input_ids": np.arange(1, 20)} for _ in range(5)]
    b[3] = {"input_ids": np.arange(1, 200)}
    mixed = cpdata.mix({"a": a, "b": b}, {"a": 1, "b": 1}, seed=0)
    loader = build_loader(mixed, **records(capacity=64, cp_size=1, cp_rank=0, layout="identity", prefetch=0, pin_memory=False))
    with pytest.raises(ValueError) as info, closing_loader(loader):
        list(loader)
    message = str(info.value)
    assert message.startswith("document 3 of mix source 'b' has 199 tokens"), message
    assert "does not state its lengths" not in message and "plan_lengths" in message


def test_the_capacity_suggested_for_an_overlong_document_is_one_the_layout_takes(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"input_ids": list(range(1, 1 + n))}) + "\n" for n in (100, 3000, 50)))
    with pytest.raises(ValueError, match=r"raise the capacity \(to (\d+) for all\)") as info:
        precompute(open_dataset(path), tmp_path / "plan", capacity=1024, cp_size=2, layout="tiled")
    suggested = int(str(info.value).split("(to ")[1].split(" ")[0])
    assert suggested >= 3000
    precompute(open_dataset(path), tmp_path / "plan", capacity=suggested, cp_size=2, layout="tiled")  # taken


def test_the_cp_trainer_names_register_hf_attention_for_an_unregistered_cpdata(monkeypatch):
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=10, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    config._attn_implementation = "cpdata"
    monkeypatch.delitem(hf_attention.REGISTERED, "cpdata", raising=False)
    with pytest.raises(ValueError, match=r"not registered in this process: call cpdata\.adapters\."
                                         r"register_hf_attention\(\) first, on every rank"):
        check_attention(config, cp_size=2)


_TRANSFORMERS_REFUSAL = """
from transformers import LlamaConfig, LlamaForCausalLM
from cpdata.adapters import register_hf_attention
model = LlamaForCausalLM(LlamaConfig(vocab_size=10, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1))
try:
    model.set_attn_implementation("cpdata")
except ValueError as e:
    print(str(e).split(".")[0])
register_hf_attention()
model.set_attn_implementation("cpdata")
print(model.config._attn_implementation)
"""


def test_the_refusal_bad_input_md_quotes_is_transformers_own_before_registering():
    out = subprocess.run([sys.executable, "-c", _TRANSFORMERS_REFUSAL], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == ['Specified `attn_implementation="cpdata"` is not supported', "cpdata"]
