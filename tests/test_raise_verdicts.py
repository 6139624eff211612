"""scripts/raise_verdicts.py reads a trace's verdicts and tells a kept raise from an undone one by the learning rate
the step after the verdict runs at."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from raise_verdicts import verdicts  # noqa: E402


def test_a_kept_raise_keeps_its_learning_rate_and_an_undone_one_falls_back(tmp_path):
    rows = [(1, 1e-3, None), (2, 2e-3, None), (3, 1.9e-3, (0.02, 0.01)),  # kept, while a schedule decays
            (4, 3.8e-3, None), (5, 1.8e-3, (-0.05, 0.01))]  # undone: back to the scale before the raise
    trace = tmp_path / "hybrid_trace.jsonl"
    trace.write_text("".join(json.dumps({"step": s, "lr": lr, "raise_verdict": v}) + "\n" for s, lr, v in rows))
    found = verdicts(trace)
    assert [(v["step"], v["kept"]) for v in found] == [(3, True), (5, False)]
    assert found[0]["z"] == pytest.approx(2.0) and found[1]["gain"] == -0.05
