"""The phase state machine, on its own (no torch)."""

from __future__ import annotations

import math
import re
from dataclasses import replace
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_hybrid.config import hybrid_config
from hf_hybrid.jumps.controller import ControllerConfig, Phase, PhaseController


def schedule(**changes) -> ControllerConfig:
    """The flags' default schedule, with a one-step shortest Predict phase and a 0.85 confidence gate unless
    changed: the machine these tests drive."""
    defaults = hybrid_config(SimpleNamespace()).jumps.schedule
    return replace(defaults, **{"min_predict_steps": 1, "confidence_threshold": 0.85, **changes})


def run(controller: PhaseController, steps: int, confidence: float = 1.0, ready: bool = True) -> list[Phase]:
    phases = []
    for _ in range(steps):
        phases.append(controller.phase)
        controller.end_step(confidence, ready)
    return phases


def test_cycle_warmup_full_predict_correct():
    c = PhaseController(schedule(warmup_steps=2, full_steps=3, min_predict_steps=1, max_predict_steps=4,
                                         correct_steps=2, max_consecutive_predicts=2))
    phases = [p.value for p in run(c, 2 + 3 + 4 + 2 + 3 + 2 + 3)]
    # The second Predict phase in a row is damped: floor(4 * 0.9) = 3 steps.
    assert phases == (["warmup"] * 2 + ["full"] * 3 + ["predict"] * 4 + ["correct"] * 2 + ["predict"] * 3
                      + ["correct"] * 2 + ["full"] * 3)


def test_low_confidence_never_predicts():
    c = PhaseController(schedule(warmup_steps=1, full_steps=1, confidence_threshold=0.9))
    assert Phase.PREDICT not in run(c, 50, confidence=0.5)


def test_threshold_zero_predicts_whenever_schedule_allows():
    c = PhaseController(schedule(warmup_steps=0, full_steps=1, confidence_threshold=0.0,
                                         min_predict_steps=2, max_predict_steps=8))
    phases = run(c, 4, confidence=0.0)
    assert phases == [Phase.FULL, Phase.PREDICT, Phase.PREDICT, Phase.CORRECT]


def test_predict_length_follows_confidence_and_damping():
    c = PhaseController(schedule(min_predict_steps=1, max_predict_steps=20))
    assert c.predict_length(1.0) == 20
    assert c.predict_length(0.5) == 5
    c.consecutive_predicts = 5
    assert c.predict_length(1.0) == 10


def test_abort_backs_off_and_reward_recovers():
    c = PhaseController(schedule(warmup_steps=0, full_steps=2))
    c.phase = Phase.PREDICT
    c.abort()
    assert c.phase is Phase.FULL and c.rollbacks == 1 and c.full_required == 4
    c.abort()
    assert c.full_required == 8
    c.reward()
    assert c.full_required == 4


def test_steps_until_predict_counts_down_to_the_next_predict_phase():
    c = PhaseController(schedule(warmup_steps=3, full_steps=2, min_predict_steps=2, max_predict_steps=2,
                                         correct_steps=1, max_consecutive_predicts=1))
    phases, countdown = [], []
    for step in range(30):
        if step == 12:
            c.abort()  # a rollback: the next Full phase is twice as long
        phases.append(c.phase)
        countdown.append(c.steps_until_predict)
        c.end_step(1.0, True)
    predict_at = [i for i, phase in enumerate(phases) if phase is Phase.PREDICT]
    checked = []
    for i, phase in enumerate(phases[:predict_at[-1]]):
        if phase in (Phase.WARMUP, Phase.FULL):
            assert countdown[i] == next(j for j in predict_at if j >= i) - i, (i, phases, countdown)
            checked.append(countdown[i])
        else:
            assert countdown[i] == 0
    assert max(checked) == 3 + 2 and 4 in checked  # warmup plus Full; the backed-off Full phase


def test_repeated_rejections_retire_and_a_kept_jump_resets_the_count():
    c = PhaseController(schedule(warmup_steps=0, full_steps=1, max_rejections=3))
    for _ in range(2):
        c.abort()
    c.reward()  # a kept jump: the rejections are no longer in a row
    for _ in range(2):
        c.abort()
    assert not c.retired and c.steps_until_predict < math.inf
    c.abort()
    assert c.retired and c.steps_until_predict == math.inf
    assert set(run(c, 5000, confidence=1.0)) == {Phase.FULL}
    assert not c.confidence_due

    never = PhaseController(schedule(warmup_steps=0, full_steps=1, max_rejections=0, max_backoff=2))
    for _ in range(20):
        never.abort()
    assert not never.retired and Phase.PREDICT in run(never, 10, confidence=1.0)


