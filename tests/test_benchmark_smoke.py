"""The A/B benchmark script end to end, on its seconds-long smoke preset (benchmarks are not tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "benchmark.py"


def test_benchmark_smoke_writes_report_and_plot(tmp_path):
    cmd = [sys.executable, str(SCRIPT), "--preset", "smoke", "--repeats", "1", "--output_dir", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    root = tmp_path / "smoke-speed"
    report = json.loads((root / "report.json").read_text())
    baseline, hybrid = report["baseline"][0], report["hybrid"][0]
    assert baseline["steps"] == 12 and baseline["hybrid_stats"] is None
    assert report["target_eval_loss"] == baseline["final_eval_loss"]
    stats = hybrid["hybrid_stats"]
    assert stats["predict_steps"] > 0 and set(stats["phase_steps"]) == {"warmup", "full", "predict", "correct"}
    assert set(baseline["timing"]) == {"forward", "backward", "optimizer"}
    assert len(report["speedups"]) == 1
    assert "time-to-target speedup" in done.stdout and "backward reduction" in done.stdout
    assert (root / "eval_loss_vs_wallclock.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
