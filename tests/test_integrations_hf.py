"""``CPTrainer`` (a real ``transformers.Trainer``) at cp 2 on gloo ranks against cp 1 on one process.

Same data, same seed, same ``TrainingArguments`` (AdamW, linear schedule with
warm-up, gradient clipping, 2 packs per micro-batch as one THD stream, gradient
accumulation 2): the per-step losses and
the final weights at cp 2 equal cp 1's within 1e-4 relative over 4 optimizer
steps, and a run resumed from the step-2 Trainer checkpoint continues with the
same batches (same losses, same final weights as the uninterrupted run).
Ranks are forked from this process (``tests/dist_utils.py``), which imported
transformers once; accelerate sees them through the usual torchrun variables.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from datasets import Dataset
from dist_utils import run_ranks
from trainer_ranks import launch_env, relative, weights
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from cpdata.integrations.cp_trainer import LOADER_STATE
from cpdata.integrations.hf import CPTrainer
from cpdata.nodes.dataset import CPDataset
from cpdata.nodes.options import DataPolicy, Delivery, StreamPlan

VOCAB = 64
CAPACITY = 64
STEPS = 4


def documents() -> Dataset:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 50, (80,), generator=g).tolist()
    return Dataset.from_dict({"input_ids": [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths]})


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         attn_implementation="sdpa")  # fmt: skip
    return LlamaForCausalLM(config)


def training_args(out: str, **overrides) -> TrainingArguments:
    kwargs = dict(max_steps=STEPS, per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=3e-3,
                  lr_scheduler_type="linear", warmup_steps=1, max_grad_norm=1.0, weight_decay=0.01, logging_steps=1,
                  save_steps=2, report_to="none", use_cpu=True, disable_tqdm=True, seed=0)  # fmt: skip
    kwargs.update(overrides)
    return TrainingArguments(out, **kwargs)


def run_trainer(rank: int, world: int, out: str, resume: str | None = None) -> dict:
    launch_env(rank, world)
    counts: list[int] = []

    class Counting(CPTrainer):
        def _get_num_items_in_batch(self, batch_samples, device):
            total = super()._get_num_items_in_batch(batch_samples, device)
            # labels replaced after the workers counted them: the trainer counts them itself (over CP)
            relabelled = [b.replace(labels=b["labels"].clone()) for b in batch_samples]
            assert all("n_targets" not in b.info for b in relabelled)
            assert int(super()._get_num_items_in_batch(relabelled, device)) == int(total)
            counts.append(int(total))
            return total

    trainer = Counting(model=tiny_llama(), args=training_args(out), train_dataset=documents(), cp_size=world,
                       capacity=CAPACITY, layout="balanced")  # fmt: skip
    trainer.train(resume_from_checkpoint=resume)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {"losses": [h["loss"] for h in logs], "steps": [h["step"] for h in logs], "counts": counts,
            "weights": weights(trainer.model), "log": logs[-1]}  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cptrainer")
    cp1 = run_ranks(run_trainer, 1, str(root / "cp1"), timeout=180)[0]
    cp2 = run_ranks(run_trainer, 2, str(root / "cp2"), timeout=180)
    return root, cp1, cp2


def test_cp2_trains_like_cp1(runs):
    _, cp1, cp2 = runs
    assert cp1["steps"] == [1, 2, 3, 4] and cp2[0]["steps"] == [1, 2, 3, 4]
    assert cp1["counts"] == cp2[0]["counts"] == cp2[1]["counts"], "both runs divide by the same packs' targets"
    assert len(set(cp1["losses"])) == STEPS, "the losses moved: something was trained"
    for rank in cp2:
        np.testing.assert_allclose(rank["losses"], cp1["losses"], rtol=1e-4)
        assert relative(rank["weights"], cp1["weights"]) < 1e-4
    assert relative(cp2[0]["weights"], cp2[1]["weights"]) == 0.0, "DDP keeps the ranks' weights identical"
    assert relative(cp1["weights"], weights(tiny_llama())) > 1e-3, "the weights moved away from the initial ones"


def test_logs_carry_padding_imbalance_and_throughput(runs):
    _, cp1, cp2 = runs
    for log in (cp1["log"], cp2[0]["log"]):
        assert 0.0 <= log["cp_padding_pct"] < 100.0 and log["cp_tiles_max_over_ideal"] >= 1.0 and log["cp_tokens_per_s"] > 0
    assert cp1["log"]["cp_padding_pct"] == cp2[0]["log"]["cp_padding_pct"], "the same packs"


def test_resume_from_a_trainer_checkpoint_continues_with_the_same_batches(runs):
    root, _, cp2 = runs
    checkpoint = root / "cp2" / "checkpoint-2"
    assert {LOADER_STATE.format(rank=r) for r in (0, 1)} <= {p.name for p in checkpoint.iterdir()}
    assert cp2[0]["counts"][:2] != cp2[0]["counts"][2:], "a restart from the first batches would show"
    resumed = run_ranks(run_trainer, 2, str(root / "cp2"), str(checkpoint), timeout=180)
    for before, after in zip(cp2, resumed, strict=True):
        assert after["steps"] == [1, 2, 3, 4], "steps 1-2 come from the checkpoint's trainer state"
        assert len(after["counts"]) == 2 and after["counts"] == before["counts"][2:], "the same packs after resuming"
        np.testing.assert_allclose(after["losses"], before["losses"], rtol=1e-6)
        assert relative(after["weights"], before["weights"]) < 1e-6


@pytest.mark.parametrize("overrides,names", [
    ({"max_steps": -1}, ["max_steps=-1"]),
    ({"eval_strategy": "steps", "eval_steps": 2, "label_smoothing_factor": 0.1}, ["evaluation", "label_smoothing"]),
])  # fmt: skip
def test_settings_it_cannot_honour_are_refused_by_name(tmp_path, overrides, names):
    with pytest.raises(ValueError) as err:
        CPTrainer(model=tiny_llama(), args=training_args(str(tmp_path), **overrides), train_dataset=documents(),
                  cp_size=1, capacity=CAPACITY)  # fmt: skip
    assert all(name in str(err.value) for name in names), err.value


def tiny_mistral():
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                           sliding_window=8)  # fmt: skip
    model = MistralForCausalLM(config)
    model.set_attn_implementation("cpdata")
    return model


def run_cpdata_attention(rank: int, world: int, out: str) -> dict:
    """A sliding-window model through the registered "cpdata" attention: no ctx, K/V by the exchange plan."""
    from cpdata.adapters import register_hf_attention

    launch_env(rank, world)
    register_hf_attention()
    trainer = CPTrainer(model=tiny_mistral(), args=training_args(out, save_strategy="no"), train_dataset=documents(),
                        cp_size=world, capacity=CAPACITY, layout="round_robin",
                        delivery=Delivery(kv_exchange=True))  # fmt: skip
    trainer.train()
    return {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h], "weights": weights(trainer.model)}


def test_the_cpdata_attention_trains_a_sliding_window_model_at_cp2_like_cp1(tmp_path):
    cp1 = run_ranks(run_cpdata_attention, 1, str(tmp_path / "cp1"), timeout=180)[0]
    cp2 = run_ranks(run_cpdata_attention, 2, str(tmp_path / "cp2"), timeout=180)
    assert len(cp1["losses"]) == STEPS and len(set(cp1["losses"])) == STEPS
    for rank in cp2:
        np.testing.assert_allclose(rank["losses"], cp1["losses"], rtol=1e-4)
        assert relative(rank["weights"], cp1["weights"]) < 1e-4


def test_cp_attention_needs_cpdata_or_sdpa_and_the_loader_options_stay_the_trainers():
    from cpdata.integrations.attention import check_attention

    config = LlamaConfig(attn_implementation="eager")
    check_attention(config, 1)  # cp 1: the model keeps its own attention
    with pytest.raises(ValueError, match="attn_implementation='sdpa'") as err:
        check_attention(config, 2)
    assert "set_attn_implementation('cpdata')" in str(err.value)
    with pytest.raises(ValueError, match=r"sets the DP rank and size from its \(dp, cp\) mesh"):
        CPTrainer(model=tiny_llama(), cp_size=1, capacity=CAPACITY, data=DataPolicy(dp_size=2))
    with pytest.raises(TypeError, match=r"no longer takes loader_options=; pass the records plan="):
        CPTrainer(model=tiny_llama(), cp_size=1, capacity=CAPACITY, loader_options={"shuffle": True})


def run_dp2(rank: int, world: int, cp_size: int, out: str, average_tokens: bool) -> dict:
    launch_env(rank, world)
    args = training_args(out, save_strategy="no", average_tokens_across_devices=average_tokens)
    trainer = CPTrainer(model=tiny_llama(), args=args, train_dataset=documents(), cp_size=cp_size,
                        capacity=CAPACITY, layout="balanced")  # fmt: skip
    trainer.train()
    return {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h], "weights": weights(trainer.model)}


@pytest.mark.slow
@pytest.mark.parametrize("average_tokens", [False, True])
def test_dp2_cp2_trains_like_dp2_cp1(tmp_path, average_tokens):
    """4 ranks: sum over CP, mean over DP (per-pack) or the global token mean; measured 2e-7 / 2e-8 (~20 s each)."""
    ref = run_ranks(run_dp2, 2, 1, str(tmp_path / "cp1"), average_tokens, timeout=300)
    cp2 = run_ranks(run_dp2, 4, 2, str(tmp_path / "cp2"), average_tokens, timeout=300)
    for rank in cp2:
        np.testing.assert_allclose(rank["losses"], ref[0]["losses"], rtol=1e-4)
        assert relative(rank["weights"], ref[0]["weights"]) < 1e-4


def test_the_trainer_fills_the_data_policy_it_owns_and_keeps_the_users_choices(tmp_path):
    """The mesh's DP rank and size always; seed, vocabulary and alignment only where left at their defaults."""
    args = training_args(str(tmp_path), seed=11)
    mine = CPTrainer(model=tiny_llama(), args=args, train_dataset=documents(), cp_size=1, capacity=CAPACITY,
                     plan=StreamPlan(overflow="split"), data=DataPolicy(shuffle=True, epochs=2, seed=5),
                     delivery=Delivery(prefetch=1))  # fmt: skip
    options = mine._cp_dataset_options()
    assert options["plan"] == StreamPlan(overflow="split") and options["delivery"] == Delivery(prefetch=1)
    assert options["data"] == DataPolicy(dp_rank=0, dp_size=1, shuffle=True, epochs=2, seed=5, vocab_size=VOCAB,
                                         labels_alignment="inputs")  # fmt: skip
    default = CPTrainer(model=tiny_llama(), args=args, train_dataset=documents(), cp_size=1, capacity=CAPACITY)
    assert default._cp_dataset_options()["data"] == DataPolicy(seed=11, vocab_size=VOCAB, labels_alignment="inputs")
    assert default._cp_dataset_options()["plan"] == StreamPlan()
    served = [b.info["digest"] for b in default.get_train_dataloader()]
    direct = [b.info["digest"] for b in CPDataset(documents(), cp_rank=0, **default._cp_dataset_options())]
    assert len(served) > 4 and served == direct  # the loader is the CPDataset of exactly those options


