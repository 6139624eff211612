"""A raise past MAX_ALIGNED_RAISE, ramped in: the scale in effect climbs to it linearly over RAMP_STEPS steps.

Only a strongly aligned run's raise can go past MAX_ALIGNED_RAISE (autopilot/scale.py): up to the 32x cap at once,
sized by a line that may show no bottom. Made at once, such a raise can end a run higher than the same LR reached over
a few steps: the plain Trainer on the hybrid's path does, on a LoRA at a tenth of its swept LR (docs/benchmarks.md, "Two
fresh settings, never tuned on"). Over RAMP_STEPS steps the raise keeps most of its gain there (docs/benchmarks.md, "A
raise past 4x ramped in over 5 steps"). Raises of up to 4x take effect at once, as every report measures them.

The verdict (autopilot/verdict.py) sets the raised weights against where the user's LR would have taken them over the
same batches. Adam's steps are proportional to the learning rate, so under a ramp the raised steps went the mean scale
in effect over them times as far as the user's would have, not the full raise: that mean is the raise it reads. No
raise starts while a ramp is under way (`under_way`): on top of one, the steps it would be judged against are the
ramp's own, still climbing, and an undo would drop the rest of the ramp at once.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

from .scale import MAX_ALIGNED_RAISE

RAMP_STEPS = 5


@dataclass
class RaiseRamp:
    """The ramp, in schedule positions: the scale in effect for the step after `position` (the schedule's `last_epoch`
    when the LR is set) climbs from `start_scale`, the scale before the raise, by a RAMP_STEPS-th of the way at `start`,
    to `judged` at `start + RAMP_STEPS - 1`. A judged scale other than `judged` (the raise was undone, or the guard
    lowered it) ends the ramp."""

    start: int | None = None
    start_scale: float = 1.0
    judged: float = 1.0

    def begin(self, position: int, before: float, raised: float) -> None:
        """A raise from the judged scale `before` to `raised`, at `position`: ramped in when it goes past
        MAX_ALIGNED_RAISE, at once otherwise."""
        if raised / before > MAX_ALIGNED_RAISE:
            self.start, self.start_scale, self.judged = position, before, raised
        else:
            self.start = None

    def under_way(self, judged: float, position: int) -> bool:
        """Whether the step after `position` is still short of the judged scale: no raise may start there."""
        return self.in_effect(judged, position) != judged

    def in_effect(self, judged: float, position: int) -> float:
        """The scale for the step after `position`: the judged one, or on its way there."""
        if self.start is None or judged != self.judged:
            return judged
        done = (position - self.start + 1) / RAMP_STEPS
        if done >= 1.0:
            return judged  # exactly: a checkpoint or a report compares scales bit for bit
        return self.start_scale + (judged - self.start_scale) * max(done, 0.0)

    def moving(self, judged: float, position: int) -> bool:
        """Whether the scale in effect after `position` differs from the one before it."""
        return self.start is not None and judged == self.judged and 0 <= position - self.start < RAMP_STEPS

    def share(self, judged: float, position: int) -> float:
        """The scale in effect after `position` as a share of the judged one: a reading along a step at that scale
        reads steps that much shorter than the judged scale's, as it reads a warmup's (autopilot/scale.py,
        `schedule_factor`)."""
        return self.in_effect(judged, position) / judged

    def mean_raise(self, before: float, judged: float, position: int, steps: int) -> float:
        """The raise under trial as the last `steps` steps up to `position` took it: the mean scale in effect over
        them, over the scale `before` the raise."""
        scales = [self.in_effect(judged, p) for p in range(position - steps, position)]
        if all(scale == judged for scale in scales):  # no ramp over them: the raise itself, exactly
            return judged / before
        return statistics.fmean(scales) / before

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        self.start, self.start_scale, self.judged = state["start"], state["start_scale"], state["judged"]
