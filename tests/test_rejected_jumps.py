"""After rejected jumps: training is the Trainer's bit for bit, the steps they took are made up or reported, and
repeated rejections retire prediction."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import TrainerCallback

from hf_hybrid import Phase
from hf_hybrid.jumps.engine import StepRecord
from hf_hybrid.jumps.setup import build_engine

from .conftest import flat_params, make_trainer, reject_every_jump, tiny_gpt2, token_dataset
from .test_predict import StepRecorder, train_recorded
from .test_safety import sabotage_fifth_predicted_step


class WeightsPerStep(TrainerCallback):
    def __init__(self) -> None:
        self.params = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.params.append(flat_params(model))


def dropout_gpt2() -> torch.nn.Module:
    return tiny_gpt2(dropout=0.1)


@pytest.mark.parametrize("model, examples, evaluations, streamed",
                         [(dropout_gpt2, 1024, False, False), (tiny_gpt2, 512, False, False),
                          (dropout_gpt2, 512, False, False), (dropout_gpt2, 512, True, False),
                          (dropout_gpt2, 512, False, True)],
                         ids=["dropout", "two-epochs", "dropout-two-epochs", "dropout-two-epochs-evaluated",
                              "dropout-two-epochs-iterable"])
def test_after_rejected_jumps_training_is_the_trainers_bit_for_bit(tmp_path, monkeypatch, model, examples,
                                                                    evaluations, streamed):
    """With every jump rejected, the hybrid's n-th real step ends at the plain Trainer's n-th step's weights, bit
    for bit, under a decaying learning rate: nothing leaks past a rollback (weights, optimizer state, dropout RNG,
    schedule), the rolled-back jump's batches are trained on next, in the Trainer's order, and the steps it undid
    are added to max_steps, so the run ends at the Trainer's final weights.

    Two runs cross into a second epoch (64 batches each) with replayed batches still queued. The hybrid reaches the
    epoch's end at an earlier real step, and each epoch's DataLoader iterator draws its seed from the global RNG,
    which on CPU is also the dropout RNG: with dropout, the masks match only because that draw is deferred to the
    real step where the Trainer makes it (loop/epoch_seed.py). So is each evaluation's: the hybrid evaluates at global
    steps that its made-up steps brought earlier in real steps (eval_seed.py). `streamed`: the data as an
    `IterableDataset` (`datasets`' `to_iterable_dataset`, as a streamed corpus comes), which the Trainer reads in order
    with no sampler and starts again at its end."""

    def data():
        dataset = token_dataset(examples)
        return dataset.to_iterable_dataset(num_shards=1) if streamed else dataset

    plain = WeightsPerStep()
    # Room for 28 more steps in the last epoch. The Trainer's token count: a Predict step's batches count once trained.
    settings = dict(max_steps=100, lr_scheduler_type="linear", include_num_input_tokens_seen=True)
    if evaluations:
        settings.update(eval_strategy="steps", eval_steps=10)
    evaluation = token_dataset(16, seed=1) if evaluations else None
    reference = make_trainer(tmp_path / "plain", model=model(), dataset=data(),
                             eval_dataset=evaluation, hybrid=False, **settings)
    reference.add_callback(plain)
    reference.train()

    reject_every_jump(monkeypatch)
    recorder = StepRecorder()
    # The learning-rate autopilot off: a kept raise is meant to leave the Trainer's trajectory (test_lr_autopilot.py).
    trainer = make_trainer(tmp_path / "hybrid", model=model(), dataset=data(), eval_dataset=evaluation,
                           hybrid_payoff_check=True, hybrid_max_rejections=3, hybrid_lr_autopilot=False, **settings)
    trainer.add_callback(recorder)
    recorder.trainer = trainer
    trainer.train()
    stats = trainer.hybrid_stats()
    assert stats["predictions_judged"] == 3 and stats["predictions_kept"] == 0
    assert stats["undone_steps"] == stats["predict_steps"] > 0
    assert trainer.state.global_step == 100 + stats["undone_steps"]
    real = [r["params"] for r in recorder.rows if r["phase"] is not Phase.PREDICT]
    assert len(real) == stats["backward_steps"] == 100
    for n, params in enumerate(real):
        assert torch.equal(params, plain.params[n]), f"real step {n + 1} differs from the Trainer's"
    assert trainer.state.num_input_tokens_seen == reference.state.num_input_tokens_seen == 100 * 8 * 16


def test_a_jump_open_at_the_last_step_is_judged_there_and_made_up(tmp_path, monkeypatch):
    """max_steps ends inside a Predict phase: the probe is judged at the last step rather than the jump undone
    after training, and its rejection makes the step up before the Trainer decides to stop, so the run still ends
    at the Trainer's final weights."""
    reject_every_jump(monkeypatch)
    settings = dict(lr_scheduler_type="constant", hybrid_payoff_check=True)  # max_steps changes nothing before it
    _, rows = train_recorded(tmp_path / "long", max_steps=60, **settings)
    first_predict = next(i for i, r in enumerate(rows) if r["phase"] is Phase.PREDICT)
    assert rows[first_predict + 1]["phase"] is Phase.PREDICT  # a jump of two steps or more
    last = first_predict + 1  # global step of the jump's first predicted step

    trainer = make_trainer(tmp_path / "short", max_steps=last, **settings)
    trainer.train()
    stats = trainer.hybrid_stats()
    assert stats["predictions_judged"] == 1 and stats["undone_steps"] == 1
    assert trainer.state.global_step == last + 1 and stats["backward_steps"] == last
    reference = make_trainer(tmp_path / "plain", hybrid=False, max_steps=last, **settings)
    reference.train()
    assert torch.equal(flat_params(trainer.model), flat_params(reference.model))


def test_steps_that_cannot_be_made_up_are_reported(tmp_path, monkeypatch, caplog):
    """An epoch-based run has no room after its last epoch: max_steps stays where the loop ends (so the final
    save and eval still happen), and a warning names the steps that were not made up."""
    reject_every_jump(monkeypatch)
    trainer = make_trainer(tmp_path, hybrid_payoff_check=True, max_steps=-1, num_train_epochs=1)
    with caplog.at_level("WARNING", logger="hf_hybrid.trainer"):
        trainer.train()
    undone = trainer.hybrid_stats()["undone_steps"]
    assert undone > 0 and trainer.state.global_step == trainer.state.max_steps == 64
    assert trainer.hybrid_stats()["backward_steps"] == 64 - undone
    # One line at the first step lost, and the total at the end where more followed (one per rollback before).
    assert caplog.text.count("cannot be made up") == 1 and "fewer real updates than the Trainer would" in caplog.text
    first = int(re.search(r"(\d+) optimizer steps? undone or skipped \(", caplog.text).group(1))
    total = re.findall(r"in all, (\d+) optimizer steps? undone or skipped could not be made up", caplog.text)
    assert trainer.hybrid_stats()["rollbacks"] > 1 and first < undone and total == [str(undone)]
    assert trainer.hybrid_stats()["steps_not_made_up"] == undone and "plain Trainer's steps" not in caplog.text


def test_without_payoff_check_survived_jumps_undo_the_back_off(tmp_out, monkeypatch):
    sabotage_fifth_predicted_step(monkeypatch)
    trainer = make_trainer(tmp_out, hybrid_loss_band=3.0, max_steps=60)
    trainer.train()
    controller = trainer._hybrid.controller
    assert controller.rollbacks >= 1
    assert controller.backoff < controller.rollbacks  # each rollback doubled the wait; later survivors halved it


def test_repeated_rejections_retire_prediction_and_give_back_its_buffers(tmp_path, monkeypatch):
    """Three rejected jumps in a row: no Predict step after the third, no more loss-forecast work, the velocity
    and snapshot buffers freed, and a resumed engine stays retired."""
    reject_every_jump(monkeypatch)
    # The autopilot off: its readings would pass turns to jump on this model (a short line) instead of rejecting them.
    trainer, rows = train_recorded(tmp_path, hybrid_payoff_check=True, max_steps=120, hybrid_max_rejections=3,
                                   hybrid_lr_autopilot=False)
    rollbacks = [i for i, r in enumerate(rows) if r["rollback"]]
    assert len(rollbacks) == 3
    assert all(r["phase"] is not Phase.PREDICT for r in rows[rollbacks[-1] + 1:])
    assert len(rows) - rollbacks[-1] > 30  # a long stretch that would have held a fourth attempt
    engine = trainer._hybrid
    assert engine.controller.retired and engine.log_metrics()["hybrid/retired"] == 1.0
    assert engine.predictor.velocity == [] and engine.snapshot.tensors is None and engine._before_step is None
    real_steps = sum(1 for r in rows if r["phase"] is not Phase.PREDICT)
    assert engine.dynamics.steps < real_steps - 30  # it stopped observing at the retirement
    resumed = build_engine(trainer)
    resumed.load_state_dict(engine.state_dict())
    assert resumed.controller.retired and resumed.predictor.velocity == []
    # A first Correct step vetoed by a NaN under the fp16 GradScaler still calls the pre-step hook: it must not
    # reach for the freed buffers.
    engine.record = StepRecord(step=0, phase=Phase.CORRECT, rollback=True)
    engine.before_optimizer_step(1e-3)
    assert engine._before_step is None and engine._predicted is None

    trainer, rows = train_recorded(tmp_path / "never", hybrid_payoff_check=True, max_steps=120,
                                   hybrid_max_rejections=0, hybrid_lr_autopilot=False)
    assert sum(r["rollback"] for r in rows) >= 4
