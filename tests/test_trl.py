"""The mixin with TRL's offline trainers: the shipped SFT, DPO, KTO and reward classes, whose logged counts and metrics
are TRL's own trainers'. Trainers that build their batches (GRPO, RLOO): tests/test_batch_building.py."""

from __future__ import annotations

import copy
import json
import math
import warnings

import pytest
import torch
from datasets import Dataset
from transformers import (
    GPT2Config,
    GPT2ForSequenceClassification,
    GPT2LMHeadModel,
)

from hf_hybrid import HybridMixin, HybridTrainingArguments, Phase

from .conftest import FAST_SCHEDULE, flat_params
from .test_ecosystem import OptimizerStepCounter, assert_optimizer_ran_only_on_real_steps


def _sft_classes():
    trl = pytest.importorskip("trl")
    from hf_hybrid import HybridSFTConfig, HybridSFTTrainer

    assert issubclass(HybridSFTTrainer, trl.SFTTrainer) and issubclass(HybridSFTTrainer, HybridMixin)
    return trl, HybridSFTConfig, HybridSFTTrainer


def test_without_trl_the_trl_classes_name_the_package_to_install(monkeypatch):
    import sys

    import hf_hybrid

    monkeypatch.setitem(sys.modules, "trl", None)  # what an environment without TRL gives `import trl`
    monkeypatch.delitem(sys.modules, "hf_hybrid.trl_trainers", raising=False)
    for name in ("HybridSFTTrainer", "HybridDPOConfig"):
        with pytest.raises(ImportError, match="need TRL, which is not installed: pip install trl"):
            getattr(hf_hybrid, name)


def _sft_text() -> Dataset:
    subjects = ["the cat", "the dog", "a king", "the queen", "a fool"]
    places = ["the mat", "a hat", "the throne", "the stage", "a ship"]
    texts = [f"{s} sat on {p}, and {p} was under {s}." for s in subjects for p in places]
    return Dataset.from_dict({"text": texts * 4})


def test_sft_config_keeps_trl_defaults_and_validates_hybrid_flags(tmp_path):
    trl, HybridSFTConfig, _ = _sft_classes()
    config = HybridSFTConfig(output_dir=str(tmp_path), use_cpu=True)
    plain = trl.SFTConfig(output_dir=str(tmp_path), use_cpu=True)
    assert isinstance(config, HybridTrainingArguments)
    assert (config.learning_rate, config.logging_steps) == (plain.learning_rate, plain.logging_steps)
    assert config.hybrid_warmup_steps == 100
    with pytest.raises(ValueError, match="hybrid_full_steps"):
        HybridSFTConfig(output_dir=str(tmp_path), use_cpu=True, hybrid_full_steps=0)


def test_sft_trainer_with_mixin_predicts_and_skips_the_optimizer(tmp_path):
    _, HybridSFTConfig, HybridSFTTrainer = _sft_classes()
    from hf_hybrid.data import load_shipped_tokenizer

    tokenizer = load_shipped_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=32, n_embd=16, n_layer=1, n_head=2,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    # TRL's own defaults stay on (gradient checkpointing); two micro-batches per step take SFTTrainer's
    # num_items_in_batch loss path, which the no-grad checking forward of a Predict step must scale alike.
    args = HybridSFTConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=3e-3, max_steps=24, logging_steps=4, save_strategy="no", report_to="none", use_cpu=True,
        disable_tqdm=True, seed=0, bf16=False, max_length=32, **FAST_SCHEDULE,
    )
    assert args.gradient_checkpointing
    trainer = HybridSFTTrainer(model=model, args=args, train_dataset=_sft_text(), processing_class=tokenizer)
    counter = OptimizerStepCounter()
    trainer.add_callback(counter)
    trainer.train()

    stats = trainer.hybrid_stats()
    assert stats["predict_steps"] >= 4
    assert stats["backward_steps"] + stats["predict_steps"] == trainer.state.global_step == 24
    assert_optimizer_ran_only_on_real_steps(trainer, counter)
    assert torch.isfinite(flat_params(model)).all()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    # Per optimizer step (trace): a checked predicted loss is on the scale of the real loss just before it.
    rows = [json.loads(line) for line in (tmp_path / "out" / "hybrid_trace.jsonl").read_text().splitlines()]
    checked = [(prev, row) for prev, row in zip(rows, rows[1:]) if row["phase"] == Phase.PREDICT.value
               and row["loss"] is not None and prev["phase"] != Phase.PREDICT.value]
    assert checked
    for prev, row in checked:
        assert abs(row["loss"] - prev["loss"]) < 0.5, (prev, row)


def _preference_pairs() -> Dataset:
    """DPO's kind of data: a prompt, and a completion preferred over another."""
    subjects = ["the cat", "the dog", "a king", "the queen", "a fool"]
    places = ["the mat", "a hat", "the throne", "the stage", "a ship"]
    rows = [{"prompt": f"{s} sat on", "chosen": f" {p}, and it was glad.", "rejected": f" {p} {p} {p} {p}."}
            for s in subjects for p in places]
    return Dataset.from_list(rows * 4)


def _desirability() -> Dataset:
    """KTO's kind of data: a prompt and a completion, labelled desirable or not."""
    rows = [{"prompt": row["prompt"], "completion": row[side], "label": side == "chosen"}
            for row in _preference_pairs() for side in ("chosen", "rejected")]
    return Dataset.from_list(rows)


