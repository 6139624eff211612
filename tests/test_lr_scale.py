"""The learning-rate autopilot's rule on its own (autopilot/scale.py): when a line's readings ask for a raise, how
much, and when a trial is kept or undone; no trainer runs."""

from __future__ import annotations

import math

import pytest

from hf_hybrid.autopilot.line import SPACING
from hf_hybrid.autopilot.scale import LrScale, RaiseVerdict, reach_of_line


def read(s: LrScale, loss: float, bottom: float, steps: int = 10, schedule_factor: float = 1.0,
         frozen: bool = False, paid: bool = False, first_descent: bool = False) -> str | None:
    """A reading whose probe loss at the weights is `loss` and whose line along the next step bottoms out `bottom`
    steps out (inf: a straight line, still falling at its end); `paid`: the verdict on a raise under trial."""
    if math.isinf(bottom):
        f0, f1, f2 = loss, loss - 0.01, loss - 0.02
    else:
        u = bottom / SPACING  # the bottom in units of the line's spacing
        f0, f1, f2 = (loss + 0.01 * ((x - u) ** 2 - u**2) for x in (0.0, 1.0, 2.0))
    return s.reading(f0, f1, f2, spacing=SPACING, steps=steps, schedule_factor=schedule_factor, frozen=frozen,
                     trial_verdict=RaiseVerdict.SHOWN if paid else RaiseVerdict.WORSE, first_descent=first_descent)


def test_the_reach_is_where_the_line_bottoms_out():
    assert reach_of_line(9.0, 4.0, 1.0) == pytest.approx(3.0)
    assert reach_of_line(0.64, 0.04, 1.44) == pytest.approx(0.8)
    assert reach_of_line(3.0, 2.0, 1.0) == math.inf  # still falling, no curvature
    assert reach_of_line(1.0, 1.5, 3.0) == 0.0  # rose from the start
    assert reach_of_line(1.0, float("nan"), 0.5) == 0.0


def test_a_raise_needs_a_long_line_twice_and_progress_and_is_kept_when_its_steps_pay():
    s = LrScale()
    assert read(s, 5.0, bottom=12.0) is None  # the first reading has no progress to compare
    for loss in (4.9, 4.85):
        assert read(s, loss, bottom=0.0) is None  # the loss rose along the line: the steps are long enough
    # One long reading is not enough: from scratch at a third of the swept LR the first one after the first descent
    # read 10.8 steps and the next 2.2, and a raise on the first made the run end worse than the Trainer.
    assert read(s, 4.8, bottom=12.0) is None
    for loss, bottom in ((4.75, 0.5), (4.72, 0.6), (4.7, 6.0)):
        assert read(s, loss, bottom=bottom) is None
    assert read(s, 4.65, bottom=5.0) == "raise"  # twice in a row: aimed at the shorter's bottom 2 steps out, capped
    assert s.scale == pytest.approx(2.0) and s.on_trial and s.trial_raise == pytest.approx(2.0)
    # Kept on the verdict alone, however the progress per step compares with the window before (here 0.1x of it).
    # The reading before the raise counts at the new scale: 5 steps then are 2.5 now, under the gate.
    assert read(s, 4.645, bottom=9.0, paid=True) == "keep"
    assert s.scale == pytest.approx(2.0) and not s.on_trial and s.raises_kept == 1
    assert read(s, 4.6, bottom=40.0) == "raise" and s.scale == pytest.approx(4.0)  # 9 and 40: 2x at most


def test_from_scratch_near_the_swept_lr_a_first_descent_reading_raises_no_further_than_the_best_lr():
    """The lines read by survey-scratch-2x128-docs-constant (seed 0, docs/benchmarks-history.md, session 33) with no
    raise made, one reading every 10 steps from the first one a raise may start at. Its Trainer ends at 4.901 at 1e-3,
    4.780 at 2e-3, 4.807 at 3e-3 and 5.139 at 4e-3: a 4x raise on the first reading at 1e-3 led at step 40 and ended
    0.054 above the Trainer. Now 1e-3 doubles once, at the third reading, on the steady median, and 2e-3 never
    raises."""
    def decisions(reaches: list[float]) -> list[str | None]:
        s = LrScale()
        read(s, 6.0, bottom=30.0, frozen=True)  # the reading as the first descent ends: a rate, no evidence
        return [read(s, 5.9 - i / 100, bottom=b, paid=True) for i, b in enumerate(reaches)]

    assert decisions([10.8, 2.2, 1.7, 1.4, 0.0, 0.0]) == [None, None, "raise", "keep", None, None]  # 1e-3 -> 2e-3
    assert decisions([4.1, 0.0, 0.0, 0.0, 0.0, 0.7]) == [None] * 6  # 2e-3
    assert decisions([16.1, 44.1]) == [None, "raise"]  # 3e-4, a tenth: the line reads long twice


