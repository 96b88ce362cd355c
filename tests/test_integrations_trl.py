"""``CPSFTTrainer`` (TRL's real ``SFTTrainer``, ``packing=True``) at cp 2 on gloo ranks against cp 1.

A chat dataset with ``assistant_only_loss=True``: TRL applies the chat template
and builds the labels from its ``assistant_masks``; cpdata packs and shards.
Per-step losses and final weights at cp 2 equal cp 1's within 1e-4 relative over
4 optimizer steps (gradient accumulation 2). Over a whole epoch the trained
targets are exactly the reply tokens the tokenizer's own
``return_assistant_tokens_mask`` marks, and, for prompt-completion rows with
``completion_only_loss``, exactly the completion tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from datasets import Dataset
from dist_utils import run_ranks
from tokenizer_fixture import CORPUS, chat_tokenizer
from trainer_ranks import launch_env, relative, weights
from transformers import LlamaConfig, LlamaForCausalLM
from trl import SFTConfig

from cpdata.integrations.trl import CPSFTTrainer

CAPACITY = 64
STEPS = 4
WORDS = " ".join(CORPUS).replace("?", "").replace(".", "").replace(",", "").split()


def sentence(rng: np.random.Generator, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS, int(rng.integers(low, high))))


def chats() -> Dataset:
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(48):
        turns = int(rng.integers(1, 3))
        rows.append({"messages": [m for _ in range(turns) for m in (
            {"role": "user", "content": sentence(rng, 2, 8)},
            {"role": "assistant", "content": sentence(rng, 1, 10)})]})  # fmt: skip
    return Dataset.from_list(rows)


def prompt_completions() -> Dataset:
    rng = np.random.default_rng(1)
    return Dataset.from_list([{"prompt": sentence(rng, 2, 8), "completion": " " + sentence(rng, 1, 8)}
                              for _ in range(30)])  # fmt: skip


def tiny_llama(vocab: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=0, eos_token_id=1, bos_token_id=None, attn_implementation="sdpa")  # fmt: skip
    return LlamaForCausalLM(config)


def sft_config(out: str, **overrides) -> SFTConfig:
    kwargs = dict(max_steps=STEPS, per_device_train_batch_size=1, gradient_accumulation_steps=2, learning_rate=3e-3,
                  lr_scheduler_type="cosine", max_grad_norm=1.0, logging_steps=1, save_strategy="no", packing=True,
                  max_length=CAPACITY, assistant_only_loss=True, report_to="none", use_cpu=True, disable_tqdm=True,
                  seed=0, bf16=False)  # fmt: skip
    kwargs.update(overrides)
    return SFTConfig(out, **kwargs)


def trainer(out: str, world: int, dataset: Dataset, **overrides) -> CPSFTTrainer:
    tok = chat_tokenizer()
    return CPSFTTrainer(model=tiny_llama(len(tok)), args=sft_config(out, **overrides), train_dataset=dataset,
                        processing_class=tok, cp_size=world, layout="balanced")  # fmt: skip


def epoch_targets(t: CPSFTTrainer) -> int:
    """Targets the trainer's loader trains over one whole epoch (cp 1)."""
    return sum(int(batch["labels"].ne(-100).sum()) for batch in t.get_train_dataloader())


def run(rank: int, world: int, out: str) -> dict:
    launch_env(rank, world)
    t = trainer(f"{out}/chat", world, chats())
    t.train()
    logs = [h for h in t.state.log_history if "loss" in h]
    result = {"losses": [h["loss"] for h in logs], "weights": weights(t.model), "log": logs[-1]}
    if world == 2:  # bf16 autocast (TRL's default): RoPE's float32 key meets a bf16 value in the CP context
        bf16 = trainer(f"{out}/bf16", world, chats(), bf16=True, max_steps=1, gradient_accumulation_steps=1)
        bf16.train()
        result["bf16_loss"] = next(h["loss"] for h in bf16.state.log_history if "loss" in h)
    if world == 1:  # brute force from the tokenizer alone: token i + 1 is a target when the template marks it
        tok = chat_tokenizer()
        marked = [tok.apply_chat_template(row["messages"], tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)["assistant_masks"][:CAPACITY]
                  for row in chats()]  # TRL truncates each row to max_length (bfd)
        result["chat"] = (epoch_targets(t), sum(sum(m[1:]) for m in marked), sum(len(m) for m in marked))
        pc = trainer(f"{out}/pc", 1, prompt_completions(), assistant_only_loss=False)
        completion = sum(len(tok(row["prompt"] + row["completion"] + tok.eos_token)["input_ids"])
                         - len(tok(row["prompt"])["input_ids"]) for row in prompt_completions())  # TRL appends EOS
        result["completion"] = (epoch_targets(pc), completion)
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cpsft")
    return run_ranks(run, 1, str(root / "cp1"), timeout=180)[0], run_ranks(run, 2, str(root / "cp2"), timeout=180)


def test_sft_cp2_trains_like_cp1(runs):
    cp1, cp2 = runs
    assert len(cp1["losses"]) == STEPS and len(set(cp1["losses"])) == STEPS
    for rank in cp2:
        np.testing.assert_allclose(rank["losses"], cp1["losses"], rtol=1e-4)
        assert relative(rank["weights"], cp1["weights"]) < 1e-4
    assert relative(cp1["weights"], weights(tiny_llama(len(chat_tokenizer())))) > 1e-3, "something was trained"
    assert cp2[0]["log"]["cp_tiles_max_over_ideal"] >= 1.0 and cp2[0]["log"]["cp_tokens_per_s"] > 0


def test_bf16_autocast_trains_under_cp(runs):
    cp1, cp2 = runs
    # step 1 of the float32 run accumulates 2 packs, the bf16 run trains the first one alone: same ballpark
    assert np.isfinite(cp2[0]["bf16_loss"]) and abs(cp2[0]["bf16_loss"] - cp1["losses"][0]) < 0.5


def test_only_assistant_replies_and_completions_are_trained(runs):
    cp1, _ = runs
    trained, marked, tokens = cp1["chat"]
    assert trained == marked and 0 < marked < tokens / 2, (trained, marked, tokens)
    trained, completion = cp1["completion"]
    assert trained == completion > 0


@pytest.mark.parametrize("overrides,names", [
    ({"packing": False}, ["packing=False"]),
    ({"packing_strategy": "wrapped", "loss_type": "dft"}, ["packing_strategy='wrapped'", "loss_type='dft'"]),
    ({"neftune_noise_alpha": 5.0, "use_liger_kernel": True}, ["neftune_noise_alpha", "use_liger_kernel"]),
    ({"max_length": None}, ["max_length=None"]),
    ({"max_steps": -1, "eval_strategy": "steps", "eval_steps": 1}, ["max_steps=-1", "evaluation"]),
])  # fmt: skip
def test_combinations_it_cannot_honour_are_refused_by_name(tmp_path, overrides, names):
    with pytest.raises(ValueError) as err:
        trainer(str(tmp_path), 1, chats(), **overrides)
    assert all(name in str(err.value) for name in names), err.value
