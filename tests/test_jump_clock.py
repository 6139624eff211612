"""The jump clock: a jump's wall time against the payoff check's charge, said in one line only when it is well over,
with the flag value that charges it; it decides nothing."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

from hf_hybrid import Phase
from hf_hybrid.jumps.clock import JumpClock
from hf_hybrid.jumps.engine import HybridEngine
from hf_hybrid.jumps.payoff import PayoffMeter

from .conftest import make_trainer


def clocked(monkeypatch, steps: list[tuple], payoff_check: bool = True) -> JumpClock:
    """A clock fed `(phase, seconds, charge, steps_in_phase, seconds_between)` per step, against a stand-in trainer:
    `seconds_between` pass after the step ends, as an evaluation or a save does."""
    checks = SimpleNamespace(payoff_check=payoff_check, predict_step_cost=0.35)
    engine = SimpleNamespace(payoff=SimpleNamespace(clock=0.0), last_record=None, controller=None)
    clock = JumpClock(SimpleNamespace(hybrid_engine=engine,
                                     hybrid_config=SimpleNamespace(jumps=SimpleNamespace(checks=checks))))
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    for phase, seconds, charge, steps_in_phase, between in steps:
        engine.controller = SimpleNamespace(phase=phase, steps_in_phase=steps_in_phase)
        clock.on_step_begin(None, None, None)
        now[0] += seconds
        engine.payoff.clock += charge
        engine.last_record = SimpleNamespace(phase=phase)
        clock.on_step_end(None, None, None)
        now[0] += between
    return clock


def run_with_jumps(jump_seconds: float, jumps: int = 5, after: float = 1.25, between: float = 0.0) -> list:
    """Real steps of 1 s between jumps; each jump a Predict step of `jump_seconds` charged 0.7, the step after it
    `after` s (the next cycle's start), the first jump slower (it allocates); `between` s after each jump's step."""
    steps = [(Phase.FULL, 1.0, 1.0, 0, 0.0)] * 5
    for i in range(jumps):
        steps += [(Phase.PREDICT, jump_seconds + (5.0 if i == 0 else 0.0), 0.7, 0, between),
                  (Phase.FULL, after, 1.0, 0, 0.0)]
        steps += [(Phase.FULL, 1.0, 1.0, 0, 0.0)] * 4
    return steps


def test_a_jump_that_costs_well_over_its_charge_is_told_with_the_flag_that_charges_it(monkeypatch):
    clock = clocked(monkeypatch, run_with_jumps(1.5))
    line = clock.advice()
    # (1.5 + 1.25 - 1) / 1 = 1.75 real steps against 0.7 charged: 0.35 * 1.75 / 0.7 = 0.875.
    assert line is not None and "a jump took 1.8 real steps of wall time (the median of 4)" in line
    assert "the payoff check charged 0.7" in line and "--hybrid_predict_step_cost 0.88" in line
    clock.on_train_begin()  # a second train() call starts its own count
    assert clock.advice() is None


def test_no_line_near_the_charge_without_the_payoff_check_or_with_few_jumps(monkeypatch):
    assert clocked(monkeypatch, run_with_jumps(1.0)).advice() is None  # 1.25 steps against 0.7: within 2x
    # An evaluation deferred past a jump runs between steps: it is not the jump's time.
    assert clocked(monkeypatch, run_with_jumps(1.0, between=10.0)).advice() is None
    assert clocked(monkeypatch, run_with_jumps(1.5), payoff_check=False).advice() is None  # nothing charged to decide
    assert clocked(monkeypatch, run_with_jumps(1.5, jumps=3)).advice() is None  # 2 timed after the first: too few


def test_a_jump_right_after_another_is_its_own_and_leaves_the_first_untimed(monkeypatch):
    """Two one-step Predict phases in a row (velocity or adam without Correct steps) are two jumps, each charged on
    its own; the first has no real step after it to time."""
    steps = run_with_jumps(1.5)
    steps[6:6] = [(Phase.PREDICT, 1.5, 0.7, 0, 0.0)]  # a second jump right after the first
    clock = clocked(monkeypatch, steps)
    assert len(clock.jumps) == 5 and all(abs(charged - 0.7) < 1e-9 for _, charged, _ in clock.jumps)


def test_the_trainer_says_it_when_its_jumps_are_slow(tmp_path, monkeypatch, caplog):
    """Each jump made 0.3 s slower than its forwards, on a clock of its own: the jump clock reads a counter that moves
    1 ms a reading, and 0.3 s more in each jump, so the result does not hang on the machine's load."""
    apply = HybridEngine.apply_prediction
    now = [0.0]

    def tick() -> float:
        now[0] += 1e-3
        return now[0]

    def slow_apply(self, *args, **kwargs):
        now[0] += 0.3
        return apply(self, *args, **kwargs)

    monkeypatch.setattr("hf_hybrid.jumps.clock.time", SimpleNamespace(perf_counter=tick))
    monkeypatch.setattr(HybridEngine, "apply_prediction", slow_apply)
    monkeypatch.setattr(PayoffMeter, "verdict", lambda self, gain, noise: True)  # every period has its jump
    trainer = make_trainer(tmp_path, hybrid_predictor="outer", hybrid_outer_period=4, hybrid_warmup_steps=4,
                           hybrid_payoff_check=True, hybrid_lr_autopilot=False, max_steps=40)
    with caplog.at_level(logging.WARNING, logger="hf_hybrid"):
        trainer.train()
    assert trainer.hybrid_stats()["predict_steps"] >= 4
    lines = [r.getMessage() for r in caplog.records if "real steps of wall time" in r.getMessage()]
    assert len(lines) == 1 and "--hybrid_predict_step_cost" in lines[0], lines
