"""The raised scale's way back down, where the user's schedule has none of its own.

A raise is judged about ten steps on, and a higher LR that leads there can still end the run higher: from scratch at a
constant LR, twice the user's LR leads for the first hundred steps and ends higher, because a constant LR ends the run
at its own noise level (tests/test_lr_cooldown.py, the short-horizon trap; scripts/verdict_horizon.py shows the verdict
cannot see that far). A schedule that decays (linear, cosine, warmup-stable-decay) takes a raised scale down with it
and ends low whatever the scale; one that ends above half its peak (constant, constant with warmup) does not. There the
scale returns to the user's LR over the run's last COOLDOWN_SHARE of steps, linearly, so the run ends at the LR the
user gave, as a warmup-stable-decay schedule ends at its floor (docs/benchmarks.md, "The return to the user's LR under
a schedule with no decay").
"""

from __future__ import annotations

import math
from collections.abc import Callable

# The last fifth: the share warmup-stable-decay schedules commonly decay over (the survey's, too).
COOLDOWN_SHARE = 0.2
# A schedule below half its peak is in its final decay: it takes a raised scale down itself, and no raise starts there.
HALF_PEAK = 0.5


def schedule_factor(lr_lambdas: list[Callable[[int], float]], position: int) -> float:
    """The user's schedule's own factor at `position` (the lowest of its parameter groups')."""
    return min(f(position) for f in lr_lambdas)


def cooldown_start(lr_lambdas: list[Callable[[int], float]], max_steps: int) -> int | None:
    """The schedule position where the scale starts back to 1, or None where the schedule's own factor is below half
    its peak by the run's end (it decays the raised scale itself)."""
    if schedule_factor(lr_lambdas, max_steps) < HALF_PEAK:
        return None
    return max_steps - max(1, math.ceil(COOLDOWN_SHARE * max_steps))


def cooled_scale(scale: float, position: int, start: int | None, max_steps: int) -> float:
    """The multiplier in effect at schedule position `position`: `scale` until `start`, then linearly down to 1 at
    `max_steps`."""
    if start is None or position <= start or scale == 1.0:
        return scale
    left = max(max_steps - position, 0) / (max_steps - start)
    return 1.0 + (scale - 1.0) * left
