"""The phase state machine: which kind of optimizer step comes next.

Pure Python on purpose (no torch): every rank runs its own copy and must reach the same decision from
the same rank-identical inputs, and a pure machine is easy to test exhaustively and to checkpoint.

    WARMUP --warmup_steps--> FULL --(>= full_required steps, ready, confident)--> PREDICT
    PREDICT --planned length--> CORRECT --correct_steps--> PREDICT again while confident, else FULL
    PREDICT/CORRECT --abort (divergence, rollback)--> FULL
    FULL --(its turn, ready, held: the steps are long enough)--> FULL again, a turn passed

`full_required` starts at `full_steps` and doubles (up to `max_backoff` doublings) each time a
prediction is rolled back (including a jump that failed its payoff check), and halves back each time a
jump pays (passes the payoff check, or without it, comes through its Correct steps). After
`max_rejections` rollbacks in a row the controller retires: it stays in FULL for the rest of the run,
so a run where prediction does not pay stops paying for it altogether.

The confidence costs an ensemble rollout to compute, so the machine says when a decision needs it
(`confidence_due`): at the end of a Correct phase, and in a Full phase once it has run its required
steps. There a check that finds the predictor ready but the confidence too low schedules the next one
`confidence_interval` steps later, doubling with each miss (up to 2**MAX_CHECK_DOUBLINGS times), and a
prediction starts only at a check. A confidence that keeps failing is read less and less often, and
between checks `steps_until_predict` is long enough for a predictor's observation window to close.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from enum import Enum

from ..flags import FlagSettings, flag

MAX_CHECK_DOUBLINGS = 4


class Phase(str, Enum):
    WARMUP = "warmup"
    FULL = "full"
    PREDICT = "predict"
    CORRECT = "correct"

    @property
    def has_backward(self) -> bool:
        return self is not Phase.PREDICT


PHASE_IDS = {Phase.WARMUP: 0, Phase.FULL: 1, Phase.PREDICT: 2, Phase.CORRECT: 3}


@dataclass(frozen=True)
class ControllerConfig(FlagSettings):
    """The Predict/Correct schedule. The flags' defaults are `HybridTrainingArguments`'; `max_backoff` and
    `confidence_interval` are not flags."""

    warmup_steps: int = flag("hybrid_warmup_steps")
    full_steps: int = flag("hybrid_full_steps")
    min_predict_steps: int = flag("hybrid_min_predict_steps")
    max_predict_steps: int = flag("hybrid_max_predict_steps")
    correct_steps: int = flag("hybrid_correct_steps")
    confidence_threshold: float = flag("hybrid_confidence_threshold")
    max_consecutive_predicts: int = flag("hybrid_max_consecutive_predicts")
    max_rejections: int = flag("hybrid_max_rejections")
    max_backoff: int = 6
    confidence_interval: int = 10

    def __post_init__(self) -> None:
        self.at_least(0, "warmup_steps", "correct_steps", "max_rejections", "max_backoff")
        self.at_least(1, "full_steps", "min_predict_steps", "max_consecutive_predicts", "confidence_interval")
        self.require("max_predict_steps", self.max_predict_steps >= self.min_predict_steps,
                     f"must be >= hybrid_min_predict_steps ({self.min_predict_steps})")
        self.require("confidence_threshold", 0.0 <= self.confidence_threshold <= 1.0, "must be in [0, 1]")


@dataclass
class PhaseController:
    config: ControllerConfig
    phase: Phase = Phase.WARMUP
    steps_in_phase: int = 0
    planned_predict_steps: int = 0
    consecutive_predicts: int = 0
    backoff: int = 0
    consecutive_rejections: int = 0
    retired: bool = False
    check_delay: int = 0  # steps past `full_required` at which the Full phase's next confidence check falls
    check_misses: int = 0
    phase_steps: dict[str, int] = field(default_factory=lambda: {p.value: 0 for p in Phase})
    rollbacks: int = 0
    passes: int = 0  # turns passed on `pass_turn`

    def __post_init__(self) -> None:
        if self.config.warmup_steps == 0 and self.phase is Phase.WARMUP:
            self.phase = Phase.FULL

    @property
    def full_required(self) -> int:
        return self.config.full_steps * (2**self.backoff)

    @property
    def steps_until_predict(self) -> float:
        """Optimizer steps, the current one included, before a Predict phase can start at the earliest (0 once
        one may start, or while predicting and correcting; infinite once retired)."""
        if self.retired:
            return math.inf
        if self.phase is Phase.WARMUP:
            return self.config.warmup_steps - self.steps_in_phase + self.full_required
        if self.phase is Phase.FULL:
            return max(self.full_required + self.check_delay - self.steps_in_phase, 0)
        return 0

    @property
    def confidence_due(self) -> bool:
        """Whether the decision at the end of the step under way reads the confidence."""
        cfg = self.config
        if self.retired:
            return False
        if self.phase is Phase.FULL:
            return self.steps_in_phase + 1 >= self.full_required + self.check_delay
        if self.phase is Phase.CORRECT:
            return self.steps_in_phase + 1 >= cfg.correct_steps
        if self.phase is Phase.PREDICT:
            return cfg.correct_steps == 0 and self.steps_in_phase + 1 >= self.planned_predict_steps
        return False

    def predict_length(self, confidence: float) -> int:
        """Longer predict phases for higher confidence, shorter ones after many in a row."""
        cfg = self.config
        damping = 1.0 - min(0.1 * self.consecutive_predicts, 0.5)
        length = math.floor(cfg.max_predict_steps * confidence**2 * damping)
        return max(cfg.min_predict_steps, min(cfg.max_predict_steps, length))

    def _confident(self, confidence: float) -> bool:
        return confidence >= self.config.confidence_threshold

    def _enter(self, phase: Phase) -> None:
        self.phase = phase
        self.steps_in_phase = 0
        self.check_delay = self.check_misses = 0

    def end_step(self, confidence: float, predictor_ready: bool, pass_turn: bool = False) -> Phase:
        """Account for the optimizer step just taken in `self.phase`; return the next step's phase. `pass_turn`: the
        evidence says the steps are long enough; a Predict phase that would start passes its turn (a new Full phase,
        no back-off)."""
        cfg = self.config
        self.phase_steps[self.phase.value] += 1
        self.steps_in_phase += 1
        if self.phase is Phase.WARMUP:
            if self.steps_in_phase >= cfg.warmup_steps:
                self._enter(Phase.FULL)
        elif self.phase is Phase.FULL:
            if self.retired or self.steps_in_phase < self.full_required + self.check_delay:
                return self.phase
            if predictor_ready and pass_turn:
                self.passes += 1
                self._enter(Phase.FULL)
            elif predictor_ready and self._confident(confidence):
                self.consecutive_predicts = 0
                self._start_predict(confidence)
            else:
                # Readiness arrives within steps; a low confidence changes slowly, so it is checked ever less often.
                wait = 1
                if predictor_ready:
                    wait = cfg.confidence_interval * 2 ** min(self.check_misses, MAX_CHECK_DOUBLINGS)
                    self.check_misses += 1
                self.check_delay = self.steps_in_phase - self.full_required + wait
        elif self.phase is Phase.PREDICT:
            if self.steps_in_phase >= self.planned_predict_steps:
                if cfg.correct_steps > 0:
                    self._enter(Phase.CORRECT)
                else:
                    self._after_correct(confidence, predictor_ready)
        elif self.phase is Phase.CORRECT and self.steps_in_phase >= cfg.correct_steps:
            self._after_correct(confidence, predictor_ready)
        return self.phase

    def _start_predict(self, confidence: float) -> None:
        self.planned_predict_steps = self.predict_length(confidence)
        self.consecutive_predicts += 1
        self._enter(Phase.PREDICT)

    def _after_correct(self, confidence: float, predictor_ready: bool) -> None:
        again = self.consecutive_predicts < self.config.max_consecutive_predicts
        if again and predictor_ready and self._confident(confidence):
            self._start_predict(confidence)
        else:
            self.consecutive_predicts = 0
            self._enter(Phase.FULL)

    def abort(self) -> None:
        """A prediction was rolled back: back to FULL, and wait longer before the next one, or retire."""
        self.rollbacks += 1
        self.backoff = min(self.backoff + 1, self.config.max_backoff)
        self.consecutive_rejections += 1
        if self.config.max_rejections and self.consecutive_rejections >= self.config.max_rejections:
            self.retired = True
        self.consecutive_predicts = 0
        self._enter(Phase.FULL)

    def reward(self) -> None:
        """A jump paid (passed its payoff check, or came through its last step where there is none): wait less
        before the next one."""
        self.backoff = max(self.backoff - 1, 0)
        self.consecutive_rejections = 0

    def state_dict(self) -> dict:
        state = asdict(self)
        state.pop("config")
        state["phase"] = self.phase.value
        return state

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, Phase(value) if key == "phase" else value)
        self.phase_steps = dict(self.phase_steps)
