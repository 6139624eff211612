"""Reading a run's phase trace and drawing its phases onto matplotlib axes (shared by scripts/plot.py and the
benchmark). matplotlib is optional (`pip install hf-hybrid[plot]`): only `new_figure` imports it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

PHASE_COLORS = {"warmup": "grey", "full": "tab:blue", "predict": "tab:orange", "correct": "tab:green"}
TRACE_FILE = "hybrid_trace.jsonl"

Axis = Literal["step", "time"]
TraceRecord = dict[str, Any]


def read_trace(path: str | Path) -> list[TraceRecord]:
    """The records of a `hybrid_trace.jsonl`, one per optimizer step, in file order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def phase_spans(trace: Sequence[TraceRecord], x: Axis = "step") -> list[tuple[str, float, float]]:
    """Maximal runs of consecutive records in one phase, as `(phase, start, end)` along `x`.

    A record stands for the step that ended at its `step` / `time`, so it covers the interval from the previous
    record's value to its own; the first step began one step earlier, or at time 0. Consecutive spans therefore
    share their boundary and the shading leaves no gaps.
    """
    spans: list[tuple[str, float, float]] = []
    start = trace[0]["step"] - 1 if trace and x == "step" else 0.0
    for i, record in enumerate(trace):
        if i + 1 == len(trace) or trace[i + 1]["phase"] != record["phase"]:
            spans.append((record["phase"], start, record[x]))
            start = record[x]
    return spans


def shade_phases(ax: Any, trace: Sequence[TraceRecord], x: Axis = "step", alpha: float = 0.15) -> None:
    """Shade the background of `ax` by phase (one labelled artist per phase, so `ax.legend()` lists each once)."""
    by_phase: dict[str, list[tuple[float, float]]] = {}
    for phase, start, end in phase_spans(trace, x):
        by_phase.setdefault(phase, []).append((start, end - start))
    for phase, ranges in by_phase.items():
        # Axes coordinates vertically, so the shading spans the full height whatever the data limits become.
        ax.broken_barh(
            ranges,
            (0, 1),
            transform=ax.get_xaxis_transform(),
            color=PHASE_COLORS.get(phase, "black"),
            alpha=alpha,
            linewidth=0,
            label=phase,
            zorder=0,
        )


def mark_rollbacks(ax: Any, trace: Sequence[TraceRecord], x: Axis = "step") -> None:
    """A red vertical line at every step whose prediction was rolled back (labelled once for the legend)."""
    positions = [record[x] for record in trace if record.get("rollback")]
    if positions:
        ax.vlines(positions, 0, 1, transform=ax.get_xaxis_transform(), colors="red", linewidth=0.8, label="rollback")


def new_figure(**kwargs: Any) -> Any:
    """A `matplotlib.figure.Figure` that renders with Agg and touches no pyplot or global backend state."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("plotting needs matplotlib: pip install 'hf-hybrid[plot]'") from None
    return Figure(**kwargs)
