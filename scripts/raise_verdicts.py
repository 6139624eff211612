"""Every raise verdict in a set of runs, from their step traces (`--set hybrid_trace=true`): the probe gain, its
standard error, their ratio z, and whether the raise was kept, beside the run's final held-out loss and scale.

The autopilot keeps a raise unless it reads worse than the user's LR by more than `hybrid_probe_noise_margin` standard
errors (hf_hybrid/autopilot/verdict.py). This lists where kept raises fall on z, at LRs where a raise pays and at tuned
ones where it should not be kept, which is what a stricter keep rule would move.

    python scripts/raise_verdicts.py runs/census --out docs/reports/raise-verdicts/verdicts-v12-avx2-seed0.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hf_hybrid.trace import TRACE_NAME

# The learning rate falls by the trial's factor (at least 1.5x here) at the step whose verdict undid it; a schedule
# moves it by far less in one step.
UNDONE_FALL = 1.5


def verdicts(trace: Path) -> list[dict]:
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    found = []
    for before, row in zip(rows, rows[1:]):
        if row["raise_verdict"] is None:
            continue
        gain, noise = row["raise_verdict"]
        found.append({"step": row["step"], "gain": gain, "noise": noise, "z": gain / noise if noise else None,
                      "kept": before["lr"] < UNDONE_FALL * row["lr"]})
    return found


def run_end(run_dir: Path) -> dict:
    """The run's final held-out loss and the scale it ended on, from benchmark.py's record of the arm."""
    arm = json.loads((run_dir / "arm_result.json").read_text())
    return {"final_eval_loss": arm["evals"][-1][2], "lr_scale": (arm["hybrid_stats"] or {}).get("lr_scale")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    report = []
    for trace in sorted(args.runs.glob(f"**/{TRACE_NAME}")):
        if not (trace.parent / "arm_result.json").exists():
            continue  # still running
        run = {"run": str(trace.parent.relative_to(args.runs)), **run_end(trace.parent), "verdicts": verdicts(trace)}
        report.append(run)
        cells = " | ".join(f"@{v['step']} {v['gain']:+.4f} se {v['noise']:.4f} z "
                           f"{'-' if v['z'] is None else format(v['z'], '+.1f')} {'kept' if v['kept'] else 'undone'}"
                           for v in run["verdicts"])
        print(f"{run['run']:66} {run['final_eval_loss']:.4f} x{run['lr_scale']:<5.3g} {cells or 'no verdict'}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
