"""Carry the survey's reports from behaviour version 5 to 6 where version 6 cannot have moved them.

Version 6 changes only the pace of the autopilot's readings while a raise is under way (a raise made or kept, or one on
trial) past the schedule's warmup and first descent (hf_hybrid/autopilot/runner.py, RAISING_READ_EVERY). A hybrid run
that never tried a raise (its `hybrid_stats` say no raise kept and no trial undone) read its line at the same steps and
took every decision as at version 5, bit for bit. A report is carried when every hybrid run in it tried no raise, or was
measured again at version 6 (`survey.py check NAME --learning_rates ...` merges those runs in, each with its own
environment); otherwise it is left as it is and said so.

    python scripts/carry_reports.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
FROM, TO = 5, 6


def _version(environment: dict | None) -> int | None:
    return (environment or {}).get("behaviour_version")


def untouched(run: dict) -> bool:
    """Whether version 6 leaves a version-5 hybrid run as it was: it tried no raise, or it was measured again."""
    stats = run.get("hybrid_stats") or {}
    tried = stats.get("lr_raises_kept", 0) + stats.get("lr_trials_undone", 0)
    return _version(run.get("environment")) == TO or (bool(stats) and tried == 0)


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
    why = ("version 6 changes only the readings' pace while a raise is under way; every hybrid run in this report "
           "tried no raise, or was measured again at version 6")
    for path in sorted(Path(args.reports).glob("*.json")):
        report = json.loads(path.read_text())
        if _version(report.get("environment")) != FROM or report.get("arm") == "baseline":
            continue
        runs = report["runs"] if "runs" in report else report.get("hybrid", [])
        moved = [run for run in runs if not untouched(run)]
        if moved:
            lrs = ", ".join(f"{run.get('learning_rate', report.get('learning_rate')):g}" for run in moved)
            print(f"{path.name}: a raise was tried at {lrs}, to be measured again")
            continue
        carry(path, why)
        print(f"{path.name}: carried")


if __name__ == "__main__":
    main()
