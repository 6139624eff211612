"""The learning-rate autopilot: a judged, reversible multiplier on the user's schedule (lr_scale.py,
lr_autopilot.py)."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from transformers import TrainerCallback

from hf_hybrid import HybridHFTrainer
from hf_hybrid.lr_scale import LrScale, reach_of_line

from .conftest import hybrid_args, make_trainer, tiny_gpt2, token_dataset
from .test_equivalence_resume import assert_bit_identical, state
from .test_lr_advice import OUTER


def parabola(bottom: float, depth: float = 1.0) -> tuple[float, float, float]:
    """Probe losses at 0, 1, 2 of a parabola whose minimum is at `bottom`."""
    return tuple(depth * (c - bottom) ** 2 for c in (0.0, 1.0, 2.0))


def test_the_reach_is_where_the_line_bottoms_out():
    assert reach_of_line(*parabola(3.0)) == pytest.approx(3.0)
    assert reach_of_line(*parabola(0.8)) == pytest.approx(0.8)
    assert reach_of_line(3.0, 2.0, 1.0) == math.inf  # still falling, no curvature
    assert reach_of_line(1.0, 1.5, 3.0) == 0.0  # rose from the start
    assert reach_of_line(1.0, float("nan"), 0.5) == 0.0


def test_a_raise_is_a_trial_kept_when_its_steps_make_more_progress():
    s = LrScale()
    assert s.cycle(*parabola(3.0), steps=10, decayed=False) == "raise"
    assert s.scale == 2.0 and s.on_trial
    rate_before = s.trial_rate
    f0, f1, f2 = parabola(1.0)  # at the new scale the cycle ends at its line's bottom, with 0.6x the progress
    less = 0.6 * rate_before * 10 / (f0 - f1)
    assert s.cycle(f0 * less, f1 * less, f2 * less, steps=10, decayed=False) == "keep"
    assert s.scale == 2.0 and not s.on_trial and s.raises_kept == 1


def test_a_raise_whose_line_overshoots_is_undone():
    s = LrScale()
    s.cycle(*parabola(3.0), steps=10, decayed=False)
    f0, f1, f2 = parabola(0.55, depth=100.0)  # plenty of progress, past the line's bottom
    assert s.cycle(f0, f1, f2, steps=10, decayed=False) == "undo" and s.scale == 1.0


def test_a_raise_whose_steps_do_not_pay_is_undone_and_the_next_waits():
    s = LrScale()
    s.cycle(*parabola(3.0, depth=1.0), steps=10, decayed=False)
    assert s.cycle(*parabola(3.0, depth=0.4), steps=10, decayed=False) == "undo"  # 0.4x the progress per step
    assert s.scale == 1.0 and s.trials_undone == 1 and s.wait == 2
    assert s.cycle(*parabola(3.0), steps=10, decayed=False) is None  # backing off
    assert s.cycle(*parabola(3.0), steps=10, decayed=False) == "raise"


def test_the_scale_is_bounded_frozen_in_the_decay_and_lowered_on_overshoot():
    s = LrScale()
    for scale in (2.0, 4.0, 8.0, 10.0):  # max_raise, then max_scale
        s.trial_from = None
        assert s.cycle(*parabola(100.0), steps=10, decayed=False) == "raise" and s.scale == scale
    s.trial_from = None
    assert s.cycle(*parabola(100.0), steps=10, decayed=False) is None  # at the bound: no trial of 1x
    fresh = LrScale()
    assert fresh.cycle(*parabola(3.0), steps=10, decayed=True) is None and fresh.scale == 1.0
    assert s.cycle(*parabola(0.2), steps=10, decayed=False) == "lower" and s.scale == 5.0
    at_user_lr = LrScale()
    assert at_user_lr.cycle(*parabola(0.2), steps=10, decayed=False) is None and at_user_lr.scale == 1.0


def test_a_guard_rollback_ends_a_trial_and_never_goes_below_the_users_lr():
    s = LrScale()
    s.cycle(*parabola(4.0), steps=10, decayed=False)
    s.weights_damaged()
    assert s.scale == 1.0 and not s.on_trial and s.trials_undone == 1
    s.weights_damaged()
    assert s.scale == 1.0


def learning_rates(trainer) -> list[float]:
    return [entry["learning_rate"] for entry in trainer.state.log_history if "learning_rate" in entry]


def test_a_too_small_lr_is_raised_logged_and_named(tmp_out, caplog):
    trainer = make_trainer(tmp_out, learning_rate=1e-4, **{**OUTER, "logging_steps": 1})
    with caplog.at_level(logging.WARNING):
        trainer.train()
    scale = trainer._lr_autopilot.scale
    assert scale.scale > 2.0 and scale.raises_kept >= 1
    logged = [entry["hybrid/lr_scale"] for entry in trainer.state.log_history if "hybrid/lr_scale" in entry]
    assert logged[0] == 1.0 and logged[-1] == scale.scale
    # The schedule carries the scale: its base LR is the user's times the scale, and the LRs in effect went above
    # the user's peak while keeping the schedule's shape (linear decay here: the run ends near 0).
    assert trainer.lr_scheduler.base_lrs == [pytest.approx(1e-4 * scale.scale)] * 2
    lrs = learning_rates(trainer)
    assert max(lrs) > 2e-4 and lrs[-1] < 1e-4 * scale.scale / 10
    raised = trainer._lr_autopilot.learning_rate
    assert f"raised the learning rate {scale.scale:.1f}x: 0.0001 -> {raised:.2g}" in caplog.text
    assert f"pass --learning_rate {raised:.2g} next time" in caplog.text
    assert "looks too small" not in caplog.text  # the autopilot's line says it


def test_the_flag_off_keeps_the_users_lr_exactly(tmp_out, caplog):
    trainer = make_trainer(tmp_out, learning_rate=1e-4, hybrid_lr_autopilot=False, **{**OUTER, "logging_steps": 1})
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert trainer._lr_autopilot is None
    assert max(learning_rates(trainer)) == 1e-4
    assert "--hybrid_lr_autopilot true" in caplog.text  # the too-small line names the flag


def test_without_the_guard_it_is_off_and_says_why(tmp_out, caplog):
    with caplog.at_level(logging.WARNING):
        trainer = make_trainer(tmp_out, learning_rate=1e-4, hybrid_guard=False, **{**OUTER, "max_steps": 30})
        trainer.train()
    assert trainer._lr_autopilot is None
    assert "the learning-rate autopilot is off for this run: it needs the guard's snapshots" in caplog.text


class WeightsAtEachStep(TrainerCallback):
    def __init__(self, model) -> None:
        self.model, self.weights = model, {}

    def on_step_begin(self, args, state, control, **kwargs):
        self.weights[state.global_step] = [p.detach().clone() for p in self.model.parameters()]


def test_an_undone_raise_puts_back_the_weights_before_its_first_update(tmp_out, monkeypatch):
    """Every raise fails its trial: right after the undo, the weights are bit for bit those before the first update
    at the raised scale, and the LR in effect is the user's schedule again."""
    original = LrScale.cycle
    undone_at = []

    def fail_every_trial(self, f0, f1, f2, steps, decayed):
        if self.on_trial:
            f0 = f1  # no progress at the raised scale
        return original(self, f0, f1, f2, steps, decayed)

    monkeypatch.setattr(LrScale, "cycle", fail_every_trial)
    model = tiny_gpt2()
    trainer = HybridHFTrainer(model=model, args=hybrid_args(tmp_out, learning_rate=1e-4, **OUTER),
                              train_dataset=token_dataset())
    weights = WeightsAtEachStep(model)
    trainer.add_callback(weights)

    class CheckUndo(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            autopilot = trainer._lr_autopilot
            if autopilot.scale.trials_undone > len(undone_at):
                snapshot_step = trainer._guard_loop.snapshot.step
                undone_at.append(snapshot_step)
                for p, before in zip(model.parameters(), weights.weights[snapshot_step]):
                    assert torch.equal(p, before)
                assert autopilot.scale.scale == 1.0
                scheduler = trainer.lr_scheduler
                assert scheduler.base_lrs[0] == 1e-4
                expected = 1e-4 * scheduler.lr_lambdas[0](scheduler.last_epoch)
                assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(expected, rel=1e-9)

    trainer.add_callback(CheckUndo())
    trainer.train()
    assert undone_at, "no raise was tried"
    assert trainer._hybrid.made_up_steps >= 5 * len(undone_at)  # a cycle's updates were undone each time


def test_resume_during_a_trial_is_bit_identical(tmp_path):
    settings = dict(OUTER, learning_rate=1e-4, max_steps=60, save_strategy="steps", save_steps=1)
    full_run = make_trainer(tmp_path / "full", **settings)
    trials = {}

    class TrialSteps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            trials[state.global_step] = full_run._lr_autopilot.scale.on_trial

    full_run.add_callback(TrialSteps())
    full_run.train()
    mid = next(step for step, on in trials.items() if on and trials.get(step - 1))
    resumed_model = tiny_gpt2(seed=123)
    resumed = HybridHFTrainer(model=resumed_model, args=hybrid_args(tmp_path / "resumed", **settings),
                              train_dataset=token_dataset())
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / f"checkpoint-{mid}"))
    assert_bit_identical(state(full_run.model), state(resumed_model))
    assert resumed._lr_autopilot.state_dict() == full_run._lr_autopilot.state_dict()
    assert resumed.hybrid_stats() == full_run.hybrid_stats()
