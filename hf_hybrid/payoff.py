"""Does prediction pay? Loss progress per unit of cost, predicted steps against real ones.

The clock is in cost units, not seconds: a real step costs 1, a predicted step with a monitoring
forward costs `monitored_cost` (about 1/3 by the forward:backward ratio), one without costs
`unmonitored_cost`. Wall time would make phase decisions differ between ranks and between a resumed
run and an uninterrupted one; the benchmark measures the real ratio so the cost can be set to it.

Before a predict phase, a least-squares line through the recent real-step losses gives the loss
level and the rate at which plain training was improving. After it, the losses of the next real steps
are compared with where plain training would have been for the same cost. A noisy verdict is
smoothed by an EMA of the normalized advantage; the controller backs off while it is negative.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept at the last x, slope)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = 0.0 if sxx == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my + slope * (xs[-1] - mx), slope


@dataclass
class PayoffMeter:
    monitored_cost: float = 0.35
    unmonitored_cost: float = 0.02
    window: int = 64
    smoothing: float = 0.3
    clock: float = 0.0
    history: deque = field(default_factory=deque)
    start_clock: float | None = None
    start_loss: float = 0.0
    start_rate: float = 0.0
    noise: float = 1.0
    pending: list = field(default_factory=list)
    advantage: float = 0.0
    verdicts: int = 0

    def tick_real(self, loss: float) -> None:
        self.clock += 1.0
        self.history.append((self.clock, loss))
        while len(self.history) > self.window:
            self.history.popleft()

    def tick_predict(self, monitored: bool) -> None:
        self.clock += self.monitored_cost if monitored else self.unmonitored_cost

    def begin_prediction(self) -> None:
        """Remember where plain training stood and how fast it was improving."""
        if self.start_clock is not None:  # a chained predict phase: keep the first reference point
            return
        xs = [x for x, _ in self.history]
        ys = [y for _, y in self.history]
        if len(xs) < 2:
            self.start_loss, self.start_rate, self.noise = (ys[-1] if ys else 0.0), 0.0, 1.0
        else:
            level, slope = fit_line(xs, ys)
            resid = [y - (level + slope * (x - xs[-1])) for x, y in zip(xs, ys)]
            self.start_loss, self.start_rate = level, max(-slope, 0.0)
            self.noise = max((sum(r * r for r in resid) / len(resid)) ** 0.5, 1e-6)
        self.start_clock = self.clock

    @property
    def judging(self) -> bool:
        return self.start_clock is not None

    def judge(self, loss: float, needed: int) -> bool | None:
        """Feed one real-step loss after a prediction; after `needed` of them, return whether it paid."""
        if self.start_clock is None:
            return None
        expected = self.start_loss - self.start_rate * (self.clock - self.start_clock)
        self.pending.append((expected - loss) / self.noise)
        if len(self.pending) < max(needed, 1):
            return None
        step_advantage = sum(self.pending) / len(self.pending)
        self.advantage = (1 - self.smoothing) * self.advantage + self.smoothing * step_advantage
        self.verdicts += 1
        self.pending = []
        self.start_clock = None
        return self.advantage >= 0.0

    def cancel(self) -> None:
        """A rolled-back prediction is judged by the rollback itself."""
        self.pending = []
        self.start_clock = None

    def state_dict(self) -> dict:
        state = {k: getattr(self, k) for k in self.__dataclass_fields__}
        state["history"] = [list(p) for p in self.history]
        return state

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, deque(tuple(p) for p in value) if key == "history" else value)
