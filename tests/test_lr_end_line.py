"""The autopilot's end line (autopilot/end_line.py), word for word in each case: it advises only a learning rate that
was judged, and says what the run did."""

from __future__ import annotations

import pytest

from hf_hybrid.autopilot.end_line import RunEnd, end_line
from hf_hybrid.autopilot.scale import LrScale, RaiseVerdict

RUN = RunEnd(user_lr=1e-4, cooldown_steps=None, readings=0, reading_seconds=0.0, train_seconds=100.0)


def test_a_kept_raise_is_advised():
    scale = LrScale(scale=4.0, raises_kept=2, trials_undone=1)
    assert end_line(scale, RUN) == ("hf_hybrid: raised the learning rate 4.0x: 0.0001 -> 0.0004 (2 raises kept, 1 "
                                    "undone); pass --learning_rate 0.0004 next time.")


def test_a_raise_kept_on_an_even_verdict_is_not_advised_alone():
    """Near a tuned LR an even verdict keeps raises that end either way (scratch-2x128-code-linear at its swept 1.5e-3:
    kept on a gain of -0.022 against a standard error of 0.021, it ended 0.163 above the Trainer)."""
    scale = LrScale(scale=2.0, raises_kept=1, kept_even=1)
    assert end_line(scale, RUN) == (
        "hf_hybrid: raised the learning rate 2.0x: 0.0001 -> 0.0002 (1 raise kept, 0 undone); 1 of the kept raises "
        "read even on the probe (not shown to pay), and near a tuned learning rate such a raise can end a run either "
        "way: compare --learning_rate 0.0001 and 0.0002 before passing the higher one.")


def test_a_raise_still_on_trial_at_the_end_is_named_and_only_the_judged_lr_advised():
    judged_before = LrScale(scale=8.0, trial_from=4.0, raises_kept=2)
    assert end_line(judged_before, RUN) == (
        "hf_hybrid: training ended before a 2.0x raise of the learning rate (0.0004 -> 0.0008) could be judged (2 "
        "raises kept, 0 undone); pass --learning_rate 0.0004 next time.")
    first = LrScale(scale=2.0, trial_from=1.0)
    assert end_line(first, RUN).endswith("(0 raises kept, 0 undone); --learning_rate 0.0001 stands.")


def test_a_raise_brought_back_by_the_cooldown_is_not_advised():
    line = end_line(LrScale(scale=2.0, raises_kept=1), RunEnd(**{**vars(RUN), "cooldown_steps": 20}))
    assert line == ("hf_hybrid: raised the learning rate 2.0x: 0.0001 -> 0.0002 (1 raise kept, 0 undone), and brought "
                    "it back to 0.0001 over the last 20 steps, since this schedule has no decay of its own; a constant "
                    "0.0002 is not advised: a higher constant learning rate can end a run higher.")


def test_a_run_whose_raises_were_all_undone_keeps_the_users_lr_and_says_so():
    assert end_line(LrScale(trials_undone=2), RUN) == (
        "hf_hybrid: the learning rate 0.0001 was kept: 0 raises kept, 2 undone.")


def test_a_run_that_only_read_says_what_the_readings_cost_and_one_that_did_not_read_says_nothing():
    reading = RunEnd(**{**vars(RUN), "readings": 5, "reading_seconds": 2.5})
    assert end_line(LrScale(readings=5), reading) == (
        "hf_hybrid: the learning rate 0.0001 was kept; the autopilot's 5 readings (three forwards each) took 2.5 s, "
        "2.5% of this train() call's time; --hybrid_lr_autopilot false skips the readings where the learning rate is "
        "known to be right.")
    one = RunEnd(**{**vars(RUN), "readings": 1, "reading_seconds": 0.5})
    assert "the autopilot's 1 reading (three forwards each) took 0.5 s, 0.5%" in end_line(LrScale(readings=1), one)
    assert end_line(LrScale(), RUN) is None


def test_a_run_whose_first_steps_read_opposed_says_so_and_why_no_raise_was_tried():
    """An opposed run starts no raise at all (autopilot/alignment.py): the line names the reading and where, on record,
    such runs were, instead of calling the LR known to be right."""
    opposed = RunEnd(**{**vars(RUN), "readings": 5, "reading_seconds": 2.5, "opposed_at": -0.016})
    assert end_line(LrScale(readings=5), opposed) == (
        "hf_hybrid: the learning rate 0.0001 was kept: its first steps read opposed (-0.016: the updates turned back "
        "along the way they came), as on record only at or above a setting's swept learning rate, so no raise was "
        "tried; the autopilot's 5 readings (three forwards each) took 2.5 s, 2.5% of this train() call's time.")


def test_a_raise_held_by_the_cap_says_the_lr_may_lie_higher():
    """A strongly aligned run at 16x reads a line whose bottom is 12 of today's steps away, asking for 6x: the cap lets
    2x through, and the end line names the rest beside its advice."""
    scale = LrScale(scale=16.0, raises_kept=2)
    f0, f1, f2 = (3.0 - 0.001 * (2 * 12 * x - x**2) for x in (0, 1, 2))  # a parabola bottoming out at x = 12
    assert scale.reading(f0, f1, f2, spacing=1.0, steps=10, schedule_factor=1.0, frozen=False, aligned=True,
                         strongly_aligned=True) == "raise"
    assert scale.scale == 32.0 and scale.held_by_cap == pytest.approx(3.0)
    scale.reading(f0 - 0.1, f1 - 0.1, f2 - 0.1, spacing=1.0, steps=10, schedule_factor=1.0, frozen=False,
                  trial_verdict=RaiseVerdict.SHOWN)  # the raise is kept
    assert end_line(scale, RUN) == (
        "hf_hybrid: raised the learning rate 32.0x: 0.0001 -> 0.0032 (3 raises kept, 0 undone); pass --learning_rate "
        "0.0032 next time; 32x is the most the autopilot raises, and the reading that raised it to 32x asked for 3.0x "
        "more: a learning rate above 0.0032 may train faster still.")
    # A line with no bottom, and a raise that reached the cap with all it asked for.
    assert "and the reading that raised it to 32x read a line with no bottom:" in end_line(
        LrScale(scale=32.0, raises_kept=3, held_by_cap=float("inf")), RUN)
    assert end_line(LrScale(scale=32.0, raises_kept=5), RUN).endswith("pass --learning_rate 0.0032 next time.")
    # After a raise kept on an even verdict the line asks to compare the two LRs, and says no more.
    assert end_line(LrScale(scale=32.0, raises_kept=3, kept_even=1, held_by_cap=3.0), RUN).endswith(
        "before passing the higher one.")