def test_with_no_warmup_a_line_read_in_the_first_descent_counts_only_from_four_times_the_gate():
    """survey-scratch-2x128-code-linear at its swept LR (seed 1, no warmup; docs/benchmarks.md, "The first descent of a
    run with no warmup"): the readings at steps 11 and 21 read 8.1 and 7.7 steps, and the 2x raise they asked for was
    kept and ended 0.070 above the Trainer. The one at 11, still in the first descent, no longer counts. Far longer
    lines there still do: a classifier at 5e-5 read 49 steps at step 11 (seed 2), or a line with no bottom at all."""
    def decisions(first: float, second: float, first_descent: bool) -> list[str | None]:
        s = LrScale()
        return [read(s, 7.3, bottom=first, first_descent=first_descent), read(s, 5.16, bottom=second)]

    assert decisions(8.1, 7.7, first_descent=False) == [None, "raise"]  # as before
    assert decisions(8.1, 7.7, first_descent=True) == [None, None]
    assert decisions(15.0, 7.7, first_descent=True) == [None, None]
    assert decisions(48.8, 95.8, first_descent=True) == [None, "raise"]
    assert decisions(math.inf, math.inf, first_descent=True) == [None, "raise"]


def test_a_steady_line_raises_where_one_long_reading_among_short_ones_does_not():
    """Readings under the single-reading gate: three in a row whose median is a line a step or more long raise, sized
    to bring the median to half a step; at a tuned LR most lines read 0, and a lone longer one is noise."""
    tuned = LrScale()
    for i, bottom in enumerate((0.0, 1.9, 0.0, 0.0, 3.5, 0.0)):
        assert read(tuned, 5.0 - i / 10, bottom=bottom) is None
    assert tuned.scale == 1.0
    small = LrScale()
    assert [read(small, 5.0 - i / 10, bottom=b) for i, b in enumerate((1.2, 1.6, 1.4))] == [None, None, "raise"]
    assert small.trial_raise == pytest.approx(2.0)  # a median of 1.4 asks for 2.8x, capped at MAX_RAISE
    # Kept: the readings before the trial were at the old scale, so the next steady reach starts from the verdict's.
    assert read(small, 4.6, bottom=1.5, paid=True) == "keep" and small.recent == pytest.approx((1.5,), rel=1e-4)
    assert read(small, 4.5, bottom=1.5) is None
    assert read(small, 4.4, bottom=1.5) == "raise"
    assert small.scale == pytest.approx(4.0)  # 1.5 asks for 3x, capped
    frozen = LrScale()  # readings in the schedule's warmup or final decay are not evidence about its peak
    for i in range(3):
        assert read(frozen, 5.0 - i / 10, bottom=1.5, frozen=True) is None
    assert read(frozen, 4.6, bottom=1.5) is None and frozen.recent == pytest.approx((1.5,), rel=1e-4)
    resumed = LrScale()
    resumed.load_state_dict(frozen.state_dict())
    assert resumed == frozen  # the steady window resumes where it was


def test_a_raise_whose_steps_do_not_pay_is_undone_and_the_next_waits():
    s = LrScale()
    read(s, 5.0, bottom=12.0)
    assert read(s, 4.9, bottom=12.0) == "raise"
    assert read(s, 4.5, bottom=12.0, paid=False) == "undo"  # 4x the progress per step, but the verdict says no
    assert s.scale == 1.0 and s.trials_undone == 1 and s.wait == 2
    assert s.last_loss == pytest.approx(4.9)  # the probe is back where the undo point is
    assert read(s, 4.8, bottom=12.0) is None  # backing off
    assert read(s, 4.7, bottom=12.0) == "raise"


def test_the_scale_is_bounded_and_frozen_in_the_decay_and_the_warmup_does_not_count():
    s = LrScale()
    read(s, 5.0, bottom=100.0)
    for i, scale in enumerate((2.0, 4.0, 8.0, 16.0, 32.0)):  # a doubling at a time, up to MAX_SCALE
        s.trial_from = None
        assert read(s, 4.9 - i / 10, bottom=100.0) == "raise" and s.scale == scale
    s.trial_from = None
    assert read(s, 4.0, bottom=100.0) is None and not s.wants_readings  # at the bound: no trial of 1x
    fresh = LrScale()
    read(fresh, 5.0, bottom=12.0)
    assert read(fresh, 4.9, bottom=12.0, frozen=True) is None
    assert read(fresh, 4.8, bottom=12.0, schedule_factor=0.25) is None  # early in the warmup: 3 steps at the peak
    assert fresh.scale == 1.0


def test_a_guard_rollback_ends_a_trial_and_never_goes_below_the_users_lr():
    s = LrScale()
    read(s, 5.0, bottom=12.0)
    read(s, 4.9, bottom=12.0)
    s.guard_flagged(weights_damaged=True)
    assert s.scale == 1.0 and not s.on_trial and s.trials_undone == 1 and s.last_loss is None
    s.guard_flagged(weights_damaged=True)
    assert s.scale == 1.0


def test_readings_across_a_guard_flag_are_no_steady_reach():
    """Run 232's readings at a swept LR: 1.55 and 0.43 steps, a NaN step the guard skipped, then 3.97. As one window
    their median raised the LR 3.1x, and the verdict kept it at a loss; the flag starts the window again, and the
    third reading after it is the first that may raise."""
    straddled, flagged = LrScale(), LrScale()
    for s in (straddled, flagged):
        read(s, 6.47, bottom=1.55)
        read(s, 6.45, bottom=0.43)
    flagged.guard_flagged(weights_damaged=False)
    assert read(straddled, 6.40, bottom=3.97) == "raise"
    assert read(flagged, 6.40, bottom=3.97) is None and flagged.last_loss == pytest.approx(6.40)  # the rate holds
    assert read(flagged, 6.39, bottom=4.5) is None  # over the single-reading gate, but the second after the flag
    assert read(flagged, 6.38, bottom=1.6) == "raise" and flagged.trial_raise == pytest.approx(2.0)  # the cap