def test_confidence_is_read_ever_less_often_while_it_fails_and_at_each_correct_end():
    c = PhaseController(schedule(warmup_steps=2, full_steps=3, confidence_threshold=0.5, correct_steps=2,
                                         min_predict_steps=2, max_predict_steps=2, confidence_interval=4))
    due, countdown = [], []
    for _ in range(40):
        due.append(c.confidence_due)
        countdown.append(c.steps_until_predict)
        c.end_step(0.9 if not c.confidence_due else 0.0, True)  # confident only where nobody looks
    # Full starts at step 2 and has done its 3 required steps at the end of step 4; then 4, 8, 16 steps later.
    checks = [i for i, d in enumerate(due) if d]
    assert checks == [4, 8, 16, 32] and c.phase is Phase.FULL
    assert all(countdown[i] == next(j for j in checks if j >= i) - i + 1 for i in range(2, 33)), countdown
    # Not ready at a check: readiness comes within steps, so the next step checks again.
    c = PhaseController(schedule(warmup_steps=0, full_steps=2, confidence_interval=4, correct_steps=2,
                                         min_predict_steps=2, max_predict_steps=2))
    c.end_step(1.0, False)
    assert c.confidence_due
    c.end_step(1.0, False)
    assert c.confidence_due and c.steps_until_predict == 1
    c.end_step(1.0, True)
    assert c.phase is Phase.PREDICT
    phases, due = [], []
    for _ in range(4):
        phases.append(c.phase)
        due.append(c.confidence_due)
        c.end_step(0.0, True)
    assert phases == [Phase.PREDICT] * 2 + [Phase.CORRECT] * 2 and due == [False, False, False, True]


@pytest.mark.parametrize("kwargs,named", [
    (dict(full_steps=0), "--hybrid_full_steps: must be >= 1 (got 0)"),
    (dict(warmup_steps=-1), "--hybrid_warmup_steps: must be >= 0"),
    (dict(confidence_threshold=1.5), "--hybrid_confidence_threshold: must be in"),
    (dict(min_predict_steps=5, max_predict_steps=2), "--hybrid_max_predict_steps: must be >= hybrid_min_predict_steps"),
    (dict(max_rejections=-1), "--hybrid_max_rejections"),
    (dict(confidence_interval=0), "--confidence_interval: must be >= 1"),
])
def test_config_rejects_bad_values_naming_the_flag(kwargs, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        schedule(**kwargs)


events = st.lists(st.tuples(st.floats(0, 1), st.booleans(), st.sampled_from(["step", "step", "step", "abort",
                                                                              "reward"])),
                  min_size=1, max_size=300)


@settings(max_examples=150, deadline=None)
@given(events=events, warmup=st.integers(0, 5), full=st.integers(1, 5), max_predict=st.integers(1, 6),
       correct=st.integers(0, 3), threshold=st.floats(0, 1), max_rejections=st.integers(0, 4))
def test_invariants_under_random_inputs(events, warmup, full, max_predict, correct, threshold, max_rejections):
    cfg = schedule(warmup_steps=warmup, full_steps=full, min_predict_steps=1, max_predict_steps=max_predict,
                           correct_steps=correct, confidence_threshold=threshold, max_consecutive_predicts=3,
                           max_rejections=max_rejections)
    c = PhaseController(cfg)
    steps = 0
    run_length, previous = 0, None
    for confidence, ready, event in events:
        if event == "abort":
            if c.phase in (Phase.PREDICT, Phase.CORRECT):
                c.abort()
                assert c.phase is Phase.FULL
            continue
        if event == "reward":
            c.reward()
            continue
        phase = c.phase
        run_length = run_length + 1 if phase is previous else 1
        previous = phase
        assert phase is not Phase.WARMUP or steps < warmup
        if phase is Phase.PREDICT:
            # Without Correct steps, chained Predict phases run back to back.
            assert run_length <= max_predict * (1 if correct else cfg.max_consecutive_predicts)
            assert steps >= warmup + full
        assert c.consecutive_predicts <= cfg.max_consecutive_predicts
        new = c.end_step(confidence, ready)
        steps += 1
        if new is Phase.PREDICT and phase is not Phase.PREDICT:
            assert ready and confidence >= threshold
        if phase is Phase.PREDICT and new is not Phase.PREDICT and correct > 0:
            assert new is Phase.CORRECT
        assert sum(c.phase_steps.values()) == steps
        assert 0 <= c.backoff <= cfg.max_backoff
        assert not c.retired or (c.phase is Phase.FULL and max_rejections > 0)


@settings(max_examples=50, deadline=None)
@given(confidences=st.lists(st.floats(0, 1), min_size=1, max_size=80), cut=st.integers(0, 79))
def test_state_dict_round_trip_continues_identically(confidences, cut):
    cfg = schedule(warmup_steps=2, full_steps=2, max_predict_steps=5, correct_steps=1,
                           confidence_threshold=0.3)
    a = PhaseController(cfg)
    cut = min(cut, len(confidences))
    for conf in confidences[:cut]:
        a.end_step(conf, True)
    b = PhaseController(cfg)
    b.load_state_dict(a.state_dict())
    for conf in confidences[cut:]:
        assert a.end_step(conf, True) == b.end_step(conf, True)
    assert a.state_dict() == b.state_dict()


def test_a_held_turn_passes_without_a_jump_or_back_off_and_the_next_turn_comes_a_full_phase_later():
    c = PhaseController(schedule(warmup_steps=1, full_steps=3, min_predict_steps=1, max_predict_steps=1,
                                         correct_steps=0, confidence_threshold=0.0, max_consecutive_predicts=1))
    phases = []
    for step in range(11):
        phases.append(c.phase.value)
        c.end_step(1.0, True, pass_turn=step < 7)  # passed at the turns after steps 3 and 6, not at the one after 9
    assert phases == ["warmup"] + ["full"] * 9 + ["predict"]
    assert (c.passes, c.backoff, c.rollbacks, c.consecutive_rejections) == (2, 0, 0, 0)
    restored = PhaseController(c.config)
    restored.load_state_dict(c.state_dict())
    assert restored.passes == 2
