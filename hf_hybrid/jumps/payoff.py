"""Does a prediction pay? Its measured gain on a probe batch against what plain training would have gained.

The clock is in cost units, not seconds: a real step costs 1, a forward pass over a step's batches (a checked
predicted step) costs `forward_cost` (about 1/3 by the forward:backward ratio), a probe, which is one micro-batch of
the step's `accumulation`, that cost over `accumulation`, and an unchecked predicted step costs `unmonitored_cost`.
Wall time would make decisions differ between ranks and between a resumed run and an uninterrupted one; the
benchmark measures the real ratio so the cost can be set to it.

Before a Predict phase, a least-squares line through the recent real-step losses gives the rate at which
plain training was improving per unit cost. What a kept jump was worth in real steps is counted against a better
measure where the outer predictor gives one (`use_rate`): the probe's loss at the cycle's start and end, per real step
of the cycle. The slope of a noisy loss is often flat or rising in low-LR fine-tuning, and would count kept jumps as
worth 0 steps exactly where they pay. The phase's gain is measured on one probe batch (the phase's first batch, which no
step trains on) at the weights before and after the predicted deltas: a paired difference, free of the batch-to-batch
noise that swamps a comparison of different batches' losses.
The prediction pays when that gain is at least what plain training would have made for the phase's cost, by
`noise_margin` standard errors of the gain: one batch is a sample of sequences, and a gain that a few of them carry
is noise, which a kept jump leaves in the run (docs/benchmarks-history.md, "the jumps at a high LR").
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


def fit_slope(xs: list[float], ys: list[float]) -> float:
    """The least-squares line's slope."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    return 0.0 if sxx == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


@dataclass
class PayoffMeter:
    forward_cost: float  # --hybrid_predict_step_cost
    noise_margin: float  # --hybrid_probe_noise_margin: standard errors of the gain a kept jump must clear
    accumulation: int = 1  # micro-batches per optimizer step
    unmonitored_cost: float = 0.02
    window: int = 64
    smoothing: float = 0.3
    clock: float = 0.0
    history: deque = field(default_factory=deque)
    start_clock: float | None = None
    start_rate: float = 0.0
    last_gain: float = 0.0
    last_required: float = 0.0
    last_noise: float = 0.0
    advantage: float = 0.0
    verdicts: int = 0
    paid: int = 0
    kept_gain: float = 0.0  # probe loss gained by the jumps that were kept
    kept_worth: float = 0.0  # what those gains would have cost plain training, in real steps
    probe_rate: float | None = None  # plain training's rate on this jump's probe (`use_rate`), when measured

    def tick_real(self, loss: float) -> None:
        self.clock += 1.0
        self.history.append((self.clock, loss))
        while len(self.history) > self.window:
            self.history.popleft()

    def tick_probe(self) -> None:
        self.clock += self.forward_cost / self.accumulation

    def tick_predict(self, monitored: bool) -> None:
        self.clock += self.forward_cost if monitored else self.unmonitored_cost

    def begin_prediction(self) -> None:
        """Remember how fast plain training was improving, per unit cost."""
        xs = [x for x, _ in self.history]
        ys = [y for _, y in self.history]
        self.start_rate = max(-fit_slope(xs, ys), 0.0) if len(xs) >= 2 else 0.0
        self.start_clock = self.clock

    def use_rate(self, rate: float) -> None:
        """Plain training's rate measured on the probe itself (the cycle's start and end, one batch): paired, so
        it holds where the loss slope over many batches is flat or noise, as in low-LR fine-tuning. It counts what
        a kept jump was worth in steps; the verdict keeps the slope."""
        self.probe_rate = max(rate, 0.0)

    def verdict(self, gain: float, noise: float = 0.0) -> bool:
        """`gain`: probe loss before minus after the predicted deltas; `noise`: its standard error over the probe's
        sequences (0 where unknown). True when it beat plain training by `noise_margin` standard errors."""
        required = self.start_rate * (self.clock - (self.start_clock or self.clock))
        self.last_gain, self.last_required, self.last_noise = gain, required, noise
        finite = math.isfinite(gain) and math.isfinite(noise)
        paid = finite and gain - self.noise_margin * noise >= required
        self.advantage = (1 - self.smoothing) * self.advantage + self.smoothing * (gain - required if finite else 0.0)
        self.verdicts += 1
        self.paid += int(paid)
        if paid:
            self.kept_gain += gain
            rate = self.probe_rate if self.probe_rate is not None else self.start_rate
            self.kept_worth += gain / rate if rate > 0 else 0.0
        self.start_clock, self.probe_rate = None, None
        return paid

    def cancel(self) -> None:
        self.start_clock, self.probe_rate = None, None

    def state_dict(self) -> dict:
        # Settings come from the flags of the run that resumes, not from the checkpoint.
        settings = ("forward_cost", "accumulation", "unmonitored_cost", "window", "smoothing", "noise_margin")
        state = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in settings}
        state["history"] = [list(p) for p in self.history]
        return state

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, deque(tuple(p) for p in value) if key == "history" else value)
