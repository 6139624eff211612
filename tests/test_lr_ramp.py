"""A raise past MAX_ALIGNED_RAISE ramps in over RAMP_STEPS steps (autopilot/ramp.py), and its verdict reads the raise
as the ramped steps took it."""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

import pytest

from hf_hybrid import HybridHFTrainer
from hf_hybrid.autopilot.line import SPACING
from hf_hybrid.autopilot.ramp import RAMP_STEPS, RaiseRamp
from hf_hybrid.autopilot.runner import RAISING_READ_EVERY
from hf_hybrid.autopilot.scale import LrScale

from .conftest import hybrid_args, tiny_gpt2, token_dataset
from .test_equivalence_resume import assert_bit_identical, state
from .test_lr_advice import OUTER

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from faults import FaultPlan, with_faults  # noqa: E402

RUN = dict(OUTER, learning_rate=1e-5, lr_scheduler_type="constant", max_steps=40, logging_steps=1)


def test_a_large_raise_climbs_over_the_ramp_a_small_one_takes_effect_at_once():
    ramp, last = RaiseRamp(), 10 + RAMP_STEPS - 1  # the ramp's last position
    ramp.begin(10, before=1.0, raised=32.0)
    climb = [1.0 + 31.0 * k / RAMP_STEPS for k in range(1, RAMP_STEPS + 1)]
    assert [ramp.in_effect(32.0, p) for p in range(9, last + 2)] == pytest.approx([1.0, *climb, 32.0])
    assert ramp.in_effect(32.0, last) == 32.0  # exactly, as an unramped run has it
    assert [ramp.moving(32.0, p) for p in (9, 10, last, last + 1)] == [False, True, True, False]
    assert [ramp.under_way(32.0, p) for p in (10, last - 1, last)] == [True, True, False]
    assert ramp.share(32.0, 11) == pytest.approx(climb[1] / 32.0)
    # The steps since the undo point (before update 11) took the mean of what was in effect for them.
    assert ramp.mean_raise(1.0, 32.0, position=12, steps=2) == pytest.approx(statistics.fmean(climb[:2]))
    assert ramp.mean_raise(1.0, 32.0, position=last + 2, steps=RAMP_STEPS + 1) == pytest.approx(
        statistics.fmean([*climb, 32.0]))
    assert ramp.in_effect(1.0, 12) == 1.0 and not ramp.under_way(1.0, 12)  # undone: the ramp is over
    small = RaiseRamp()
    small.begin(30, before=2.0, raised=8.0)  # 4x: MAX_ALIGNED_RAISE, at once
    assert small.in_effect(8.0, 30) == 8.0 and not small.moving(8.0, 30) and not small.under_way(8.0, 30)
    assert small.mean_raise(2.0, 8.0, position=35, steps=5) == 4.0 and small.share(8.0, 30) == 1.0


def _strongly_aligned_run(monkeypatch, output_dir, reach: float = 100.0, faults: FaultPlan | None = None,
                          **overrides) -> tuple[HybridHFTrainer, list]:
    """Every run reads strongly aligned and every line `reach` steps long: the first reading after the alignment's
    window (step 10) asks for reach / 2 times the scale, up to the 32x cap. Each verdict keeps the raise and records
    the raise it was asked to judge, the step it judged at and its undo point's step. `faults`: training batches
    that go bad (scripts/faults.py)."""
    for gate in ("ALIGNED", "STRONGLY_ALIGNED", "OPPOSED"):
        monkeypatch.setattr(f"hf_hybrid.autopilot.alignment.{gate}", -math.inf)
    monkeypatch.setattr("hf_hybrid.autopilot.scale.reach_of_line", lambda f0, f1, f2: reach / SPACING)
    judged: list[tuple[float, int, int]] = []

    def paid(trainer, model, shards, scratch, probe, undo_point, raise_, raised):
        judged.append((raise_, trainer.state.global_step, undo_point.step))
        return 1.0, 0.0

    monkeypatch.setattr("hf_hybrid.autopilot.runner.raise_gain", paid)
    cls = HybridHFTrainer if faults is None else with_faults(HybridHFTrainer, faults)
    return cls(model=tiny_gpt2(), args=hybrid_args(output_dir, **{**RUN, **overrides}),
               train_dataset=token_dataset()), judged


def _ramp_longer_than_the_readings_gap(monkeypatch) -> int:
    """A raise's verdict comes RAISING_READ_EVERY steps on at the soonest, as a ramp of the default length ends: a
    reading falls inside one only where steps were made up in it (a guard skip, a rolled-back jump). A ramp twice as
    long puts the verdict inside."""
    steps = 2 * RAISING_READ_EVERY
    monkeypatch.setattr("hf_hybrid.autopilot.ramp.RAMP_STEPS", steps)
    return steps


def _lr_scales(trainer: HybridHFTrainer) -> list[float]:
    """Each step's LR over the user's (the schedule is constant up to its cooldown)."""
    return [entry["learning_rate"] / 1e-5 for entry in trainer.state.log_history if "learning_rate" in entry]


