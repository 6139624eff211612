"""The end-of-training word on the learning rate: said when kept jumps keep paying, silent at a tuned one."""

from __future__ import annotations

import logging

from hf_hybrid.jumps.lr_advice import jump_advice, jump_summary

from .conftest import make_trainer

# Short cycles for a 120-step run of the tiny model, whose tuned learning rate is about 3e-3.
OUTER = dict(hybrid_predictor="outer", hybrid_outer_period=5, hybrid_outer_lr=0.7, hybrid_outer_momentum=0.5,
             hybrid_payoff_check=True, hybrid_loss_band=3.0, max_steps=120, logging_steps=1000)


def advice_after_training(tmp_out, learning_rate: float, caplog) -> tuple[dict, str]:
    trainer = make_trainer(tmp_out, learning_rate=learning_rate, hybrid_lr_autopilot=False, **OUTER)
    with caplog.at_level(logging.WARNING):
        trainer.train()
    return trainer.hybrid_stats(), caplog.text


def test_a_too_small_learning_rate_is_named_with_a_factor(tmp_out, caplog):
    stats, log = advice_after_training(tmp_out, 1e-4, caplog)  # 30x below this task's tuned 3e-3
    assert stats["predictions_kept"] >= 0.7 * stats["predictions_judged"] >= 3.5
    assert stats["jump_gain"] > 0 and stats["jump_worth_steps"] > 0.1 * stats["backward_steps"]
    factor = (stats["backward_steps"] + stats["jump_worth_steps"]) / stats["backward_steps"]
    assert f"the learning rate looks too small: {stats['predictions_kept']} of {stats['predictions_judged']}" in log
    assert (f"at least about {factor:.1f}x too small. Sweep upward from --learning_rate {1e-4 * factor:.2g}, or pass "
            "--hybrid_lr_autopilot true") in log
    assert f"{stats['predictions_kept']} of {stats['predictions_judged']} jumps kept" in log


def test_where_the_autopilot_was_asked_for_but_could_not_run_the_advice_does_not_offer_it(tmp_out, caplog):
    # The guard off leaves the autopilot no undo point (as an SGD optimizer or a OneCycleLR leaves it nothing to
    # read): its flag is on, its own line said it is off, and passing the flag again would change nothing.
    trainer = make_trainer(tmp_out, learning_rate=1e-4, hybrid_guard=False, **OUTER)
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert "the learning-rate autopilot is off for this run" in caplog.text
    assert "the learning rate looks too small" in caplog.text
    assert "--hybrid_lr_autopilot true" not in caplog.text
    stats = trainer.hybrid_stats()
    for use, offered in (("off", True), ("unavailable", False)):
        lines = jump_advice(stats, 1e-4, use)
        assert ("--hybrid_lr_autopilot true" in lines[-1]) is offered and "looks too small" in lines[-1]
    assert not any("too small" in line for line in jump_advice(stats, 1e-4, "on"))


def test_at_the_tuned_learning_rate_it_stays_silent(tmp_out, caplog):
    stats, log = advice_after_training(tmp_out, 3e-3, caplog)
    assert stats["predictions_kept"] == 0 and stats["predictions_judged"] > 0
    assert "looks too small" not in log
    assert "jumps were rolled back" in log


def test_few_verdicts_are_no_evidence():
    stats = {"predictions_judged": 2, "predictions_kept": 2, "jump_gain": 1.0, "jump_worth_steps": 500.0,
             "backward_steps": 100, "turns_passed": 0}
    assert not any("too small" in line for line in jump_advice(stats, 1e-4))


def test_rolled_back_jumps_call_the_weights_the_trainers_only_when_nothing_else_moved_them():
    stats = {"predictions_judged": 1, "predictions_kept": 0, "turns_passed": 0, "backward_steps": 100, "lr_scale": 1.0,
             "guard_outliers": 0, "guard_rollbacks": 0, "steps_not_made_up": 0}
    assert jump_advice(stats, 5e-5) == ["hf_hybrid: the jump was rolled back, so these weights are the plain "
                                        "Trainer's steps."]
    # A kept raise of the learning rate (the autopilot's line says so) or a step the guard flagged: not the Trainer's.
    for moved in ({"lr_scale": 10.0}, {"guard_outliers": 2}, {"guard_rollbacks": 1}, {"steps_not_made_up": 3}):
        assert jump_advice({**stats, **moved}, 5e-5) == ["hf_hybrid: the jump was rolled back."]


def test_the_jump_line_says_the_weights_are_the_trainers_only_where_every_jump_was_undone_and_nothing_else_moved():
    quiet = dict(predictions_judged=0, predictions_kept=0, turns_passed=0, lr_scale=1.0, guard_outliers=0,
                 guard_rollbacks=0, steps_not_made_up=0, backward_steps=300)
    assert jump_summary(quiet) is None
    assert jump_summary({**quiet, "turns_passed": 1}) == (
        "hf_hybrid: no jump was tried; 1 turn to jump passed: the probe along the optimizer's next step said its steps "
        "were long enough.")
    assert "; 3 turns to jump passed:" in jump_summary({**quiet, "turns_passed": 3})
    undone = {**quiet, "predictions_judged": 3}
    assert jump_summary(undone) == ("hf_hybrid: all 3 jumps were rolled back, so these weights are the plain Trainer's "
                                    "steps.")
    for moved in ({"lr_scale": 2.0}, {"guard_outliers": 1}, {"guard_rollbacks": 1}, {"steps_not_made_up": 1}):
        assert jump_summary({**undone, **moved}) == "hf_hybrid: all 3 jumps were rolled back."
    one_kept = {**quiet, "predictions_judged": 1, "predictions_kept": 1, "jump_gain": 0.071, "jump_worth_steps": 3.2,
                "backward_steps": 149}
    assert jump_summary(one_kept) == ("hf_hybrid: the jump was kept; it gained 0.0710 probe loss, worth about 3 real "
                                      "steps over 149 real steps.")