def run_world(rank: int, world: int, out: str) -> dict:
    """The world mode: 4 ranks as 2 nodes of 2 one CP group, "cpdata" attention with the K/V exchange, 2
    micro-batches of one pack a step dealt together (``world_step`` = the Trainer's gradient accumulation)."""
    from cpdata.adapters import register_hf_attention
    from cpdata.layout.maps import layout_spec

    launch_env(rank, world)
    register_hf_attention()
    torch.manual_seed(0)
    model = tiny_llama()
    model.set_attn_implementation("cpdata")
    start = weights(model)
    trainer = CPTrainer(model=model, train_dataset=documents(), cp_size=world, capacity=2 * CAPACITY,
                        args=training_args(out, save_strategy="no", per_device_train_batch_size=1, max_steps=2,
                                           max_grad_norm=0.0, warmup_steps=0),
                        layout=layout_spec("world", node_size=2), plan=StreamPlan(overflow="split", world_step=2),
                        delivery=Delivery(kv_exchange=True))  # fmt: skip
    trainer.train()
    return {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h], "start": start,
            "weights": weights(trainer.model)}  # fmt: skip


def test_the_world_mode_trains_its_first_step_on_each_document_alone(tmp_path):
    """Step 1's logged loss is the token mean over the two packs' documents, each alone through plain HF (no CP);
    every rank ends with the same weights; a step's packs were dealt together (some pack holds pad)."""
    from cpdata.layout.maps import layout_spec

    ranks = run_ranks(run_world, 4, str(tmp_path / "world"), timeout=300)
    options = dict(capacity=2 * CAPACITY, cp_size=4, layout=layout_spec("world", node_size=2),
                   plan=StreamPlan(overflow="split", world_step=2),
                   data=DataPolicy(seed=0, vocab_size=VOCAB, labels_alignment="inputs"))  # fmt: skip
    per_rank = [list(itertools.islice(CPDataset(documents(), cp_rank=r, **options), 2)) for r in range(4)]
    first = per_rank[0]
    spans = set()  # how many ranks each document of the step's packs is on (a document over 32 tokens: two)
    for k, batch in enumerate(first):
        ends = np.cumsum([len(documents()["input_ids"][d]) for d in batch.info["doc_index"]])
        for d in range(ends.shape[0]):
            on = [r for r in range(4) if np.isin(np.arange(ends[d - 1] if d else 0, ends[d]),
                                                 per_rank[r][k].layout.local_token_global_indices.numpy()).any()]
            spans.add(len(on))
    assert max(spans) == 2  # a document spread over two ranks: the exchange moved its keys
    docs = documents()["input_ids"]
    model = tiny_llama()
    with torch.no_grad():  # the initial weights: the ranks' start
        assert relative(weights(model), ranks[0]["start"]) == 0
        total = targets = 0.0
        for batch in first:
            for d, s in zip(batch.info["doc_index"], batch.info["doc_start"], strict=True):
                assert s == 0  # (every document shorter than a pack: whole)
                ids, n = torch.tensor(docs[d])[None], len(docs[d])
                out = model(input_ids=ids, labels=ids)
                total, targets = total + out.loss.item() * (n - 1), targets + (n - 1)
    assert sum(b.info["real_tokens"] for b in first) < 2 * 2 * CAPACITY  # not filled to the token: dealt as a step
    for rank in ranks:
        assert len(rank["losses"]) == 2
        np.testing.assert_allclose(rank["losses"][0], total / targets, rtol=1e-4)
        assert relative(rank["weights"], ranks[0]["weights"]) == 0 and relative(rank["weights"], rank["start"]) > 0


def test_a_world_step_must_be_the_trainers_accumulation_of_one_pack(tmp_path):
    from cpdata.layout.maps import layout_spec

    for overrides in ({"gradient_accumulation_steps": 2, "per_device_train_batch_size": 2},
                      {"gradient_accumulation_steps": 4, "per_device_train_batch_size": 1}):  # fmt: skip
        with pytest.raises(ValueError, match=r"StreamPlan\(world_step=2\) balances .* got "
                                             f"{overrides['gradient_accumulation_steps']} and "
                                             f"{overrides['per_device_train_batch_size']}"):  # fmt: skip
            CPTrainer(model=tiny_llama(), args=training_args(str(tmp_path), **overrides), train_dataset=documents(),
                      cp_size=1, capacity=CAPACITY, layout=layout_spec("world", node_size=1),
                      plan=StreamPlan(overflow="split", world_step=2))  # fmt: skip
