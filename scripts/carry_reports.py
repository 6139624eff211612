"""Carry benchmark reports from behaviour version 9 to 10 where version 10 cannot have moved them.

Version 10 changes only raises past MAX_ALIGNED_RAISE (hf_hybrid/autopilot/ramp.py): they ramp in over RAMP_STEPS 5
instead of 10. Only a run whose first steps read strongly aligned (autopilot/alignment.py, STRONGLY_ALIGNED) can raise
past it. A hybrid run that read below that gate (its `hybrid_stats` record the alignment), tried no raise, or kept
every raise it tried and ended at a scale of MAX_ALIGNED_RAISE or less (so no single raise went past it) took every
decision as at version 9, bit for bit. A report is carried when every hybrid run in it is such a run, or was measured
again at version 10 (`survey.py check NAME --learning_rates ...` merges those runs in, each
with its own environment); otherwise it is left as it is and said so. The survey's reports by default; the presets'
with `--reports docs/reports --pattern 'presets-v7-*.json'`.

    python scripts/carry_reports.py
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from hf_hybrid.autopilot.alignment import STRONGLY_ALIGNED  # noqa: E402
from hf_hybrid.autopilot.scale import MAX_ALIGNED_RAISE  # noqa: E402

FROM, TO = 9, 10


def _version(environment: dict | None) -> int | None:
    return (environment or {}).get("behaviour_version")


def untouched(run: dict) -> bool:
    """Whether version 10 leaves a version-9 hybrid run as it was: its first steps read below the strongly aligned
    gate, it tried no raise, every raise it tried was kept and none went past MAX_ALIGNED_RAISE, or it was measured
    again."""
    stats = run.get("hybrid_stats") or {}
    kept, undone = stats.get("lr_raises_kept", 0), stats.get("lr_trials_undone", 0)
    alignment = stats.get("lr_start_alignment")
    below_gate = alignment is not None and alignment < STRONGLY_ALIGNED
    small_raises = undone == 0 and stats.get("lr_lowered", 0) == 0 and stats.get("lr_scale", 1.0) <= MAX_ALIGNED_RAISE
    measured_again = _version(run.get("environment")) == TO
    never_raised = kept + undone == 0 and stats.get("lr_scale", 1.0) == 1.0  # not a trial still open at the end
    return measured_again or (bool(stats) and (never_raised or below_gate or small_raises))


def carry(path: Path, why: str) -> None:
    report = json.loads(path.read_text())
    environment = report["environment"]
    earlier = environment.pop("behaviour_carried", None)
    environment["behaviour_version"] = TO
    environment["behaviour_carried"] = {"from": FROM, "why": why, **({"earlier": earlier} if earlier else {})}
    path.write_text(json.dumps(report, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reports", default=str(HERE.parent / "docs" / "survey"))
    parser.add_argument("--pattern", default="*.json")
    args = parser.parse_args()
    why = ("version 10 changes only raises past 4x (their ramp), which only a run whose first steps read strongly "
           "aligned makes; every hybrid run in this report read below that gate, tried no raise, kept only raises of "
           "4x or less, or was measured again at version 10")
    for path in sorted(Path(args.reports).glob(args.pattern)):
        report = json.loads(path.read_text())
        if _version(report.get("environment")) != FROM or report.get("arm") == "baseline":
            continue
        runs = report["runs"] if "runs" in report else report.get("hybrid", [])
        moved = [run for run in runs if not untouched(run)]
        if moved:
            lrs = ", ".join(f"{run.get('learning_rate', report.get('learning_rate')):g}" for run in moved)
            print(f"{path.name}: strongly aligned and a raise past 4x possible at {lrs}, to be measured again")
            continue
        carry(path, why)
        print(f"{path.name}: carried")


if __name__ == "__main__":
    main()
