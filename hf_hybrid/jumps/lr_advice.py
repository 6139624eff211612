"""What kept jumps say about the learning rate.

A jump that keeps paying is evidence that plain steps are too short: an outer step that lengthens the recent direction
beats the next real step only when the optimizer undershoots. So when jumps keep being kept and their gains add up to
a fair share of the run, the user hears, in one line, that the learning rate looks too small, and by about how much:
the ratio of the progress made (real steps plus what the kept jumps were worth in real steps) to the real steps. That
ratio is a lower bound on the factor; the right LR may be further away (the jump itself recovers only part of it).
"""

from __future__ import annotations

from typing import Literal

# The autopilot in a run: on; off by its flag; or asked for by the flag but lacking what it needs (autopilot/setup.py).
AutopilotUse = Literal["on", "off", "unavailable"]
MIN_JUDGED = 5  # fewer verdicts than this is no evidence either way
MIN_KEPT_SHARE = 0.7  # most jumps must pay, not a lucky few
MIN_SPEEDUP = 1.1  # kept jumps must be worth at least a tenth of the run's real steps


def jump_summary(stats: dict) -> str | None:
    """One line on what the kept jumps gained and how many turns to jump passed, or None when neither happened."""
    judged, kept, passed = stats["predictions_judged"], stats["predictions_kept"], stats["turns_passed"]
    held = (f"{passed} turn{'' if passed == 1 else 's'} to jump passed: the probe along the optimizer's next step said "
            "its steps were long enough")
    if not judged:
        return f"hf_hybrid: no jump was tried; {held}." if passed else None
    if not kept:
        undone = f"all {judged} jumps were" if judged > 1 else "the jump was"
        line = f"hf_hybrid: {undone} rolled back"
        # Only then are the weights the plain Trainer's: a kept raise of the learning rate or a step the guard flagged
        # moved them another way, and steps that could not be made up left them short; each has a line of its own.
        if stats["lr_scale"] == 1.0 and not (stats["guard_outliers"] or stats["guard_rollbacks"]
                                             or stats["steps_not_made_up"]):
            line += ", so these weights are the plain Trainer's steps"
    else:
        kept_line = "the jump was kept; it" if judged == 1 else f"{kept} of {judged} jumps kept; together they"
        line = (f"hf_hybrid: {kept_line} gained {stats['jump_gain']:.4f} probe loss, worth about "
                f"{stats['jump_worth_steps']:.0f} real steps over {stats['backward_steps']} real steps")
    return f"{line}; {held}." if passed else f"{line}."


def lr_too_small(stats: dict, learning_rate: float, offer_autopilot: bool = True) -> str | None:
    """The warning line when the jumps' evidence says the learning rate is too small; None otherwise. It offers the
    autopilot only where the flag would turn it on (`offer_autopilot`): where the flag is on and the run lacked what it
    needs, its own line said why at the start."""
    judged, kept, real = stats["predictions_judged"], stats["predictions_kept"], stats["backward_steps"]
    if judged < MIN_JUDGED or kept < MIN_KEPT_SHARE * judged or real <= 0:
        return None
    factor = (real + stats["jump_worth_steps"]) / real
    if factor < MIN_SPEEDUP:
        return None
    # A lower bound: a kept jump recovers only part of the distance to the right LR (docs/benchmarks-history.md,
    # "The learning rate users run without a sweep").
    line = (f"hf_hybrid: the learning rate looks too small: {kept} of {judged} jumps paid, worth {factor:.2f}x the "
            f"progress of the real steps alone, so it is at least about {factor:.1f}x too small. Sweep upward from "
            f"--learning_rate {learning_rate * factor:.2g}")
    offer = ", or pass --hybrid_lr_autopilot true to let the trainer raise it, judged and undone when it does not pay"
    return f"{line}{offer if offer_autopilot else ''}."


def jump_advice(stats: dict, learning_rate: float, autopilot: AutopilotUse = "off") -> list[str]:
    """The lines said at the end of training: what the jumps gained, and whether the learning rate looks too small
    (unless the autopilot was on: it says what it did to the learning rate itself)."""
    too_small = None if autopilot == "on" else lr_too_small(stats, learning_rate, offer_autopilot=autopilot == "off")
    return [line for line in (jump_summary(stats), too_small) if line is not None]
