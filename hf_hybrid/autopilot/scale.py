"""The learning-rate scale as a judged quantity: one multiplier on the user's whole schedule, moved only on evidence.

Pure Python, like the controller: its inputs are probe losses already averaged across ranks, so every rank reaches the
same decision, and its state is a few numbers that a checkpoint carries exactly.

The evidence comes every few real steps, from one fixed probe batch at three points along the optimizer's own next
step (autopilot/line.py): the weights W, W + c*step and W + 2c*step. Call their losses f0, f1, f2.
- `rate`: the fall of f0 since the last reading, per real step: paired (one batch), so it does not vanish into batch
  noise the way a loss slope over many batches does in low-LR fine-tuning.
- `reach`: where a parabola through the three points bottoms out, in today's steps, times the schedule's factor (its
  warmup or decay is the user's shape, not a sign about the peak). It scales as 1 / LR, and early in a run it is
  larger (docs/benchmarks-history.md, "the autopilot reads Adam's next step instead of the cycle's line").
  A reach of RAISE_REACH or more at two readings in a row says the steps are too short; one long reading just after
  the first descent does not: it can read long once and short from the next reading on (docs/benchmarks-history.md,
  "Why the raise at a third of the swept LR ended worse: it overshot the best LR"). So does a steady one: one reading
  on one batch is noisy, but the median of the last STEADY_READINGS readings taken where a raise may start separates a
  too-small LR from a tuned one (docs/benchmarks-history.md, "a steady line raises").

A raise is a trial. The scale is multiplied by what would put the line's bottom at TARGET_REACH steps (the shorter of
the two readings; a steady reach: its median at STEADY_TARGET), at most MAX_RAISE at a time and MAX_SCALE in all, and
the trainer takes an undo point. A raise at most doubles the scale because a reach overstates how far the best LR
is, and past it the final loss can rise steeply (docs/benchmarks.md, "The line in a run's first steps"), unless the
run's first steps were aligned (autopilot/alignment.py: MAX_ALIGNED_RAISE, or MAX_STRONGLY_ALIGNED_RAISE where they
read strongly aligned, on one long reading: such a raise ramps in, autopilot/ramp.py); the next raise
needs the line to read long again at the new scale (the reading that asked for a raise counts there at its reach
divided by the raise). The next reading judges the trial: the raise is undone when the raised steps did worse, on the
probe, than the point the old scale would have reached over the same batches (autopilot/verdict.py), and then everything
goes back bit for bit (weights, optimizer state, schedule back to the undo point, the scale back to what it was), and
the next raise waits 2, 4, ... readings; otherwise it is kept.
Any step the guard flags starts the steady window again, and no raise starts before the STEADY_READINGS-th reading
after it: readings on either side of bad data are not one steady run, and a median over them can raise a tuned LR
that the verdict's margin then keeps (docs/benchmarks-history.md, "the autopilot after the guard's flags").
A guard rollback (the weights were damaged) also ends a trial and lowers a raised scale. The scale never goes below
the user's LR: a run too fast for its data is the guard's to catch.
The same reading holds the jumps back: a reach under TARGET_REACH says today's steps already go as far as the line runs,
where a jump, which extends the path the steps took, is not worth keeping (docs/benchmarks-history.md, "the jumps at a
high LR"). Until the next reading, the trainer's predictor passes its turn instead of jumping. No raise starts in the
schedule's warmup or the 10 steps after it (a run's first descent reads long at any LR), unless the run's first steps
read aligned, which tells its LR apart where the line cannot: then from the alignment's last step on, inside the warmup.
With a warmup under 10 steps, or none, the first descent outlasts those 10 steps: up to step 20 a line counts only from
FIRST_DESCENT_REACH steps on, and a shorter one counts as frozen (docs/benchmarks.md, "The first descent of a run with
no warmup").
Nor once the schedule has decayed below half its peak (the final decay is the user's), or where the run would end before
its verdict, nor ever in a run whose first steps read opposed (the gradient pointing back along the way come: its steps
overshoot).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, fields
from enum import Enum


def reach_of_line(f0: float, f1: float, f2: float) -> float:
    """The minimum of the parabola through (0, f0), (1, f1), (2, f2); inf where the loss still falls at 2 with no
    curvature to stop it, and 0 where the loss rose from the start."""
    curvature = f0 - 2 * f1 + f2
    descent = f0 - f1 + curvature / 2  # the slope at 0, negated
    if not all(math.isfinite(v) for v in (f0, f1, f2)) or descent <= 0:
        return 0.0
    return descent / curvature if curvature > 0 else math.inf


# A fine-tune at TrainingArguments' 5e-5 can sit 30x below its best LR
# (docs/benchmarks-history.md, "The cap: 10x -> 32x").
MAX_SCALE = 32.0
MAX_RAISE = 2.0
# Where the first steps' alignment says the LR is far too small, the line's own size (tens of steps) is let through up
# to here: at 2x a reading such a run reaches the cap too late to recover what a switch to the swept LR at the window's
# end recovers (docs/benchmarks.md, "What a raise can recover once it may start: an oracle switch").
MAX_ALIGNED_RAISE = 4.0
# Where they read strongly aligned, as a LoRA run's do below its swept LR (autopilot/alignment.py), the line's whole
# size is let through, up to the cap: a fine-tune's sweep gain is decided in its first updates, which 4x a reading
# spends reaching the cap. From scratch the same one-reading raise, read in the first descent, overshoots the swept LR,
# so a run that reads only aligned keeps the 4x step (docs/benchmarks.md, "A larger first raise where the first steps
# read aligned").
MAX_STRONGLY_ALIGNED_RAISE = MAX_SCALE
RAISE_REACH = 4.0  # a next step worth this many of today's (at the schedule's peak), twice in a row, asks for a raise
TARGET_REACH = 2.0  # and the raise aims the line's bottom here: reaches of 9 and 5 raise 2.5x, capped at MAX_RAISE
# A line read in the first descent runs several times what the same LR reads past it, so there it counts only from 4x
# the gate: at the swept LR such a line reads about twice the gate, at a far-too-small LR many times it
# (docs/benchmarks.md, "The first descent of a run with no warmup").
FIRST_DESCENT_REACH = 4 * RAISE_REACH
STEADY_READINGS = 3
STEADY_REACH = 1.0  # the median of that many readings in a row asks for a raise from here
STEADY_TARGET = 0.5  # and the raise aims it here, inside what tuned runs read


class RaiseVerdict(Enum):
    """How the raised steps did on the probe against the user's LR over the same batches (autopilot/verdict.py), in
    standard errors of the difference: beyond the noise margin ahead, within it either way, or beyond it behind."""

    SHOWN = "shown"
    EVEN = "even"  # kept: a raise's worth accrues over more steps than a trial sees; not shown to pay either
    WORSE = "worse"

    @classmethod
    def of(cls, gain: float, noise: float, margin: float) -> RaiseVerdict:
        return cls.SHOWN if gain > margin * noise else cls.EVEN if gain + margin * noise >= 0 else cls.WORSE


@dataclass
class LrScale:
    scale: float = 1.0
    last_loss: float | None = None  # f0 at the last reading
    trial_from: float | None = None  # the scale before the raise under trial
    trial_loss: float = 0.0  # f0 when it was asked for: where an undo takes the probe back to
    wait: int = 0  # readings before the next raise may start
    failures: int = 0  # trials undone in a row
    raises_kept: int = 0
    kept_even: int = 0  # of them, kept on an even verdict: near a tuned LR such a raise can end either way
    trials_undone: int = 0
    lowered: int = 0
    readings: int = 0  # each runs three probe forwards (what they cost: autopilot/runner.py, READ_EVERY)
    last_reach: float | None = None  # the last reading's, at the schedule's peak
    recent: tuple[float, ...] = ()  # the last readings' reaches where a raise may start, at today's scale
    previous: float | None = None  # the last reading's reach where a raise may start, in today's steps
    held_by_cap: float = 1.0  # how much more the reading that raised to MAX_SCALE asked for than the cap let through

    def reading(self, f0: float, f1: float, f2: float, spacing: float, steps: int, schedule_factor: float,
                frozen: bool, trial_verdict: RaiseVerdict | None = None, aligned: bool = False,
                strongly_aligned: bool = False, opposed: bool = False, first_descent: bool = False) -> str | None:
        """One reading, `steps` real steps after the last; `frozen`: no raise may start now (the schedule's warmup or
        final decay); `trial_verdict`: on a trial, the verdict on the raise (shown and even keep it); `aligned`: the
        run's first steps said its LR is far too small (autopilot/alignment.py), so one long line asks for a raise, of
        up to MAX_ALIGNED_RAISE, or MAX_STRONGLY_ALIGNED_RAISE where they said it `strongly_aligned`; `opposed`: they
        said its steps overshoot, so no raise starts at all; `first_descent`: a run with a short warmup or none is
        still in its first descent, where a line shorter than FIRST_DESCENT_REACH counts as frozen.
        Returns what the trainer must do: "raise", "keep" (a trial passed and no new raise: a pass followed by one
        returns "raise"), "undo" (restore the undo point: the scale is already back), or None."""
        self.readings += 1
        rate = (self.last_loss - f0) / steps if self.last_loss is not None and steps > 0 else None
        self.last_loss = f0
        if rate is not None and not math.isfinite(rate):
            rate = -math.inf
        reach = self.last_reach = spacing * reach_of_line(f0, f1, f2) * schedule_factor
        self.wait = max(self.wait - 1, 0)
        verdict = None
        if self.trial_from is not None:
            self.recent = ()  # the readings before the trial were at another scale
            if trial_verdict in (RaiseVerdict.SHOWN, RaiseVerdict.EVEN) and math.isfinite(f0):
                verdict, self.failures, self.raises_kept = "keep", 0, self.raises_kept + 1
                self.kept_even += trial_verdict is RaiseVerdict.EVEN
                self.trial_from = None
            else:
                self.scale, self.trial_from, self.last_loss = self.trial_from, None, self.trial_loss
                self.failures, self.trials_undone = self.failures + 1, self.trials_undone + 1
                self.wait, self.previous = 2**self.failures, None
                return "undo"
        frozen = frozen or (first_descent and reach < FIRST_DESCENT_REACH)
        previous, self.previous = self.previous, None if frozen else reach
        if frozen:
            return verdict
        self.recent = (*self.recent, reach)[-STEADY_READINGS:]
        # An aligned run's first steps already said what a second long reading would: one suffices, and so does a
        # first reading, which has no rate yet.
        twice = reach if aligned else min(reach, previous) if previous is not None else 0.0
        steady = statistics.median(self.recent) if len(self.recent) == STEADY_READINGS else 0.0
        most = MAX_STRONGLY_ALIGNED_RAISE if strongly_aligned else MAX_ALIGNED_RAISE if aligned else MAX_RAISE
        by_line = twice / TARGET_REACH if twice >= RAISE_REACH else 0.0
        by_steady = steady / STEADY_TARGET if steady >= STEADY_REACH else 0.0
        wanted = max(min(by_line, most), min(by_steady, MAX_RAISE))
        factor = min(wanted, MAX_SCALE / self.scale)
        progress = rate > 0 if rate is not None else aligned
        if progress and not self.wait and factor > 1.0 and not opposed:
            self.trial_from, self.trial_loss, self.recent = self.scale, f0, ()
            self.scale *= factor
            self.held_by_cap = max(by_line, by_steady) / factor if self.scale >= MAX_SCALE else 1.0
            self.previous = reach / factor
            return "raise"
        return verdict

    @property
    def evidence_building(self) -> bool:
        """Whether the next reading could complete a steady reach, so it should come soon: a median of three at
        STEADY_REACH or more needs two of them there, so one of the last two must be. Readings that read a line
        shorter than that (0-1 steps, as tuned runs read) are no more evidence than readings of 0."""
        return any(reach >= STEADY_REACH for reach in self.recent[-(STEADY_READINGS - 1):])

    @property
    def wants_readings(self) -> bool:
        """Whether a reading can change anything: a trial to judge, or room to raise."""
        return self.on_trial or self.scale < MAX_SCALE

    def guard_flagged(self, weights_damaged: bool) -> None:
        """The guard skipped a step, or rolled the weights back (`weights_damaged`). The steady window starts again,
        and no raise starts before the STEADY_READINGS-th reading from here. After a rollback an open trial is over
        (the rollback undid its steps), and a scale above the user's comes down."""
        self.recent, self.previous, self.wait = (), None, max(self.wait, STEADY_READINGS)
        if not weights_damaged:
            return
        self.last_loss = None  # the weights moved back: the next reading has no progress to compare
        if self.trial_from is not None:
            self.scale, self.trial_from = self.trial_from, None
            self.trials_undone += 1
        if self.scale > 1.0:
            self.scale = max(self.scale / 2, 1.0)
            self.lowered += 1

    @property
    def steps_long_enough(self) -> bool:
        """Whether the last reading says the steps already reach the line's bottom: no jump until the next one."""
        return self.last_reach is not None and self.last_reach < TARGET_REACH

    @property
    def on_trial(self) -> bool:
        return self.trial_from is not None

    @property
    def trial_raise(self) -> float:
        """The factor under trial."""
        return self.scale / self.trial_from

    def stats(self) -> dict:
        """For `hybrid_stats()` (with autopilot/setup.py's `plain_stats` where the autopilot is off)."""
        return {"lr_scale": self.scale, "lr_raises_kept": self.raises_kept, "lr_raises_kept_even": self.kept_even,
                "lr_trials_undone": self.trials_undone, "lr_lowered": self.lowered, "lr_readings": self.readings}

    def state_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def load_state_dict(self, state: dict) -> None:
        for f in fields(self):
            setattr(self, f.name, state[f.name])
