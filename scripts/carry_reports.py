"""Carry the survey's reports from behaviour version 6 to 7 where version 7 cannot have moved them.

Version 7 changes only the size of a raise in a run whose first steps read strongly aligned
(hf_hybrid/autopilot/alignment.py, STRONGLY_ALIGNED): up to the line's whole reach within the 32x cap, where version 6
allowed 4x (autopilot/scale.py). A hybrid run whose first steps read below that gate (its `hybrid_stats` record the
alignment), or that tried no raise at all (a reading that wanted no raise under the 4x cap wants none under the 32x
one), took every decision as at version 6, bit for bit. A report is carried when every hybrid run in it is such a run,
or was measured again at version 7 (`survey.py check NAME --learning_rates ...` merges those runs in, each with its own
environment); otherwise it is left as it is and said so.

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

FROM, TO = 6, 7


def _version(environment: dict | None) -> int | None:
    return (environment or {}).get("behaviour_version")


def untouched(run: dict) -> bool:
    """Whether version 7 leaves a version-6 hybrid run as it was: its first steps read below the strong gate, it tried
    no raise, or it was measured again."""
    stats = run.get("hybrid_stats") or {}
    tried = stats.get("lr_raises_kept", 0) + stats.get("lr_trials_undone", 0)
    alignment = stats.get("lr_start_alignment")
    below_gate = alignment is not None and alignment < STRONGLY_ALIGNED
    return _version(run.get("environment")) == TO or (bool(stats) and (tried == 0 or below_gate))


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
    args = parser.parse_args()
    why = ("version 7 changes only the size of a raise in a run whose first steps read strongly aligned; every hybrid "
           "run in this report read below that gate, tried no raise, or was measured again at version 7")
    for path in sorted(Path(args.reports).glob("*.json")):
        report = json.loads(path.read_text())
        if _version(report.get("environment")) != FROM or report.get("arm") == "baseline":
            continue
        runs = report["runs"] if "runs" in report else report.get("hybrid", [])
        moved = [run for run in runs if not untouched(run)]
        if moved:
            lrs = ", ".join(f"{run.get('learning_rate', report.get('learning_rate')):g}" for run in moved)
            print(f"{path.name}: strongly aligned and a raise tried at {lrs}, to be measured again")
            continue
        carry(path, why)
        print(f"{path.name}: carried")


if __name__ == "__main__":
    main()
