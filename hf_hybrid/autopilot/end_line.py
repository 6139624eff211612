"""The autopilot's end line: what it did to the learning rate, and what to pass next time, from what the run decided.
It advises only a learning rate that was judged: one under trial at the end is named, not advised. Nor is one reached
through a raise kept on an even verdict (autopilot/scale.py, RaiseVerdict): near a tuned learning rate such a raise
can end a run above or below the Trainer (docs/benchmarks.md, "What the raise verdict tells near a tuned LR"), so the
line asks the user to compare the two learning rates instead."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .scale import MAX_SCALE, LrScale


@dataclass
class RunEnd:
    """What the line needs to know about the run beyond the scale."""

    user_lr: float  # the first parameter group's base learning rate as the user gave it
    cooldown_steps: int | None  # steps over which a raised scale came back to 1, where the schedule has no decay
    readings: int  # readings taken by this process
    reading_seconds: float
    train_seconds: float  # this train() call's time so far
    opposed_at: float | None = None  # the first steps' alignment where it read opposed (autopilot/alignment.py)


def end_line(scale: LrScale, run: RunEnd) -> str | None:
    s, user = scale, run.user_lr
    raised = user * s.scale
    tried = f"{s.raises_kept} raise{'' if s.raises_kept == 1 else 's'} kept, {s.trials_undone} undone"
    if s.on_trial:  # the run ended before the verdict (a jump held the reading back): advise only what was judged
        judged = user * s.trial_from
        return (f"hf_hybrid: training ended before a {s.trial_raise:.1f}x raise of the learning rate "
                f"({judged:.2g} -> {raised:.2g}) could be judged ({tried}); {_advice(s, user, judged)}.")
    if run.cooldown_steps is not None:
        return (f"hf_hybrid: raised the learning rate {s.scale:.1f}x: {user:.2g} -> {raised:.2g} ({tried}), and "
                f"brought it back to {user:.2g} over the last {run.cooldown_steps} steps, since this schedule has no "
                f"decay of its own; a constant {raised:.2g} is not advised: a higher constant learning rate can end a "
                f"run higher.")
    if s.scale != 1.0:
        return (f"hf_hybrid: raised the learning rate {s.scale:.1f}x: {user:.2g} -> {raised:.2g} ({tried}); "
                f"{_advice(s, user, raised)}{_held_by_cap(s, raised)}.")
    if s.trials_undone:
        return f"hf_hybrid: the learning rate {user:.2g} was kept: {tried}."
    if run.readings:  # all it did was read: say what that cost
        share = run.reading_seconds / max(run.train_seconds, 1e-9)
        readings = f"{run.readings} reading{'' if run.readings == 1 else 's'} (three forwards each)"
        cost = (f"the autopilot's {readings} took {run.reading_seconds:.1f} s, {100 * share:.1f}% of this train() "
                f"call's time")
        if run.opposed_at is not None:
            return (f"hf_hybrid: the learning rate {user:.2g} was kept: its first steps read opposed "
                    f"({run.opposed_at:+.3f}: the updates turned back along the way they came), as on record only at "
                    f"or above a setting's swept learning rate, so no raise was tried; {cost}.")
        return (f"hf_hybrid: the learning rate {user:.2g} was kept; {cost}; --hybrid_lr_autopilot false skips the "
                f"readings where the learning rate is known to be right.")
    return None


def _held_by_cap(s: LrScale, raised: float) -> str:
    """Where the cap, not the readings, ended the raising: the user's best LR may lie above the one advised. Not after
    a raise kept on an even verdict, where the line already asks to compare the two LRs."""
    if s.scale < MAX_SCALE or s.held_by_cap <= 1.0 or s.kept_even:
        return ""
    asked = f"asked for {s.held_by_cap:.1f}x more" if math.isfinite(s.held_by_cap) else "read a line with no bottom"
    return (f"; {MAX_SCALE:.0f}x is the most the autopilot raises, and the reading that raised it to {MAX_SCALE:.0f}x "
            f"{asked}: a learning rate above {raised:.2g} may train faster still")


def _advice(s: LrScale, user: float, judged: float) -> str:
    if judged == user:
        return f"--learning_rate {user:.2g} stands"
    if s.kept_even:
        return (f"{s.kept_even} of the kept raises read even on the probe (not shown to pay), and near a tuned "
                f"learning rate such a raise can end a run either way: compare --learning_rate {user:.2g} and "
                f"{judged:.2g} before passing the higher one")
    return f"pass --learning_rate {judged:.2g} next time"
