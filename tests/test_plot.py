import importlib.util
import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from matplotlib.colors import to_rgb

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from plotting import PHASE_COLORS, mark_rollbacks, new_figure, phase_spans, shade_phases  # noqa: E402

PLOT_SCRIPT = REPO / "scripts" / "plot.py"

# (phase, number of steps): all four phases, with the predict/correct cycle repeated.
SCHEDULE = [("warmup", 10), ("full", 10), ("predict", 8), ("correct", 2), ("predict", 8), ("correct", 2), ("full", 5)]
ROLLBACK_STEP = 36


def synthetic_trace() -> list[dict]:
    phases = [phase for phase, n in SCHEDULE for _ in range(n)]
    trace = []
    elapsed = 0.0
    for step, phase in enumerate(phases, start=1):
        predicting = phase == "predict"
        # Backward steps take longer than predict steps, so the two x axes differ.
        elapsed += 0.4 if predicting else 1.0
        trace.append(
            {
                "step": step,
                "phase": phase,
                "loss": 4.0 * math.exp(-step / 30) + 2.0 + 0.05 * math.sin(step),
                "time": elapsed,
                "confidence": 0.5 + 0.01 * step if predicting else None,
                "prediction_error": 0.1 + 0.002 * step if predicting or phase == "correct" else None,
                "rollback": step == ROLLBACK_STEP,
            }
        )
    return trace


def write_run(run_dir: Path, state_dir: Path | None = None) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "hybrid_trace.jsonl", "w") as f:
        for record in synthetic_trace():
            f.write(json.dumps(record) + "\n")
    history = [{"step": s, "loss": 3.0, "learning_rate": 1e-3} for s in (10, 20, 30, 40)]
    history += [{"step": s, "eval_loss": 3.5 - 0.01 * s, "eval_runtime": 1.0} for s in (15, 30, 45)]
    state_dir = state_dir or run_dir
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "trainer_state.json").write_text(json.dumps({"global_step": 45, "log_history": history}))


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def run_plot(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, str(PLOT_SCRIPT), *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_plot_script_writes_both_pngs(tmp_path):
    run_dir = tmp_path / "run"
    write_run(run_dir)
    result = run_plot(str(run_dir))
    assert result.returncode == 0, result.stderr
    for name in ("plot_loss.png", "plot_confidence.png"):
        width, height = png_size(run_dir / name)
        assert width > 500 and height > 300


def test_plot_script_takes_an_out_prefix_and_a_checkpoint_state(tmp_path):
    run_dir = tmp_path / "run"
    write_run(run_dir, state_dir=run_dir / "checkpoint-45")
    result = run_plot(str(run_dir), "--out", str(tmp_path / "figs"))
    assert result.returncode == 0, result.stderr
    assert "without eval loss" not in result.stderr
    assert png_size(tmp_path / "figs_loss.png") and png_size(tmp_path / "figs_confidence.png")


def test_plot_script_fails_clearly_without_a_trace(tmp_path):
    result = run_plot(str(tmp_path))
    assert result.returncode != 0
    assert "hybrid_trace.jsonl" in result.stderr


def load_plot_script():
    spec = importlib.util.spec_from_file_location("plot_script", PLOT_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_newest_checkpoint_state_is_used_when_the_run_dir_has_none(tmp_path):
    plot = load_plot_script()
    for step in (9, 45, 100):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    assert plot.find_trainer_state(tmp_path) == tmp_path / "checkpoint-100" / "trainer_state.json"
    (tmp_path / "trainer_state.json").write_text("{}")
    assert plot.find_trainer_state(tmp_path) == tmp_path / "trainer_state.json"
    (tmp_path / "empty" / "checkpoint-7").mkdir(parents=True)
    assert plot.find_trainer_state(tmp_path / "empty") is None


def test_eval_losses_come_from_the_log_history(tmp_path):
    write_run(tmp_path)
    assert load_plot_script().eval_losses(tmp_path / "trainer_state.json") == [(15, 3.35), (30, 3.2), (45, 3.05)]


def test_phase_spans_by_step():
    assert phase_spans(synthetic_trace()) == [
        ("warmup", 0, 10),
        ("full", 10, 20),
        ("predict", 20, 28),
        ("correct", 28, 30),
        ("predict", 30, 38),
        ("correct", 38, 40),
        ("full", 40, 45),
    ]


def test_phase_spans_by_time_start_at_zero_and_touch():
    trace = synthetic_trace()
    spans = phase_spans(trace, x="time")
    assert spans[0] == ("warmup", 0.0, pytest.approx(10.0))
    assert spans[2] == ("predict", pytest.approx(20.0), pytest.approx(23.2))
    assert all(a[2] == b[1] for a, b in zip(spans, spans[1:], strict=False))
    assert spans[-1][2] == trace[-1]["time"]


def test_phase_spans_of_a_resumed_run_start_one_step_before_its_first_record():
    trace = [{"step": 501, "phase": "full", "time": 2.0}, {"step": 502, "phase": "predict", "time": 3.0}]
    assert phase_spans(trace) == [("full", 500, 501), ("predict", 501, 502)]
    assert phase_spans([]) == []


def test_shade_phases_draws_one_labelled_artist_per_phase():
    ax = new_figure().subplots()
    shade_phases(ax, synthetic_trace())
    handles, labels = ax.get_legend_handles_labels()
    assert labels == ["warmup", "full", "predict", "correct"]
    for handle, phase in zip(handles, labels, strict=True):
        assert tuple(handle.get_facecolor()[0][:3]) == pytest.approx(to_rgb(PHASE_COLORS[phase]))
    predict = handles[labels.index("predict")]
    assert len(predict.get_paths()) == 2


def test_rollbacks_are_marked_where_they_happened():
    trace = synthetic_trace()
    ax = new_figure().subplots()
    mark_rollbacks(ax, trace, x="time")
    (lines,) = ax.collections
    assert lines.get_label() == "rollback"
    assert [segment[0][0] for segment in lines.get_segments()] == [trace[ROLLBACK_STEP - 1]["time"]]


def test_missing_matplotlib_gives_the_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"pip install 'hf-hybrid\[plot\]'"):
        new_figure()
