"""The GPU suite (scripts/gpu_session.sh) end to end on the CPU at tiny shapes, so that a lent GPU's minutes go to
measuring, not to finding a broken part."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRETRAINED = ROOT / "runs" / "pretrained" / "gpt2-smoke"


@pytest.mark.xdist_group("smoke-checkpoint")  # under pytest-xdist, in one worker with tests that load it
def test_the_gpu_suite_runs_every_part_on_the_smoke_presets(tmp_path):
    shutil.rmtree(PRETRAINED, ignore_errors=True)  # the fine-tuning part must make its checkpoint inside the call
    env = {**os.environ, "PRESET": "smoke", "NO_WHEELS": "1", "PY": sys.executable, "OUT": str(tmp_path / "out"),
           "WORK": str(tmp_path / "work"), "SCRATCH_STEPS": "16", "COST_STEPS": "12", "STEPS_355": "12",
           "FIRST_STEPS": "45"}
    done = subprocess.run(["bash", "scripts/gpu_session.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = (tmp_path / "out" / "summary.txt").read_text()
    for part in ("scratch", "finetune", "cost", "first_reading", "scratch355"):
        assert f"== {part}: rc 0," in summary, summary
    assert (PRETRAINED / "config.json").exists()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["suite.json", "summary.txt", "work.tgz"]

    suite = json.loads((tmp_path / "out" / "suite.json").read_text())
    assert list(suite) == ["scratch", "finetune", "cost", "scratch355"]  # most important first
    scratch = {row["arm"]: row for row in suite["scratch"]["rows"]}
    assert list(scratch) == ["baseline", "hybrid", "swept", "prodigy", "mechanic"]
    # A tenth of the preset's LR for the Trainer and the hybrid, the preset's own for the reference, none for the peers.
    assert scratch["baseline"]["learning_rate"] == scratch["hybrid"]["learning_rate"] == pytest.approx(3e-4)
    assert scratch["swept"]["learning_rate"] == 3e-3
    assert scratch["prodigy"]["learning_rate"] == scratch["mechanic"]["learning_rate"] == 1.0
    # G is 1 for the reference by definition (in updates; in wall clock only where it was also faster, which the
    # CPU's timing does not promise at these shapes), and the peers moved their weights their own way.
    assert scratch["swept"]["g_updates"] == 1.0
    finals = {arm: row["final_eval_loss"] for arm, row in scratch.items()}
    assert len(set(finals.values())) == len(finals), finals

    finetune = {row["arm"]: row for row in suite["finetune"]["rows"]}
    assert suite["finetune"]["preset"] == "smoke-finetune" and finetune["baseline"]["learning_rate"] == 5e-5
    cost = suite["cost"]
    assert [row["arm"] for row in cost["rows"]] == ["baseline", "hybrid"] and len(cost["targets"]) == 3
    assert len(cost["equal_evals"]) == 3
    assert suite["scratch355"]["rows"][1]["learning_rate"] == pytest.approx(3e-4)
    assert "G upd" in done.stdout and "Mechanic" in done.stdout
    # The first two readings and the step before each, each with the host work that took its time.
    first = json.loads((tmp_path / "work" / "first_reading.json").read_text())
    assert len(first["readings"]) == 2 and [row["reading"] for row in first["steps"]] == [False, True] * 2
    assert all(row["seconds"] > 0 and row["top"] for row in first["steps"])


def test_a_part_past_the_calls_budget_is_skipped_and_the_call_still_packs_its_archive(tmp_path):
    env = {**os.environ, "PRESET": "smoke", "NO_WHEELS": "1", "PY": sys.executable, "OUT": str(tmp_path / "out"),
           "WORK": str(tmp_path / "work"), "PARTS": "cost scratch355", "BUDGET": "30"}
    done = subprocess.run(["bash", "scripts/gpu_session.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "== cost: skipped, " in summary and "== scratch355: skipped, " in summary, summary
    assert (tmp_path / "out" / "work.tgz").exists()
