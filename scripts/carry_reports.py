"""Carry benchmark reports from behaviour version 7 to 8 where version 8 cannot have moved them.

Version 8 only takes raises away: a run whose first steps read opposed (hf_hybrid/autopilot/alignment.py, OPPOSED: the
window's mean below 0) starts none (autopilot/scale.py). A hybrid run whose first steps read at or above that gate (its
`hybrid_stats` record the alignment), or that tried no raise at all, took every decision as at version 7, bit for bit.
A report is carried when every hybrid run in it is such a run, or was measured again at version 8 (`survey.py check
NAME --learning_rates ...` merges those runs in, each with its own environment); otherwise it is left as it is and
said so. The survey's reports by default; the presets' with `--reports docs/reports --pattern 'presets-v7-*.json'`.

    python scripts/carry_reports.py
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from hf_hybrid.autopilot.alignment import OPPOSED  # noqa: E402

FROM, TO = 7, 8


def _version(environment: dict | None) -> int | None:
    return (environment or {}).get("behaviour_version")


def untouched(run: dict) -> bool:
    """Whether version 8 leaves a version-7 hybrid run as it was: its first steps read at or above the opposed gate, it
    tried no raise, or it was measured again."""
    stats = run.get("hybrid_stats") or {}
    tried = stats.get("lr_raises_kept", 0) + stats.get("lr_trials_undone", 0)
    alignment = stats.get("lr_start_alignment")
    not_opposed = alignment is not None and alignment >= OPPOSED
    return _version(run.get("environment")) == TO or (bool(stats) and (tried == 0 or not_opposed))


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
    why = ("version 8 only takes away the raises of a run whose first steps read opposed; every hybrid run in this "
           "report read at or above that gate, tried no raise, or was measured again at version 8")
    for path in sorted(Path(args.reports).glob(args.pattern)):
        report = json.loads(path.read_text())
        if _version(report.get("environment")) != FROM or report.get("arm") == "baseline":
            continue
        runs = report["runs"] if "runs" in report else report.get("hybrid", [])
        moved = [run for run in runs if not untouched(run)]
        if moved:
            lrs = ", ".join(f"{run.get('learning_rate', report.get('learning_rate')):g}" for run in moved)
            print(f"{path.name}: opposed and a raise tried at {lrs}, to be measured again")
            continue
        carry(path, why)
        print(f"{path.name}: carried")


if __name__ == "__main__":
    main()
