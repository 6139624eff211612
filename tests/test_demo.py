"""`make demo`'s entry point as a user runs it, at the seconds-long smoke size: it ends on the summary screen, with
the guard's outcome, the speed outcome and its regime, and the paths of the reports and plots it wrote."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "demo.py"


def test_demo_ends_on_one_summary_screen(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--preset", "smoke", "--output_dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    screen = (tmp_path / "summary.txt").read_text()
    assert screen in done.stdout and len(screen.splitlines()) <= 25
    for needle in ("GUARD", "Trainer, clean run", "Trainer, with the faults", "HybridHFTrainer, same faults",
                   "the guard flagged", "SPEED", "1/5 of the swept", "time to the Trainer's final eval loss"):
        assert needle in screen, needle
    faults = json.loads((tmp_path / "faults" / "report.json").read_text())
    speed = json.loads((tmp_path / "speed" / "report.json").read_text())
    assert set(faults["arms"]) == {"trainer-clean", "trainer-faults", "hybrid-faults"}
    # The Trainer with the faults starts from the clean run's checkpoint before the first fault, then meets them all:
    # its evaluations part from the clean run's and end at NaN; the checkpoint is removed once used.
    clean, faulted = faults["arms"]["trainer-clean"]["evals"], faults["arms"]["trainer-faults"]["evals"]
    assert [e[0] for e in faulted] == [e[0] for e in clean] and faulted[-2][2] != clean[-2][2]
    assert faulted[-1][2] != faulted[-1][2]  # NaN
    assert not list((tmp_path / "faults" / "trainer-clean").glob("checkpoint-*"))
    assert speed["learning_rate"] == 0.2 * speed["swept_learning_rate"]
    assert f"{speed['target']:.3f}" in screen
    # Updates beside wall clock: the Trainer's are its steps; the hybrid's evaluations came on its counted steps.
    assert speed["updates_to_target"]["baseline"] <= speed["arms"]["baseline"]["evals"][-1][0]
    assert f"{speed['update_speedup']:.2f}x in updates" in screen
    for path in ("faults/report.json", "speed/report.json", "faults/eval_loss_vs_step.png",
                 "speed/eval_loss_vs_wallclock.png"):
        assert str(tmp_path / path) in screen and (tmp_path / path).stat().st_size > 0
    # Quiet: no progress bars and no transformers notices, only the demo's own lines and hf_hybrid's.
    assert "Tokenizing" not in done.stdout + done.stderr and "loss_type" not in done.stdout + done.stderr


def test_the_speed_arm_stops_at_its_first_evaluation_at_the_target(tmp_path):
    """The time to the Trainer's final loss is the demo's result; the hybrid's steps after it only make the user wait
    (the smoke run above reaches the target at its last evaluation, so it cannot show this)."""
    sys.path.insert(0, str(SCRIPT.parent))
    from demo import speed_arm
    from presets import PRESETS

    preset = PRESETS["smoke"]
    arm = speed_arm("hybrid", preset, preset["learning_rate"], 0, tmp_path, progress=print, target=float("inf"))
    assert preset["eval_steps"] < preset["max_steps"]
    assert [e[0] for e in arm["evals"]] == [preset["eval_steps"]]


def test_the_swept_lr_line_quotes_a_report_of_the_demos_current_preset_alone(tmp_path, monkeypatch):
    """The screen's "at the swept LR" line is read from a kept report; one recorded on another preset (the demo's
    blocks of 64 tokens before, say) or another behaviour version is a different run and is not quoted."""
    sys.path.insert(0, str(SCRIPT.parent))
    import demo
    from presets import DEMO_SWEPT_REPORT

    kept = json.loads((demo.ROOT / DEMO_SWEPT_REPORT).read_text())
    assert demo.recorded_swept_result("demo")["path"] == DEMO_SWEPT_REPORT  # the kept report is current
    stale_reports = (dict(kept, preset=dict(kept["preset"], block_size=64)),
                     {k: v for k, v in kept.items() if k != "preset"},
                     dict(kept, environment=dict(kept["environment"], behaviour_version=0)))
    for stale in stale_reports:
        (tmp_path / DEMO_SWEPT_REPORT).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / DEMO_SWEPT_REPORT).write_text(json.dumps(stale))
        monkeypatch.setattr(demo, "ROOT", tmp_path)
        assert demo.recorded_swept_result("demo") is None
