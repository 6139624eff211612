"""scripts/trl_check.py, TRL's trainers at their users' default LR, end to end on a few steps: each arm trains TRL's
own trainer or its hybrid from the shipped pretrained checkpoint and records its held-out losses; the speedup is read
where an arm first reaches the plain run's final loss."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))


def test_the_speedup_is_read_where_the_loss_first_reaches_the_target():
    import trl_check

    baseline = {"evals": [[0, 0.0, 1.0], [10, 5.0, 0.9], [20, 10.0, 0.8]]}
    faster = {"evals": [[0, 0.0, 1.0], [10, 6.0, 0.6], [20, 12.0, 0.5]]}
    # 0.8 is reached half way between the first two evaluations: 5 updates and 3 seconds against 20 and 10.
    assert trl_check.speedups(baseline, faster) == pytest.approx((4.0, 10 / 3))
    assert trl_check.speedups(baseline, baseline) == pytest.approx((1.0, 1.0))
    assert trl_check.speedups(baseline, {"evals": [[0, 0.0, 1.0], [10, 5.0, 0.85]]}) is None


# Under pytest-xdist, in one worker with the GPU suite's test, which deletes and remakes the smoke checkpoint.
@pytest.mark.xdist_group("smoke-checkpoint")
@pytest.mark.parametrize("trainer", ["sft", "dpo"])
def test_an_arm_trains_trls_trainer_or_its_hybrid_and_records_held_out_losses(tmp_path, monkeypatch, trainer):
    pytest.importorskip("trl")
    import trl_check

    monkeypatch.setattr(trl_check, "ROOT", tmp_path)  # the runs' output directories
    # The smoke checkpoint has 32 positions.
    for name, value in dict(STEPS=4, EVAL_EVERY=2, EVAL_PAIRS=8, TRAIN_PAIRS=64, PROMPT=8, COMPLETION=8,
                            SFT_BLOCK=16).items():
        monkeypatch.setattr(trl_check, name, value)
    from model_and_data import pretrained_checkpoint
    from presets import PRESETS

    smoke = pretrained_checkpoint(PRESETS["smoke-finetune"])
    monkeypatch.setattr(trl_check, "pretrained_checkpoint", lambda preset: smoke)
    data = trl_check.training_data(trainer)
    plain = trl_check.run_arm(trainer, "baseline", 1e-3, 0, data)
    hybrid = trl_check.run_arm(trainer, "hybrid", 1e-3, 0, data)
    assert [e[0] for e in plain["evals"]] == [0, 2, 4] and plain["hybrid_stats"] is None
    assert hybrid["hybrid_stats"]["backward_steps"] == 4
    assert plain["evals"][0][2] == hybrid["evals"][0][2]  # the same start
    assert plain["evals"][-1][2] != plain["evals"][0][2]  # it trained