def test_a_strongly_aligned_32x_raise_ramps_in_and_is_judged_as_taken(tmp_out, monkeypatch):
    trainer, judged = _strongly_aligned_run(monkeypatch, tmp_out)
    trainer.train()
    assert trainer._lr_autopilot.scale.scale == 32.0 and trainer._lr_autopilot.scale.raises_kept == 1
    lrs = _lr_scales(trainer)
    first = next(i for i, lr in enumerate(lrs) if lr > 1.0)  # the first step after the raise (a jump may delay it)
    assert first >= 10 and lrs[:first] == pytest.approx([1.0] * first)
    ramped = [1.0 + 31.0 * k / RAMP_STEPS for k in range(1, RAMP_STEPS + 1)]
    assert lrs[first:first + RAMP_STEPS] == pytest.approx(ramped)
    assert lrs[first + RAMP_STEPS:32] == pytest.approx([32.0] * (32 - first - RAMP_STEPS))  # the cooldown from 32 on
    # Judged a few steps on, over the steps since its undo point: the mean of what they took, not 32x.
    [(raise_, step, undo_step)] = judged
    assert undo_step == first and step > undo_step and raise_ < 32.0
    assert raise_ == pytest.approx(statistics.fmean(lrs[undo_step:step]))


def test_a_step_the_guard_skips_inside_the_ramp_is_not_judged_as_a_raised_step(tmp_out, monkeypatch):
    """A NaN loss at step 14, the second raised step here: the guard skips that update and the schedule takes its
    position again on the next step. The verdict reads the mean raise over the updates made since the undo point;
    counted in global steps, it would reach back one position before the undo point, to the user's LR."""
    trainer, judged = _strongly_aligned_run(monkeypatch, tmp_out, faults=FaultPlan(nan_step=13))
    trainer.train()
    assert trainer.hybrid_stats()["skipped_steps"] == 1
    [(raise_, step, undo_step)] = judged
    skipped = 14  # the step after `nan_step`, as `global_step` counts it at its end
    assert undo_step < skipped <= step
    lrs = _lr_scales(trainer)  # one per step, its update's, the skipped one's too
    made = [lrs[s - 1] for s in range(undo_step + 1, step + 1) if s != skipped]
    assert min(made) > 1.0 and raise_ == pytest.approx(statistics.fmean(made))


def test_no_raise_starts_until_the_ramp_is_done(tmp_out, monkeypatch):
    """Every line reads 24 steps: 12x at step 10, ramped; kept at the next reading, and the next raise (the rest of the
    cap, 2.7x, at once) only once the ramp has reached 12x."""
    ramp_steps = _ramp_longer_than_the_readings_gap(monkeypatch)
    trainer, judged = _strongly_aligned_run(monkeypatch, tmp_out, reach=24.0, max_steps=60)
    trainer.train()
    assert trainer._lr_autopilot.scale.scale == 32.0 and trainer._lr_autopilot.scale.raises_kept == 2
    lrs = _lr_scales(trainer)
    first = next(i for i, lr in enumerate(lrs) if lr > 1.0)
    climb = [1.0 + 11.0 * k / ramp_steps for k in range(1, ramp_steps + 1)]
    assert lrs[first:first + ramp_steps] == pytest.approx(climb)
    second = next(i for i, lr in enumerate(lrs) if lr > 12.0 * 1.001)
    assert second > first + ramp_steps - 1 and lrs[second] == pytest.approx(32.0)  # at once: a raise of 4x or less
    assert [raise_ for raise_, _, _ in judged][1] == pytest.approx(32.0 / 12.0)


def test_a_reading_inside_the_ramp_counts_its_steps_at_the_scale_they_were_read_at(tmp_out, monkeypatch):
    """The line runs along the step at the LR in effect when the reading starts (the last position's, before this
    step's `_apply`); the reach is counted in steps of the judged scale, so the schedule factor handed to the reading
    is that LR over the judged scale's (a constant schedule: 1 outside a ramp)."""
    _ramp_longer_than_the_readings_gap(monkeypatch)
    trainer, _ = _strongly_aligned_run(monkeypatch, tmp_out, reach=24.0, max_steps=60)
    read = LrScale.reading
    seen: list[tuple[float, float]] = []

    def recording(self, *args, schedule_factor: float, **kwargs):
        in_effect = trainer.optimizer.param_groups[0]["lr"] / 1e-5
        seen.append((schedule_factor, in_effect / self.scale))
        return read(self, *args, schedule_factor=schedule_factor, **kwargs)

    monkeypatch.setattr(LrScale, "reading", recording)
    trainer.train()
    assert any(share < 1.0 for _, share in seen)  # a verdict read inside the ramp
    assert [factor for factor, _ in seen] == pytest.approx([share for _, share in seen])


def test_resume_inside_the_ramp_is_bit_identical(tmp_path, monkeypatch):
    settings = dict(save_strategy="steps", save_steps=13)
    full_run, _ = _strongly_aligned_run(monkeypatch, tmp_path / "full", **settings)
    full_run.train()
    lrs = _lr_scales(full_run)
    assert 1.0 < lrs[12] < lrs[13], "step 13, the checkpoint's, is inside the ramp"
    resumed_model = tiny_gpt2(seed=123)  # everything the run goes on with must come from the checkpoint
    resumed = HybridHFTrainer(model=resumed_model, train_dataset=token_dataset(), args=hybrid_args(tmp_path / "resumed",
                                                                                              **RUN, **settings))
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-13"))
    assert resumed.hybrid_stats() == full_run.hybrid_stats()
    assert_bit_identical(state(full_run.model), state(resumed_model))
    assert resumed.lr_scheduler.get_last_lr() == full_run.lr_scheduler.get_last_lr()
