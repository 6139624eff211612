"""The raised scale's way back to the user's LR where the schedule has no decay of its own (autopilot/cooldown.py),
and the short-horizon trap it answers (issue 49)."""

from __future__ import annotations

import logging
import math
import sys
from pathlib import Path

import pytest

from hf_hybrid import HybridHFTrainer
from hf_hybrid.autopilot.cooldown import cooldown_start, cooled_scale
from hf_hybrid.autopilot.line import SPACING

from .conftest import hybrid_args, make_trainer, tiny_gpt2, token_dataset
from .test_equivalence_resume import assert_bit_identical, state
from .test_lr_advice import OUTER

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from short_horizon_trap import from_scratch  # noqa: E402  (the trap's one definition, which the script runs over seeds)


def test_the_scale_comes_back_over_the_last_fifth_only_where_the_schedule_ends_high():
    constant, linear = [lambda step: 1.0] * 2, [lambda step: 1.0 - step / 400] * 2
    assert cooldown_start(constant, 400) == 320 and cooldown_start(linear, 400) is None
    assert [cooled_scale(4.0, p, 320, 400) for p in (0, 320, 360, 399, 400)] == [4.0, 4.0, 2.5, 1.0375, 1.0]
    assert cooled_scale(4.0, 399, None, 400) == 4.0  # a decaying schedule takes the scale down itself
    assert cooled_scale(1.0, 399, 320, 400) == 1.0


def _constant_run(output_dir, **overrides) -> HybridHFTrainer:
    return make_trainer(output_dir, learning_rate=1e-4, lr_scheduler_type="constant",
                        **{**OUTER, "max_steps": 50, "logging_steps": 1, **overrides})


def test_a_raised_constant_schedule_ends_at_the_users_lr_and_says_so(tmp_out, monkeypatch, caplog):
    """Every line reads 20 steps (long enough to count in the first descent of a run with no warmup): the raises are
    kept, hold until the last fifth (step 40), then the LR falls each step to the user's at the end; no raise starts in
    the 10 steps before it; the end line says so and advises no higher constant LR."""
    monkeypatch.setattr("hf_hybrid.autopilot.scale.reach_of_line", lambda f0, f1, f2: 20.0 / SPACING)
    monkeypatch.setattr("hf_hybrid.autopilot.alignment.ALIGNED", math.inf)  # raises of 2x, whatever the first steps
    trainer = _constant_run(tmp_out)
    with caplog.at_level(logging.WARNING):
        trainer.train()
    scale = trainer._lr_autopilot.scale
    # Raised at step 22, kept 5 steps on and raised again, kept at 32, which starts no other raise: its verdict would
    # come inside the cooldown.
    assert scale.scale == 4.0 and scale.raises_kept == 2 and not scale.on_trial
    lrs = [entry["learning_rate"] for entry in trainer.state.log_history if "learning_rate" in entry]
    assert lrs[40] == pytest.approx(1e-4 * scale.scale)  # the judged scale, up to the cooldown
    assert all(a > b for a, b in zip(lrs[40:], lrs[41:])) and lrs[-1] < 1e-4 * (1 + (scale.scale - 1) / 9)
    logged = [entry["hybrid/lr_scale"] for entry in trainer.state.log_history if "hybrid/lr_scale" in entry]
    # The scale in effect for the next step, cooldown included; the Trainer logs the LR its step used.
    assert logged[:len(lrs) - 1] == pytest.approx([lr / 1e-4 for lr in lrs[1:]])
    assert trainer.lr_scheduler.get_last_lr() == [pytest.approx(1e-4)] * 2  # the run ends at the user's LR
    assert "and brought it back to 0.0001 over the last 10 steps" in caplog.text
    assert "next time" not in caplog.text


def test_resume_in_the_cooldown_is_bit_identical(tmp_path, monkeypatch):
    monkeypatch.setattr("hf_hybrid.autopilot.scale.reach_of_line", lambda f0, f1, f2: 10.0 / SPACING)
    settings = dict(save_strategy="steps", save_steps=45)
    full_run = _constant_run(tmp_path / "full", **settings)
    full_run.train()
    assert full_run._lr_autopilot.scale.scale > 1.0
    resumed_model = tiny_gpt2(seed=123)
    resumed = HybridHFTrainer(model=resumed_model, train_dataset=token_dataset(),
                              args=hybrid_args(tmp_path / "resumed", learning_rate=1e-4, lr_scheduler_type="constant",
                                               **{**OUTER, "max_steps": 50, "logging_steps": 1, **settings}))
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-45"))
    assert_bit_identical(state(full_run.model), state(resumed_model))
    assert resumed.lr_scheduler.get_last_lr() == full_run.lr_scheduler.get_last_lr()


def test_from_scratch_a_raise_that_leads_early_ends_no_worse_and_is_not_advised(tmp_path, caplog):
    """The short-horizon trap, trained: on this task twice the user's LR leads for the first hundred steps and ends
    the run higher, and the verdict, about ten steps on, keeps the raise. The hybrid at the user's LR must end no
    higher than its Trainer (bit for bit where it kept nothing), and its end line must not advise the LR that ended
    worse."""
    user, _ = from_scratch(4e-3, False, 0, tmp_path / "user", eval_steps=40)
    doubled, _ = from_scratch(8e-3, False, 0, tmp_path / "doubled", eval_steps=40)
    if not (doubled[0] < user[0] and doubled[-1] > user[-1] + 0.03):  # the premise
        pytest.fail(f"2x the LR no longer leads early and ends worse here: {user} against {doubled}")
    with caplog.at_level(logging.WARNING):
        hybrid, trainer = from_scratch(4e-3, True, 0, tmp_path / "hybrid", eval_steps=40)
    stats = trainer.hybrid_stats()
    assert hybrid == user if not (stats["lr_raises_kept"] or stats["predictions_kept"]) else hybrid[-1] <= user[-1], (
        user, hybrid)
    assert trainer.lr_scheduler.get_last_lr() == [pytest.approx(4e-3)] * 2
    assert "pass --learning_rate 0.008" not in caplog.text and "a constant 0.008 is not advised" in caplog.text
