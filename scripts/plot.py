"""Plot a hybrid training run from its output directory.

    python scripts/plot.py RUN_DIR [--out PNG_PREFIX]

Reads RUN_DIR/hybrid_trace.jsonl and the Trainer's trainer_state.json (RUN_DIR's own, else the newest
checkpoint-*/'s) and writes PREFIX_loss.png (loss against step and against wall clock) and PREFIX_confidence.png
(predictor confidence and prediction error against step). PREFIX defaults to RUN_DIR/plot.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from plotting import (
    TRACE_FILE,
    Axis,
    TraceRecord,
    mark_rollbacks,
    new_figure,
    phase_spans,
    read_trace,
    shade_phases,
)

# Unclipped: the last evaluation usually sits on the right edge of the axes.
EVAL_STYLE = {
    "linestyle": "none",
    "marker": "D",
    "markersize": 5,
    "color": "tab:purple",
    "label": "eval loss",
    "clip_on": False,
}


def find_trainer_state(run_dir: Path) -> Path | None:
    """RUN_DIR/trainer_state.json, else the one in the highest-numbered checkpoint, else None."""
    top = run_dir / "trainer_state.json"
    if top.is_file():
        return top
    numbered = [
        p for p in run_dir.glob("checkpoint-*/trainer_state.json") if re.fullmatch(r"checkpoint-\d+", p.parent.name)
    ]
    return max(numbered, key=lambda p: int(p.parent.name.split("-")[1]), default=None)


def eval_losses(state_path: Path) -> list[tuple[int, float]]:
    """(step, eval_loss) for every evaluation in the Trainer's log history."""
    history = json.loads(state_path.read_text())["log_history"]
    return [(entry["step"], entry["eval_loss"]) for entry in history if "eval_loss" in entry]


def values(trace: Sequence[TraceRecord], key: str) -> list[float]:
    # NaN where a step has no value, so that lines break there instead of bridging the gap.
    return [float("nan") if record.get(key) is None else record[key] for record in trace]


def span_limits(trace: Sequence[TraceRecord], x: Axis) -> tuple[float, float]:
    spans = phase_spans(trace, x)
    return spans[0][1], spans[-1][2]


def plot_loss(trace: Sequence[TraceRecord], evals: list[tuple[int, float]], path: str, title: str) -> None:
    fig = new_figure(figsize=(14, 5), layout="constrained")
    time_of_step = {record["step"]: record["time"] for record in trace}
    timed_evals = [(time_of_step[step], loss) for step, loss in evals if step in time_of_step]
    panels = [("step", "optimizer step", evals), ("time", "wall clock (s)", timed_evals)]
    for ax, (x, xlabel, points) in zip(fig.subplots(1, 2, sharey=True), panels, strict=True):
        shade_phases(ax, trace, x)
        ax.plot(values(trace, x), values(trace, "loss"), linewidth=0.7, color="black", label="training loss")
        if points:
            ax.plot(*zip(*points, strict=True), **EVAL_STYLE)
        mark_rollbacks(ax, trace, x)
        ax.set_xlim(*span_limits(trace, x))
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    fig.axes[0].set_ylabel("loss (predict steps: monitored forward loss)")
    fig.axes[0].legend(loc="upper right", fontsize="small")
    fig.suptitle(f"{title}: loss by phase")
    fig.savefig(path, dpi=120)


def plot_confidence(trace: Sequence[TraceRecord], path: str, title: str) -> None:
    fig = new_figure(figsize=(12, 6), layout="constrained")
    steps = values(trace, "step")
    panels = [("confidence", "predictor confidence"), ("prediction_error", "prediction error")]
    for ax, (key, ylabel) in zip(fig.subplots(2, 1, sharex=True), panels, strict=True):
        shade_phases(ax, trace)
        # Markers too: values exist only around predictions, and an isolated value draws no line.
        ax.plot(steps, values(trace, key), linewidth=0.8, marker=".", markersize=3, color="black", label=ylabel)
        mark_rollbacks(ax, trace)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    fig.axes[0].set_xlim(*span_limits(trace, "step"))
    fig.axes[1].set_xlabel("optimizer step")
    fig.axes[0].legend(loc="upper right", fontsize="small")
    fig.suptitle(f"{title}: predictor confidence and error")
    fig.savefig(path, dpi=120)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a run's output_dir, holding hybrid_trace.jsonl")
    parser.add_argument("--out", help="PNG path prefix (default: RUN_DIR/plot)")
    args = parser.parse_args(argv)

    trace_path = args.run_dir / TRACE_FILE
    if not trace_path.is_file():
        sys.exit(f"no {TRACE_FILE} in {args.run_dir}")
    trace = read_trace(trace_path)
    if not trace:
        sys.exit(f"{trace_path} has no records")
    state_path = find_trainer_state(args.run_dir)
    if state_path is None:
        print(f"no trainer_state.json in {args.run_dir}: plotting without eval loss", file=sys.stderr)
    evals = eval_losses(state_path) if state_path else []

    prefix = args.out or str(args.run_dir / "plot")
    title = args.run_dir.resolve().name
    try:
        plot_loss(trace, evals, f"{prefix}_loss.png", title)
        plot_confidence(trace, f"{prefix}_confidence.png", title)
    except ImportError as err:
        sys.exit(str(err))
    print(f"{prefix}_loss.png\n{prefix}_confidence.png")


if __name__ == "__main__":
    main()