TRL_KINDS = {"sft": "SFT", "dpo": "DPO", "kto": "KTO", "reward": "Reward"}


def _trl_run(tmp_path, kind: str, hybrid: bool, **overrides):
    """A tiny GPT-2 through one of TRL's offline trainers, with the hybrid's defaults or as TRL's own class."""
    trl = pytest.importorskip("trl")
    import hf_hybrid
    from hf_hybrid.data import load_shipped_tokenizer

    tokenizer = load_shipped_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=32, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    model = GPT2ForSequenceClassification(config) if kind == "reward" else GPT2LMHeadModel(config)
    name = TRL_KINDS[kind]
    config_class = getattr(hf_hybrid, f"Hybrid{name}Config") if hybrid else getattr(trl, f"{name}Config")
    trainer_class = getattr(hf_hybrid, f"Hybrid{name}Trainer") if hybrid else getattr(trl, f"{name}Trainer")
    settings = dict(output_dir=str(tmp_path / f"{kind}-{hybrid}"), per_device_train_batch_size=4, max_steps=24,
                    logging_steps=4, save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True, seed=0,
                    bf16=False, max_length=32)
    args = config_class(**{**settings, **overrides})
    if kind in ("sft", "reward"):
        data = _sft_text() if kind == "sft" else _preference_pairs()
        return trainer_class(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    data = _preference_pairs() if kind == "dpo" else _desirability()
    return trainer_class(model=model, ref_model=copy.deepcopy(model), args=args, train_dataset=data,
                         processing_class=tokenizer)


@pytest.mark.parametrize("kind", list(TRL_KINDS))
def test_trls_token_count_is_its_own_trainers_under_the_hybrid(tmp_path, kind):
    # The autopilot reads the probe batch along the next step every few steps, through the same compute_loss in
    # which TRL counts the tokens trained on: those forwards must not count. DPO's compute_loss also runs a second
    # forward, and warns, wherever a caller asks for its outputs, which the probe has no use for in DPO.
    plain = _trl_run(tmp_path, kind, hybrid=False, learning_rate=1e-4)
    plain.train()
    hybrid = _trl_run(tmp_path, kind, hybrid=True, learning_rate=1e-4)
    before = flat_params(hybrid.model).clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hybrid.train()
    assert hybrid.hybrid_stats()["lr_readings"] >= 1
    assert not torch.equal(flat_params(hybrid.model), before)
    assert not [w for w in caught if "return_outputs" in str(w.message)]
    counted = [[h["num_tokens"] for h in run.state.log_history if "num_tokens" in h] for run in (plain, hybrid)]
    assert len(counted[0]) == 6 and counted[1] == counted[0]


@pytest.mark.parametrize("kind", list(TRL_KINDS))
def test_a_probe_forward_leaves_trls_metrics_as_they_were(tmp_path, kind):
    from hf_hybrid.loop.forward_checks import probe_loss, probe_loss_by_sequence

    trainer = _trl_run(tmp_path, kind, hybrid=True, max_steps=4)
    trainer.train()
    batch = trainer.prepare_inputs(next(iter(trainer.get_train_dataloader())))
    trainer.compute_loss(trainer.model, dict(batch))  # something recorded, as at a training step

    def recorded():
        return trainer._total_train_tokens, {key: list(values) for key, values in trainer._metrics["train"].items()}

    kept = recorded()
    probe_loss(trainer, trainer.model, batch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss, rows = probe_loss_by_sequence(trainer, trainer.model, batch)
    assert recorded() == kept
    # No second forward to return the logits (TRL warns where one runs): SFT's rows come from its fused LM head's
    # output, and split its loss by sequence; DPO's pairs carry no labels and are not split.
    assert not [w for w in caught if "return_outputs" in str(w.message)]
    if kind == "sft":
        counts = (batch["labels"][:, 1:] != -100).sum(1)
        assert float((rows * counts).sum() / counts.sum()) == pytest.approx(float(loss), rel=1e-5)
    else:
        assert rows is None
    trainer.compute_loss(trainer.model, dict(batch))
    assert recorded() != kept  # what a training step records, TRL records


def test_a_batch_trained_again_after_an_undone_raise_counts_its_tokens_once(tmp_path, monkeypatch):
    """Every raise fails its trial and every jump is rejected: the undone updates train again on their own batches,
    and both token counts, TRL's and the Trainer's, end on `SFTTrainer`'s, as the weights do."""
    from .test_lr_undo import fail_every_trial_and_jump

    fail_every_trial_and_jump(monkeypatch)
    settings = dict(learning_rate=1e-4, max_steps=60, include_num_input_tokens_seen=True)
    plain = _trl_run(tmp_path, "sft", hybrid=False, **settings)
    plain.train()
    hybrid = _trl_run(tmp_path, "sft", hybrid=True, **settings)
    hybrid.train()
    assert hybrid.hybrid_stats()["lr_trials_undone"] >= 1
    assert torch.equal(flat_params(hybrid.model), flat_params(plain.model))
    assert hybrid._total_train_tokens == plain._total_train_tokens
    assert hybrid.state.num_input_tokens_seen == plain.state.num_input_tokens_seen > 0
