"""The offline jump experiments end to end on the smoke preset (the measurements are in docs/benchmarks-history.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "jump_lab.py"


def lab(*args: str) -> str:
    done = subprocess.run([sys.executable, str(SCRIPT), "--preset", "smoke", *args], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_record_nowcaster_oracle_and_split(tmp_path):
    traj, net = tmp_path / "traj.pt", tmp_path / "nowcaster.pt"
    lab("record", "--steps", "40", "--every", "5", "--optimizer_at", "20", "--out", str(traj))
    fit = json.loads(lab("nowcaster", "--trajectories", str(traj), "--horizon", "5", "--spacing", "5", "--ctx", "3",
                         "--per_step", "500", "--epochs", "2", "--held_out", str(traj), "--out",
                         str(net)).strip().splitlines()[-1])
    assert fit["validation"]["mse"] < fit["validation"]["zero_mse"]  # it learned something about where weights go
    report = tmp_path / "oracle.json"
    lab("oracle", "--trajectory", str(traj), "--at", "20,30", "--nowcaster", str(net), "--train_on",
        "mean20,line10x3+10", "--spacing", "10", "--ctx", "3", "--horizons", "10,20", "--report", str(report))
    rows = json.loads(report.read_text())
    names = {r["candidate"] for r in rows if r["step"] == 30 and "trained_to" not in r}
    assert {"iterate", "mean20", "line20@now", "line20+10", "nowcast5x3+5", "mean10x3", "line10x3+20"} <= names
    trained = [r for r in rows if "trained_to" in r]
    assert [(r["candidate"], r["trained_to"]) for r in trained] == [("mean20", 30), ("mean20", 40),
                                                                     ("line10x3+10", 30), ("line10x3+10", 40)]
    # A kept jump of 10 steps with no move at all: 10 real steps fewer by step 40, early on, cost loss.
    lab("oracle", "--trajectory", str(traj), "--at", "20", "--train_on", "iterate", "--advance", "10",
        "--report", str(report))
    (advanced,) = [r for r in json.loads(report.read_text()) if "trained_to" in r]
    assert (advanced["advance"], advanced["trained_to"]) == (10, 40)
    assert advanced["loss"] > advanced["baseline_loss"] and advanced["gain_steps"] < 0
    split_report = tmp_path / "split.json"
    lab("split", "--steps", "4", "--eval_every", "2", "--split_from", "0", "--report", str(split_report))
    arms = json.loads(split_report.read_text())
    assert set(arms) == {"baseline", "split-velocity"}
    # Same init, data and first step; the predicted embedding update then makes the arms differ.
    assert arms["baseline"][-1][2] != arms["split-velocity"][-1][2]
