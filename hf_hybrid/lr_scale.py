"""The learning-rate scale as a judged quantity: one multiplier on the user's whole schedule, moved only on evidence.

Pure Python, like the controller: its inputs are probe losses already averaged across ranks, so every rank reaches the
same decision, and its state is a few numbers that a checkpoint carries exactly.

The evidence comes once per outer cycle, from the probe batch at three points on the line the cycle travelled: the
cycle's start (the outer anchor A), its end (the weights W) and twice as far (2W - A). Call their losses f0, f1, f2.
- `rate`: (f0 - f1) / steps, the probe progress of one real step at the current scale. Paired (one batch, three
  weights), so it does not vanish into batch noise the way a loss slope over many batches does in low-LR fine-tuning.
- `reach`: where a parabola through the three points bottoms out, in multiples of the cycle's displacement. Steps of
  the right length end a cycle at or past the bottom of its own line (measured on cpu-finetune: 0.78-0.85 at the swept
  LR); a reach of `raise_reach` or more (1.32-1.39 there at a fifth of it) says the steps could have gone further, the
  sign of a learning rate that is too small. Prodigy reads the same thing from how the gradient lines up with the
  distance travelled; here the probe measures it.

A raise is a trial. When the reach says the steps are too short, the scale is multiplied by `max_raise` (up to
`max_scale`) and the trainer takes an undo point. The next cycle judges it: the raise is kept when its own line does
not overshoot (reach at least `overshoot_reach`) and a real step still made `keep_share` of the progress a step made
before it; otherwise it is undone bit for bit (weights, optimizer state, schedule back to the undo point,
the scale back to what it was). Failed trials back off: the next raise waits 2, 4, ... cycles. Evidence that the
steps overshoot lowers the scale without a trial, since going back toward the user's LR is the safe direction: a
reach under `overshoot_reach` while above the user's LR, and a guard rollback (the weights were damaged).
The scale never goes below the user's LR: a run too fast for its data is the guard's to catch, and a spike from a
bad batch says nothing about the LR. No raise starts once the schedule has decayed below half its peak: the final
decay is the user's.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


def reach_of_line(f0: float, f1: float, f2: float) -> float:
    """The minimum of the parabola through (0, f0), (1, f1), (2, f2); inf where the loss still falls at 2 with no
    curvature to stop it, and 0 where the loss rose from the start."""
    curvature = f0 - 2 * f1 + f2
    descent = f0 - f1 + curvature / 2  # the slope at 0, negated
    if not all(math.isfinite(v) for v in (f0, f1, f2)) or descent <= 0:
        return 0.0
    return descent / curvature if curvature > 0 else math.inf


@dataclass
class LrScale:
    max_scale: float = 10.0
    max_raise: float = 2.0
    raise_reach: float = 1.2  # a line whose bottom is at least this far out asks for a raise
    overshoot_reach: float = 0.6  # one whose bottom is this close says the steps overshoot
    # A raised cycle must keep this share of the per-step progress of the cycle that asked for it: early on, the
    # progress per step falls fast whatever the LR (measured: 0.074 to 0.041 in two cycles of cpu-finetune).
    keep_share: float = 0.5
    scale: float = 1.0
    trial_from: float | None = None  # the scale before the raise under trial
    trial_rate: float = 0.0  # the per-step progress that asked for it
    wait: int = 0  # cycles before the next raise may start
    failures: int = 0  # trials undone in a row
    raises_kept: int = 0
    trials_undone: int = 0
    lowered: int = 0

    def cycle(self, f0: float, f1: float, f2: float, steps: int, decayed: bool) -> str | None:
        """One cycle's evidence. Returns what the trainer must do: "raise", "keep" (a trial passed; the scale may have
        risen again), "undo" (restore the undo point: the scale is already back), "lower", or None."""
        if steps <= 0:  # no displacement to read
            return None
        rate = (f0 - f1) / steps if math.isfinite(f0 - f1) else -math.inf
        reach = reach_of_line(f0, f1, f2)
        self.wait = max(self.wait - 1, 0)
        verdict = None
        if self.trial_from is not None:
            if rate > self.keep_share * self.trial_rate and reach >= self.overshoot_reach:
                verdict, self.failures, self.raises_kept = "keep", 0, self.raises_kept + 1
                self.trial_from = None
            else:
                self.scale, self.trial_from = self.trial_from, None
                self.failures, self.trials_undone = self.failures + 1, self.trials_undone + 1
                self.wait = 2 ** self.failures
                return "undo"
        if reach < self.overshoot_reach and self.scale > 1.0:
            self.scale = max(self.scale / 2, 1.0)
            self.lowered += 1
            return "lower"
        factor = min(self.max_raise, self.max_scale / self.scale)
        if reach >= self.raise_reach and rate > 0 and not decayed and not self.wait and factor > 1.0:
            self.trial_from, self.trial_rate = self.scale, rate
            self.scale *= factor
            return "raise"
        return verdict

    def weights_damaged(self) -> None:
        """A guard rollback: the weights went bad. An open trial is over (the rollback undid its steps), and a scale
        above the user's comes down."""
        if self.trial_from is not None:
            self.scale, self.trial_from = self.trial_from, None
            self.trials_undone += 1
        if self.scale > 1.0:
            self.scale = max(self.scale / 2, 1.0)
            self.lowered += 1

    @property
    def on_trial(self) -> bool:
        return self.trial_from is not None

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)
