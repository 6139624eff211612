"""The architectures most users now train (Llama, Qwen3, Gemma2: RMSNorm, rotary positions, gated MLPs,
grouped-query attention; Gemma2's logit soft-capping): what holds for GPT-2 holds for them."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

from hf_hybrid import HybridHFTrainer, HybridTrainingArguments
from hf_hybrid.jumps.engine import HybridEngine

from .conftest import BLOCK, VOCAB, flat_params, hybrid_args, reject_every_jump, token_dataset

ARCHITECTURES = ["llama", "qwen3", "gemma2"]


def tiny_model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model(kind, vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                  max_position_embeddings=BLOCK, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return AutoModelForCausalLM.from_config(config)


def trainers_weights(tmp_path, kind: str, **overrides) -> torch.Tensor:
    model = tiny_model(kind)
    args = TrainingArguments(output_dir=str(tmp_path / "trainer"), per_device_train_batch_size=8, learning_rate=3e-3,
                             max_steps=40, report_to="none", seed=0, data_seed=0, use_cpu=True, disable_tqdm=True,
                             save_strategy="no", **overrides)
    Trainer(model=model, args=args, train_dataset=token_dataset()).train()
    return flat_params(model)


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_with_the_hybrid_off_it_is_the_trainer_bit_for_bit(tmp_path, kind):
    model = tiny_model(kind)
    HybridHFTrainer(model=model, args=hybrid_args(tmp_path / "hybrid", hybrid=False),
                    train_dataset=token_dataset()).train()
    assert torch.equal(flat_params(model), trainers_weights(tmp_path, kind))


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_every_jump_rolled_back_ends_on_the_trainers_weights_and_the_probe_is_split_by_sequence(tmp_path, kind,
                                                                                                  monkeypatch):
    """Gradient checkpointing on, as fine-tunes of these models usually run: the side forwards and the replayed
    batches go through its recomputation too."""
    reject_every_jump(monkeypatch)
    rows = []
    set_probe = HybridEngine.set_probe
    monkeypatch.setattr(HybridEngine, "set_probe",
                        lambda engine, inputs, loss, probe_rows: rows.append(probe_rows) or set_probe(
                            engine, inputs, loss, probe_rows))
    model = tiny_model(kind)
    trainer = HybridHFTrainer(model=model, args=hybrid_args(tmp_path / "hybrid", hybrid_payoff_check=True,
                                                            hybrid_lr_autopilot=False, gradient_checkpointing=True),
                              train_dataset=token_dataset())
    trainer.train()
    stats = trainer.hybrid_stats()
    assert stats["predict_steps"] > 0 and stats["rollbacks"] > 0
    assert torch.equal(flat_params(model), trainers_weights(tmp_path, kind, gradient_checkpointing=True))
    # Each probe sequence's loss was read (forward_checks.sequence_losses), which gives the verdicts a noise margin.
    assert rows and all(r is not None and r.shape == (8,) for r in rows)


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_at_a_learning_rate_far_too_low_the_autopilot_raises_it_and_the_run_ends_lower(tmp_path, kind):
    def final_loss(model: torch.nn.Module) -> float:
        with torch.no_grad():
            ids = torch.tensor(token_dataset(64, seed=1)["input_ids"])
            return model(input_ids=ids, labels=ids).loss.item()

    def run(hybrid: bool) -> torch.nn.Module:
        model = tiny_model(kind)
        args = HybridTrainingArguments(output_dir=str(tmp_path / str(hybrid)), hybrid=hybrid,
                                       per_device_train_batch_size=8, learning_rate=1e-4, max_steps=150,
                                       report_to="none", seed=0, data_seed=0, use_cpu=True, disable_tqdm=True,
                                       save_strategy="no")
        trainer = HybridHFTrainer(model=model, args=args, train_dataset=token_dataset())
        trainer.train()
        assert not hybrid or trainer.hybrid_stats()["lr_scale"] > 1
        return model

    assert final_loss(run(hybrid=True)) < final_loss(run(hybrid=False)) - 0.1
