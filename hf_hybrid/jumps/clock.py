"""What a jump costs in wall time on this machine, against what the payoff check charges for it.

The payoff check decides on a cost clock (jumps/payoff.py: a real step costs 1, a forward `--hybrid_predict_step_cost`),
so that every rank and a resumed run decide alike. The clock counts forwards, not copies: on a GPU a jump also moves the
outer state over the host link, and takes far more than its charge; on a CPU, somewhat more
(docs/benchmarks-history.md, "What the payoff check charges a jump, against its wall time"). Such a check keeps jumps
that gain less than they cost. This clock times the run's own steps, decides nothing, and at the end says in one line
when the jumps cost well over their charge, with the flag value that would charge what they cost.
"""

from __future__ import annotations

import statistics
import time

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ..loop.seam import HybridTrainer
from .controller import Phase

MIN_JUMPS = 3  # timed jumps, the first (which allocates the jump's buffers) left out
MIN_OVERCHARGE = 2.0  # the measured cost over the charge worth a line: above a CPU jump's


class JumpClock(TrainerCallback):
    """Times each optimizer step from its start to its end (the loop's evaluations and saves come after, and stay
    out). A jump's cost is its Predict steps' time plus what the real step after it took beyond a real step's median
    (that step starts the next cycle: the anchor's copy out, the guard's snapshot); its charge is what the payoff clock
    advanced over its Predict steps. A jump right after another leaves the first untimed."""

    def __init__(self, trainer: HybridTrainer) -> None:
        self.trainer = trainer
        self.on_train_begin()

    def on_train_begin(self, *args, **kwargs) -> None:
        """Each `train()` call is timed on its own."""
        self.started: tuple[float, float, bool] | None = None  # the step's start: time, payoff clock, a jump's first
        self.real: list[float] = []  # real steps that do not follow a jump
        self.jumps: list[list[float]] = []  # per jump: [its Predict steps' seconds, charge, the step after's seconds]
        self.open_jump: list[float] | None = None

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        engine = self.trainer.hybrid_engine
        if engine is not None:
            controller = engine.controller
            self.started = (time.perf_counter(), engine.payoff.clock,
                            controller.phase is Phase.PREDICT and controller.steps_in_phase == 0)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        engine = self.trainer.hybrid_engine
        if engine is None or engine.last_record is None or self.started is None:
            return
        began, clock, jump_starts = self.started
        seconds, charged, self.started = time.perf_counter() - began, engine.payoff.clock - clock, None
        if engine.last_record.phase.has_backward:
            if self.open_jump is not None:
                self.jumps.append([*self.open_jump, seconds])
                self.open_jump = None
            else:
                self.real.append(seconds)
        elif jump_starts:
            self.open_jump = [seconds, charged]
        elif self.open_jump is not None:  # not a jump begun before this train() call (a resumed run's)
            self.open_jump[0] += seconds
            self.open_jump[1] += charged

    def advice(self) -> str | None:
        """The line, when the timed jumps cost well over what the payoff check charged for them; None otherwise."""
        checks = self.trainer.hybrid_config.jumps.checks
        timed = self.jumps[1:]
        if not checks.payoff_check or len(timed) < MIN_JUMPS or len(self.real) < MIN_JUMPS:
            return None
        step = statistics.median(self.real)
        cost = statistics.median((predict + after - step) / step for predict, _, after in timed)
        charge = statistics.median(charged for _, charged, _ in timed)
        if charge <= 0 or cost < MIN_OVERCHARGE * charge:
            return None
        suggested = checks.predict_step_cost * cost / charge
        return (f"hf_hybrid: on this machine a jump took {cost:.1f} real steps of wall time (the median of "
                f"{len(timed)}), where the payoff check charged {charge:.1f}, so it may keep jumps that gain less than "
                f"they cost; --hybrid_predict_step_cost {suggested:.2f} charges about what they cost here.")
