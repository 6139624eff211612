"""Predict steps: the weights really move, backward and the optimizer really are skipped."""

from __future__ import annotations

import torch
from transformers import TrainerCallback

from hf_hybrid import Phase

from .conftest import flat_params, make_trainer


class StepRecorder(TrainerCallback):
    """Per optimizer step: its phase, whether any gradient existed, AdamW's step count, the weights."""

    def __init__(self) -> None:
        self.trainer = None
        self.rows = []
        self._had_grad = None
        self.optimizer_calls = 0

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        # AdamW's own `step` count cannot show a skipped step (it ignores parameters without .grad); count calls.
        optimizer.optimizer.register_step_post_hook(self._count)

    def _count(self, optimizer, args, kwargs):
        self.optimizer_calls += 1

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self._had_grad = any(p.grad is not None for p in model.parameters())

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        engine = self.trainer._hybrid
        first = next(iter(optimizer.optimizer.state.values()), {})
        self.rows.append({
            "phase": engine.last_record.phase,
            "had_grad": self._had_grad,
            "adam_step": float(first.get("step", 0)),
            "optimizer_calls": self.optimizer_calls,
            "params": flat_params(model),
            "rollback": engine.last_record.rollback,
        })


def train_recorded(tmp_out, **overrides):
    recorder = StepRecorder()
    trainer = make_trainer(tmp_out, **overrides)
    trainer.add_callback(recorder)
    recorder.trainer = trainer
    trainer.train()
    return trainer, recorder.rows


def kept_predicted_steps(rows: list[dict]) -> list[int]:
    """Indices of the Predict steps that were not rolled back, each checked against the step before it: the weights
    moved and stayed finite, no backward ran, the optimizer did not step."""
    kept = [i for i, r in enumerate(rows) if r["phase"] is Phase.PREDICT and not r["rollback"]]
    for i in kept:
        prev, row = rows[i - 1], rows[i]
        assert not torch.equal(prev["params"], row["params"]), "a predicted step must change the weights"
        assert torch.isfinite(row["params"]).all()
        assert row["had_grad"] is False, "no backward may run on a predicted step"
        assert row["adam_step"] == prev["adam_step"], "the optimizer must not step on a predicted step"
        assert row["optimizer_calls"] == prev["optimizer_calls"], "optimizer.step() ran on a predicted step"
    return kept


def test_predict_moves_weights_without_backward_or_optimizer(tmp_out):
    trainer, rows = train_recorded(tmp_out)
    assert len(kept_predicted_steps(rows)) >= 5
    for i, row in enumerate(rows[1:], start=1):
        if row["phase"] is not Phase.PREDICT:
            assert row["had_grad"] is True
            assert row["adam_step"] == rows[i - 1]["adam_step"] + 1
            assert row["optimizer_calls"] == rows[i - 1]["optimizer_calls"] + 1
    stats = trainer.hybrid_stats()
    assert stats["predict_steps"] == sum(r["phase"] is Phase.PREDICT for r in rows)
    assert stats["backward_steps"] + stats["predict_steps"] == trainer.state.global_step
    assert abs(stats["backward_reduction"] - stats["predict_steps"] / trainer.state.global_step) < 1e-12


def test_optimizer_state_counts_only_real_steps(tmp_out):
    trainer, rows = train_recorded(tmp_out, hybrid_predictor="adam")
    stats = trainer.hybrid_stats()
    assert len(kept_predicted_steps(rows)) >= 5
    assert rows[-1]["optimizer_calls"] == stats["backward_steps"]
    opt = trainer.optimizer.optimizer
    for state in opt.state.values():
        assert float(state["step"]) == stats["backward_steps"]


def test_gradient_accumulation_predicts_per_optimizer_step(tmp_out):
    trainer, rows = train_recorded(tmp_out, gradient_accumulation_steps=3, per_device_train_batch_size=4,
                                   max_steps=30)
    stats = trainer.hybrid_stats()
    assert len(rows) == trainer.state.global_step == 30
    assert len(kept_predicted_steps(rows)) >= 5  # weights moved; no backward on any micro-batch, no step()
    assert float(next(iter(trainer.optimizer.optimizer.state.values()))["step"]) == stats["backward_steps"]


def test_logs_carry_numeric_hybrid_metrics(tmp_out):
    trainer, _ = train_recorded(tmp_out)
    train_logs = [h for h in trainer.state.log_history if "loss" in h]
    assert train_logs and all(isinstance(h["hybrid/phase"], float) for h in train_logs)
    keys = set().union(*train_logs)
    assert {"hybrid/confidence", "hybrid/backward_reduction", "hybrid/rollbacks", "hybrid/divergences"} <= keys
    trace = (tmp_out / "hybrid_trace.jsonl").read_text().splitlines()
    assert len(trace) == trainer.state.global_step


def test_updates_are_measured_only_in_the_window_before_a_prediction(tmp_out, monkeypatch):
    # The tiny model reads aligned at 3e-3 (autopilot/alignment.py), where a raise would move the steps counted here.
    monkeypatch.setattr("hf_hybrid.autopilot.alignment.ALIGNED", float("inf"))
    from hf_hybrid.jumps.predictors.velocity import VelocityPredictor

    trainer = None
    observed, restarts = [], []

    def observe(self, updates, lr):
        observed.append(trainer._hybrid.record.step)
        original_observe(self, updates, lr)

    def restart(self):
        restarts.append(trainer._hybrid.record.step)
        original_restart(self)

    original_observe, original_restart = VelocityPredictor.observe, VelocityPredictor.restart
    monkeypatch.setattr(VelocityPredictor, "observe", observe)
    monkeypatch.setattr(VelocityPredictor, "restart", restart)
    recorder = StepRecorder()
    # beta 0.9: a 20-step window. Warmup 60 then Full 3: the first prediction can start at step 63.
    # Without the autopilot: after a raise its readings pass the turns of predictions whose steps read long enough.
    trainer = make_trainer(tmp_out, hybrid_warmup_steps=60, hybrid_velocity_beta=0.9, max_steps=90,
                           hybrid_lr_autopilot=False)
    trainer.add_callback(recorder)
    recorder.trainer = trainer
    trainer.train()
    real_steps = [i for i, r in enumerate(recorder.rows) if r["phase"] is not Phase.PREDICT]
    assert restarts == [43]
    assert observed == [i for i in real_steps if i >= 43]
    assert trainer.hybrid_stats()["predict_steps"] > 0
