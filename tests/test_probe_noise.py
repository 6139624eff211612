"""The probe's noise margin: a jump is kept only if its gain beats plain training's by more than the gain's standard
error over the probe's sequences, read from the same forwards as the gain."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import GPT2Config, GPT2ForSequenceClassification, T5Config, T5ForConditionalGeneration

from hf_hybrid.jumps.payoff import PayoffMeter
from hf_hybrid.jumps.predict_step import paired_noise
from hf_hybrid.loop.forward_checks import probe_loss, probe_loss_by_sequence, sequence_losses

from .conftest import BLOCK, VOCAB, make_trainer, tiny_gpt2


def classifier_head(num_labels: int) -> GPT2ForSequenceClassification:
    torch.manual_seed(0)
    return GPT2ForSequenceClassification(GPT2Config(vocab_size=VOCAB, n_positions=BLOCK, n_embd=32, n_layer=1,
                                                    n_head=2, pad_token_id=0, num_labels=num_labels))


def test_sequence_losses_split_the_models_own_loss_by_sequence():
    model = tiny_gpt2(seed=1)
    ids = torch.randint(0, VOCAB, (4, BLOCK), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[1, 5:] = -100  # a padded sequence counts only its own tokens
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels)
    rows = sequence_losses(out.logits, labels)
    counts = (labels[:, 1:] != -100).sum(1)
    assert rows.shape == (4,)
    assert float((rows * counts).sum() / counts.sum()) == pytest.approx(float(out.loss), rel=1e-5)
    assert sequence_losses(out.logits[:, 0], labels) is None  # not (batch, length, vocabulary)
    assert sequence_losses(out.logits, None) is None


def test_probe_losses_by_sequence_for_a_causal_lm_a_classifier_and_an_encoder_decoder_and_none_for_regression(tmp_out):
    trainer = make_trainer(tmp_out, model=tiny_gpt2(dropout=0.1))
    batch = {"input_ids": torch.arange(2 * BLOCK).view(2, BLOCK) % VOCAB}
    batch["labels"] = batch["input_ids"].clone()
    loss, rows = probe_loss_by_sequence(trainer, trainer.model, batch)
    assert float(loss) == float(probe_loss(trainer, trainer.model, batch))  # the same masks: a paired forward
    assert rows.shape == (2,) and float(rows.mean()) == pytest.approx(float(loss), rel=1e-5)

    classifier = make_trainer(tmp_out, model=classifier_head(3))
    labels = torch.tensor([0, 2])
    loss, rows = probe_loss_by_sequence(classifier, classifier.model, {"input_ids": batch["input_ids"],
                                                                       "labels": labels})
    assert rows.shape == (2,) and float(rows.mean()) == pytest.approx(float(loss), rel=1e-5)
    assert float(rows[0]) != pytest.approx(float(rows[1]))  # each example's own, not the mean twice

    torch.manual_seed(0)
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=1, num_heads=2,
                                             decoder_start_token_id=0, pad_token_id=0))
    encoder_decoder = make_trainer(tmp_out, model=t5)
    targets = batch["labels"].clone()
    targets[1, 5:] = -100
    loss, rows = probe_loss_by_sequence(encoder_decoder, encoder_decoder.model, {"input_ids": batch["input_ids"],
                                                                                 "labels": targets})
    counts = (targets != -100).sum(1)  # its labels are the decoder's targets as they stand: no shift
    assert float((rows * counts).sum() / counts.sum()) == pytest.approx(float(loss), rel=1e-5)

    regression = make_trainer(tmp_out, model=classifier_head(1))
    loss, rows = probe_loss_by_sequence(regression, regression.model, {"input_ids": batch["input_ids"],
                                                                       "labels": torch.tensor([0.5, -1.0])})
    assert rows is None and math.isfinite(float(loss))


def test_a_lora_wrapped_classifier_is_split_by_example_too(tmp_out):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(classifier_head(2), LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["c_attn"],
                                                          fan_in_fan_out=True))
    trainer = make_trainer(tmp_out, model=model)
    batch = {"input_ids": torch.arange(3 * BLOCK).view(3, BLOCK) % VOCAB, "labels": torch.tensor([0, 1, 1])}
    loss, rows = probe_loss_by_sequence(trainer, trainer.model, batch)
    assert rows.shape == (3,) and float(rows.mean()) == pytest.approx(float(loss), rel=1e-5)


def test_a_gain_within_its_noise_is_rejected_and_one_beyond_it_kept():
    def verdict(gain: float, noise: float, margin: float = 2.0) -> bool:
        meter = PayoffMeter(forward_cost=0.35, noise_margin=margin)
        meter.begin_prediction()  # no history: plain training's required gain is 0
        return meter.verdict(gain, noise)

    # Run 130's kept jump on cpu-lora at 3x the swept LR: a gain of 0.0035, 0.0029 its standard error.
    assert verdict(0.0035, 0.0029) is False
    assert verdict(0.0035, 0.0029, margin=0.0) is True  # the verdict before the margin
    assert verdict(0.05, 0.01) is True
    assert verdict(0.05, float("nan")) is False


def test_paired_noise_is_the_standard_error_of_the_sequences_gains(tmp_out):
    trainer = make_trainer(tmp_out)
    before, after = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([0.9, 1.7, 2.9, 3.5])
    gains = before - after
    assert paired_noise(trainer, before, after) == pytest.approx(float(gains.std() / 2), rel=1e-5)
    assert paired_noise(trainer, None, after) == 0.0


def test_the_open_jumps_sequence_losses_are_checkpointed(tmp_out):
    trainer = make_trainer(tmp_out)
    trainer.train()
    engine = trainer._hybrid
    engine.probe, engine.probe_loss = {"input_ids": torch.zeros(2, BLOCK, dtype=torch.long)}, 3.0
    engine.probe_rows = torch.tensor([2.5, 3.5])
    state = engine.state_dict()
    engine.probe = engine.probe_loss = engine.probe_rows = None
    engine.load_state_dict(state)
    assert torch.equal(engine.probe_rows, torch.tensor([2.5, 3.5])) and engine.probe_loss == 3.0
