"""When the autopilot reads its line (autopilot/runner.py): readings come less often when they ask for nothing, a
short line holds the jumps back, and no raise starts where its verdict could not come or just after a skip."""

from __future__ import annotations

import logging
import math
import time

import pytest
from transformers import TrainerCallback

from hf_hybrid import HybridHFTrainer
from hf_hybrid.autopilot.line import SPACING
from hf_hybrid.autopilot.scale import LrScale

from .conftest import make_trainer, tiny_gpt2
from .test_equivalence_resume import assert_bit_identical, state
from .test_lr_advice import OUTER
from .test_lr_scale import read


def train_noting_readings(trainer: HybridHFTrainer) -> list[int]:
    """Train, and return the global steps at which the autopilot read its line."""
    read_at = []

    class Readings(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if trainer._lr_autopilot.last_line is not None:
                read_at.append(state.global_step)

    trainer.add_callback(Readings())
    trainer.train()
    return read_at


def test_readings_that_ask_for_nothing_come_less_often(tmp_out, monkeypatch):
    """Every reading sees a short line: after the first two (no progress to compare yet, then nothing asked), the gap
    between readings doubles without a bound, so a tuned LR pays for about log2(steps) of them. The run is long enough
    that the fifth gap ends before a constant schedule's last fifth, where no raise starts and nothing is read."""
    monkeypatch.setattr(LrScale, "reading", lambda self, f0, f1, f2, **kwargs: setattr(self, "last_loss", f0))
    trainer = make_trainer(tmp_out, learning_rate=1e-4, lr_scheduler_type="constant", **{**OUTER, "max_steps": 420})
    read_at = train_noting_readings(trainer)
    gaps = [b - a for a, b in zip(read_at, read_at[1:])]
    # A due reading waits for a real step with no jump open, so a gap can run a step over.
    assert gaps[:4] == [10, 20, 40, 80] and 160 <= gaps[4] <= 162 and len(gaps) == 5, read_at


def test_readings_keep_coming_soon_only_while_a_steady_reach_could_complete():
    """A median of three at a step or more needs two readings there: the next reading is worth having soon only while
    one of the last two reached a step. Lines under a step, as tuned runs read, are no more evidence than none."""
    s = LrScale()
    building = []
    for i, bottom in enumerate((0.8, 0.5, 1.2, 0.3, 0.0, 0.9, 0.0)):
        read(s, 5.0 - i / 10, bottom=bottom)
        building.append(s.evidence_building)
    assert s.scale == 1.0 and building == [False, False, True, True, False, False, False]


def test_a_short_line_holds_the_jumps_back_and_a_longer_one_lets_them_through():
    s = LrScale()
    assert not s.steps_long_enough  # no reading yet: no evidence either way
    read(s, 5.0, bottom=1.5)
    assert s.steps_long_enough  # the steps reach the line's bottom already
    read(s, 4.9, bottom=3.0)  # under the raise gate, over the aim
    assert not s.steps_long_enough and s.scale == 1.0
    resumed = LrScale()
    resumed.load_state_dict(s.state_dict())
    assert not resumed.steps_long_enough and resumed == s


HELD = dict(OUTER, max_steps=80, hybrid_warmup_steps=12, lr_scheduler_type="constant")


def run_with_readings_of(tmp_path, monkeypatch, reach: float, name: str) -> tuple[HybridHFTrainer, list[int]]:
    """Every autopilot reading's line bottoms out `reach` of today's steps out. The first turn to jump comes after the
    first reading (step 11). Returns the trainer and the steps it read at."""
    monkeypatch.setattr("hf_hybrid.autopilot.scale.reach_of_line", lambda f0, f1, f2: reach / SPACING)
    trainer = make_trainer(tmp_path / name, learning_rate=1e-3, model=tiny_gpt2(dropout=0.1), **HELD)
    return trainer, train_noting_readings(trainer)


def test_where_the_steps_are_long_enough_no_jump_is_tried_and_the_run_is_the_trainers(tmp_path, monkeypatch, caplog):
    """A line under a step at every reading, as tuned runs read: no raise, no jump, the Trainer bit for bit; and
    since no steady reach can build from such lines, the readings come less often, as readings of 0 do. The end line
    says what the readings cost."""
    with caplog.at_level(logging.WARNING):
        held, read_at = run_with_readings_of(tmp_path, monkeypatch, reach=0.8, name="held")
    stats = held.hybrid_stats()
    assert stats["predictions_judged"] == 0 and stats["predict_steps"] == 0 and stats["turns_passed"] >= 10
    assert held._lr_autopilot.scale.scale == 1.0
    assert read_at == [11, 21, 41], read_at
    assert stats["lr_readings"] == len(read_at)
    assert f"was kept; the autopilot's {len(read_at)} readings (three forwards each) took" in caplog.text
    assert 0 < held._lr_autopilot.reading_seconds < time.perf_counter() - held._lr_autopilot.train_started
    plain = make_trainer(tmp_path / "plain", learning_rate=1e-3, model=tiny_gpt2(dropout=0.1), hybrid=False, **HELD)
    plain.train()
    assert_bit_identical(state(plain.model), state(held.model))
    monkeypatch.setattr("hf_hybrid.autopilot.scale.STEADY_REACH", math.inf)  # a longer line, but no raise
    tried, _ = run_with_readings_of(tmp_path, monkeypatch, reach=3.0, name="tried")
    assert tried.hybrid_stats()["predictions_judged"] > 0 and tried.hybrid_stats()["turns_passed"] == 0


@pytest.mark.parametrize("nan_at", [None, 15])
def test_no_raise_starts_before_the_third_reading_after_a_guard_skip(tmp_path, monkeypatch, nan_at):
    """Every line reads 20 steps (long enough to count in the first descent of a run with no warmup): the second
    reading raises. A NaN loss between the first two readings, which the guard skips, holds the raise until the third
    reading after it."""
    from .test_safety import nan_model

    monkeypatch.setattr("hf_hybrid.autopilot.scale.reach_of_line", lambda f0, f1, f2: 20.0 / SPACING)
    monkeypatch.setattr("hf_hybrid.autopilot.alignment.ALIGNED", math.inf)  # a raise needs the line twice
    model = nan_model(at_grad=() if nan_at is None else (nan_at,))
    trainer = make_trainer(tmp_path, model=model, learning_rate=1e-4, lr_scheduler_type="constant",
                           **{**OUTER, "max_steps": 70})
    scales, skipped = [], []

    class Scale(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            scales.append(trainer._lr_autopilot.scale.scale)
            skipped.append(trainer.hybrid_stats()["skipped_steps"])

    trainer.add_callback(Scale())
    read_at = train_noting_readings(trainer)
    raised_at = next(step for step, scale in enumerate(scales, start=1) if scale > 1.0)
    if nan_at is None:
        assert raised_at == read_at[1] and skipped[-1] == 0, (read_at, scales)
    else:
        skip_step = skipped.index(1) + 1
        assert read_at[0] < skip_step < read_at[1] and skipped[-1] == 1, (read_at, skip_step)
        assert raised_at == read_at[3], (read_at, scales)


def test_no_raise_starts_where_the_run_would_end_before_its_verdict(tmp_out, monkeypatch):
    """Every line reads 20 steps, on a constant schedule whose last fifth (from step 32) brings a raised LR back to the
    user's: the raise at step 22 is judged 5 steps on and kept, and that reading starts no other, since fewer than
    READ_EVERY steps are left before that end. Had one been open at the end, the end line would advise only the LR
    that was judged."""
    monkeypatch.setattr("hf_hybrid.autopilot.scale.reach_of_line", lambda f0, f1, f2: 20.0 / SPACING)
    monkeypatch.setattr("hf_hybrid.autopilot.alignment.ALIGNED", math.inf)  # raises of 2x, whatever the first steps
    trainer = make_trainer(tmp_out, learning_rate=1e-4, lr_scheduler_type="constant", **{**OUTER, "max_steps": 40})
    read_at = train_noting_readings(trainer)
    scale = trainer._lr_autopilot.scale
    assert read_at == [12, 22, 27] and trainer.state.global_step == 40, read_at
    assert scale.scale == 2.0 and scale.raises_kept == 1 and not scale.on_trial
    scale.trial_from, scale.scale = 4.0, 10.0
    assert trainer._lr_autopilot.summary() == (
        "hf_hybrid: training ended before a 2.5x raise of the learning rate (0.0004 -> 0.001) could be judged (1 "
        "raise kept, 0 undone); pass --learning_rate 0.0004 next time.")
    scale.trial_from, scale.scale = 1.0, 4.0
    assert trainer._lr_autopilot.summary().endswith("--learning_rate 0.0001 stands.")


def readings_and_scales_under_a_warmup(out, max_steps: int, warmup_steps: int = 20) -> tuple[list[int], list[float]]:
    """A run at 1e-4 under a 20-step warmup (or `warmup_steps`), then constant: the steps that read the line, the scale
    after each step."""
    trainer = make_trainer(out, learning_rate=1e-4, warmup_steps=warmup_steps,
                           lr_scheduler_type="constant_with_warmup", **{**OUTER, "max_steps": max_steps})
    scales = []

    class Scale(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            scales.append(trainer._lr_autopilot.scale.scale)

    trainer.add_callback(Scale())
    return train_noting_readings(trainer), scales


@pytest.mark.parametrize("aligned", [False, True])
def test_no_raise_starts_in_the_first_descent_just_after_the_warmup_unless_the_first_steps_read_aligned(
        tmp_out, monkeypatch, aligned):
    """A run from scratch still falls steeply for a few steps after a short warmup, where its line reads long at any
    LR (cpu-small at its own LR: 8 steps at step 20, a raise there ended 0.28 above the Trainer). Every line reads
    10 steps here: the reading as a 20-step warmup ends only gives the next one its rate, and is no evidence; the
    first raise needs two long readings past the first descent. A run whose first steps read aligned raises at its
    first reading once the window has closed, inside the warmup (step 12: the outer jump's predict step is 11, and no
    reading comes while a jump may yet be undone), by what the line asks at the peak (6 steps there, at 0.6 of the
    peak's LR: 3x)."""
    monkeypatch.setattr("hf_hybrid.autopilot.scale.reach_of_line", lambda f0, f1, f2: 10.0 / SPACING)
    monkeypatch.setattr("hf_hybrid.autopilot.alignment.ALIGNED", -math.inf if aligned else math.inf)
    read_at, scales = readings_and_scales_under_a_warmup(tmp_out, max_steps=70)
    # Inside the warmup and the first descent a raise under way is read at the usual pace, not RAISING_READ_EVERY.
    assert read_at[:3] == ([12, 22, 32] if aligned else [20, 30, 40]), read_at
    raised_at = 12 if aligned else 40
    assert scales[raised_at - 2] == 1.0 and scales[raised_at - 1] > 1.0, scales  # raised there, not before
    if aligned:
        assert scales[raised_at - 1] == pytest.approx(3.0)


@pytest.mark.parametrize("bottom", [10.0, 20.0])
def test_with_no_warmup_a_line_read_in_the_first_descent_counts_only_from_four_times_the_gate(
        tmp_out, monkeypatch, bottom):
    """With no warmup the first descent lasts up to step 20. Lines of 10 steps read there (step 12) are the
    descent's: the first raise needs two long readings past it (steps 22 and 32). Lines of 20 steps, 4x the gate or
    more, are a far-too-small LR's wherever they are read, and raise at the second reading (22)."""
    monkeypatch.setattr("hf_hybrid.autopilot.scale.reach_of_line", lambda f0, f1, f2: bottom / SPACING)
    monkeypatch.setattr("hf_hybrid.autopilot.alignment.ALIGNED", math.inf)
    read_at, scales = readings_and_scales_under_a_warmup(tmp_out, max_steps=70, warmup_steps=0)
    raised_at = 32 if bottom < 16 else 22
    assert read_at[:3] == [12, 22, 32 if bottom < 16 else 27], read_at
    assert scales[raised_at - 2] == 1.0 and scales[raised_at - 1] == pytest.approx(2.0), scales  # raised there


def test_a_run_whose_first_steps_read_opposed_reads_its_lines_and_never_raises(tmp_out, monkeypatch, caplog):
    """Every line reads 10 steps, as in the test above, where a run that reads neither aligned nor opposed raises at
    step 40; one whose first steps read opposed (autopilot/alignment.py) reads at the same steps and keeps the user's
    LR at every one, and its end line says why."""
    monkeypatch.setattr("hf_hybrid.autopilot.scale.reach_of_line", lambda f0, f1, f2: 10.0 / SPACING)
    monkeypatch.setattr("hf_hybrid.autopilot.alignment.ALIGNED", math.inf)
    monkeypatch.setattr("hf_hybrid.autopilot.alignment.OPPOSED", math.inf)
    with caplog.at_level(logging.WARNING):
        read_at, scales = readings_and_scales_under_a_warmup(tmp_out / "hybrid", max_steps=70)
    assert read_at[:3] == [20, 30, 40] and set(scales) == {1.0}, (read_at, scales)
    assert "was kept: its first steps read opposed (" in caplog.text and "so no raise was tried" in caplog.text


@pytest.mark.parametrize("strongly", [False, True])
def test_a_strongly_aligned_run_takes_the_whole_long_line_at_its_first_raise(tmp_out, monkeypatch, strongly):
    """Every line reads 100 steps (60 at step 12, 0.6 of the warmup's peak: 30x asked for). An aligned run raises 4x
    there; one whose first steps read strongly aligned, as LoRA's do, takes all 30x."""
    monkeypatch.setattr("hf_hybrid.autopilot.scale.reach_of_line", lambda f0, f1, f2: 100.0 / SPACING)
    monkeypatch.setattr("hf_hybrid.autopilot.alignment.ALIGNED", -math.inf)
    monkeypatch.setattr("hf_hybrid.autopilot.alignment.STRONGLY_ALIGNED", -math.inf if strongly else math.inf)
    read_at, scales = readings_and_scales_under_a_warmup(tmp_out, max_steps=30)
    assert read_at[0] == 12
    assert scales[10] == 1.0 and scales[11] == pytest.approx(30.0 if strongly else 4.0), scales
