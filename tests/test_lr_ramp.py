"""A raise past MAX_ALIGNED_RAISE ramps in over RAMP_STEPS steps (autopilot/ramp.py), and its verdict reads the raise
as the ramped steps took it."""

from __future__ import annotations

import math
import statistics

import pytest

from hf_hybrid import HybridHFTrainer
from hf_hybrid.autopilot.line import SPACING
from hf_hybrid.autopilot.ramp import RAMP_STEPS, RaiseRamp

from .conftest import hybrid_args, make_trainer, tiny_gpt2, token_dataset
from .test_equivalence_resume import assert_bit_identical, state
from .test_lr_advice import OUTER

RUN = dict(OUTER, learning_rate=1e-5, lr_scheduler_type="constant", max_steps=40, logging_steps=1)


def test_a_large_raise_climbs_over_the_ramp_a_small_one_takes_effect_at_once():
    ramp = RaiseRamp()
    ramp.begin(10, before=1.0, raised=32.0)
    assert [ramp.in_effect(32.0, p) for p in range(9, 21)] == pytest.approx(
        [1.0] + [1.0 + 31.0 * k / RAMP_STEPS for k in range(1, 11)] + [32.0])
    assert [ramp.moving(32.0, p) for p in (9, 10, 19, 20)] == [False, True, True, False]
    # The steps since the undo point (before update 11) took the mean of what was in effect for them.
    assert ramp.mean_raise(1.0, 32.0, position=15, steps=5) == pytest.approx(1.0 + 31.0 * 0.3)
    assert ramp.mean_raise(1.0, 32.0, position=20, steps=10) == pytest.approx(1.0 + 31.0 * 0.55)
    assert ramp.in_effect(1.0, 12) == 1.0  # undone: the judged scale is back, and so is the scale in effect
    # A raise on top of a ramp under way starts from where the ramp is, even a small one.
    ramp.begin(15, before=32.0, raised=40.0)
    assert ramp.in_effect(40.0, 14) == pytest.approx(1.0 + 31.0 * 0.5)
    assert ramp.in_effect(40.0, 24) == 40.0
    small = RaiseRamp()
    small.begin(30, before=2.0, raised=8.0)  # 4x: MAX_ALIGNED_RAISE, at once
    assert small.in_effect(8.0, 30) == 8.0 and not small.moving(8.0, 30)
    assert small.mean_raise(2.0, 8.0, position=35, steps=5) == 4.0


def _strongly_aligned_run(monkeypatch, output_dir, **overrides) -> tuple[HybridHFTrainer, list[float]]:
    """Every run reads strongly aligned and every line 100 steps long: the first reading after the alignment's window
    (step 10) asks for the whole 32x cap. Each verdict keeps the raise and records the raise it was asked to judge."""
    for gate in ("ALIGNED", "STRONGLY_ALIGNED", "OPPOSED"):
        monkeypatch.setattr(f"hf_hybrid.autopilot.alignment.{gate}", -math.inf)
    monkeypatch.setattr("hf_hybrid.autopilot.scale.reach_of_line", lambda f0, f1, f2: 100.0 / SPACING)
    judged: list[float] = []

    def paid(trainer, model, shards, scratch, probe, undo_point, raise_, raised):
        judged.append(raise_)
        return 1.0, 0.0

    monkeypatch.setattr("hf_hybrid.autopilot.runner.raise_gain", paid)
    return make_trainer(output_dir, **RUN, **overrides), judged


def test_a_strongly_aligned_32x_raise_ramps_in_and_is_judged_as_taken(tmp_out, monkeypatch):
    trainer, judged = _strongly_aligned_run(monkeypatch, tmp_out)
    trainer.train()
    assert trainer._lr_autopilot.scale.scale == 32.0 and trainer._lr_autopilot.scale.raises_kept == 1
    lrs = [entry["learning_rate"] / 1e-5 for entry in trainer.state.log_history if "learning_rate" in entry]
    first = next(i for i, lr in enumerate(lrs) if lr > 1.0)  # the first step after the raise (a jump may delay it)
    assert first >= 10 and lrs[:first] == pytest.approx([1.0] * first)
    ramped = [1.0 + 31.0 * k / RAMP_STEPS for k in range(1, RAMP_STEPS + 1)]
    assert lrs[first:first + RAMP_STEPS] == pytest.approx(ramped)
    assert lrs[first + RAMP_STEPS:32] == pytest.approx([32.0] * (32 - first - RAMP_STEPS))  # the cooldown from 32 on
    # Judged a few steps on, over steps that went 4.1x, 7.2x, ... the user's LR: their mean, not 32x.
    taken = [statistics.fmean(lrs[first:first + n]) for n in range(1, RAMP_STEPS + 1)]
    assert len(judged) == 1 and any(judged[0] == pytest.approx(mean) for mean in taken)


def test_resume_inside_the_ramp_is_bit_identical(tmp_path, monkeypatch):
    settings = dict(save_strategy="steps", save_steps=13)
    full_run, _ = _strongly_aligned_run(monkeypatch, tmp_path / "full", **settings)
    full_run.train()
    resumed_model = tiny_gpt2()
    resumed = HybridHFTrainer(model=resumed_model, train_dataset=token_dataset(), args=hybrid_args(tmp_path / "resumed",
                                                                                              **RUN, **settings))
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-13"))
    assert resumed.hybrid_stats() == full_run.hybrid_stats()
    assert_bit_identical(state(full_run.model), state(resumed_model))
    assert resumed.lr_scheduler.get_last_lr() == full_run.lr_scheduler.get_last_lr()
