"""Carry benchmark reports from behaviour version 10 or 11 to 12 where version 12 cannot have moved them.

Versions 11 and 12 change only runs with a warmup shorter than FIRST_DESCENT_STEPS (hf_hybrid/autopilot/runner.py),
none included, whose first steps read neither aligned nor opposed (autopilot/alignment.py): up to step 2 x
FIRST_DESCENT_STEPS, a line counts as evidence for a raise only from FIRST_DESCENT_REACH steps on (autopilot/scale.py;
version 11 counted only a line with no bottom). A run with a longer warmup never reads there while a raise may start;
an aligned run is not held; an opposed one starts no raise at all, so the autopilot never moves its weights. Such a run
took every decision as at versions 10 and 11, bit for bit. A report is carried when every hybrid run in it is such a
run, or was measured again at version 12 (`survey.py check NAME --learning_rates ...` merges those runs in, each with
its own environment); otherwise it is left as it is and said so. The survey's reports by default; the presets' with
`--reports docs/reports --pattern 'presets-v7-*.json'`.

    python scripts/carry_reports.py
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from presets import PRESETS  # noqa: E402

from hf_hybrid.autopilot.alignment import ALIGNED, OPPOSED  # noqa: E402
from hf_hybrid.autopilot.runner import FIRST_DESCENT_STEPS  # noqa: E402

FROM, TO = (10, 11), 12  # reports left at 10 had a run version 11 could move


def _version(environment: dict | None) -> int | None:
    return (environment or {}).get("behaviour_version")


def warmup_steps(report: dict) -> int | None:
    """The report's warmup, from its own record of the preset's settings, else from the preset as it stands."""
    settings = report.get("preset_settings") or PRESETS.get(report.get("preset"), {})
    return settings.get("warmup_steps")


def untouched(run: dict, warmup: int | None) -> bool:
    """Whether version 12 leaves a hybrid run of version 10 or 11 as it was: its warmup is FIRST_DESCENT_STEPS or
    longer, its first steps read aligned or opposed, or it was measured again."""
    stats = run.get("hybrid_stats") or {}
    alignment = stats.get("lr_start_alignment")
    not_held = alignment is not None and (alignment >= ALIGNED or alignment < OPPOSED)
    long_warmup = warmup is not None and warmup >= FIRST_DESCENT_STEPS
    measured_again = _version(run.get("environment")) == TO
    return measured_again or (bool(stats) and (long_warmup or not_held))


def carry(path: Path, why: str) -> None:
    report = json.loads(path.read_text())
    environment = report["environment"]
    earlier = environment.pop("behaviour_carried", None)
    environment["behaviour_carried"] = {"from": environment["behaviour_version"], "why": why,
                                        **({"earlier": earlier} if earlier else {})}
    environment["behaviour_version"] = TO
    path.write_text(json.dumps(report, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reports", default=str(HERE.parent / "docs" / "survey"))
    parser.add_argument("--pattern", default="*.json")
    args = parser.parse_args()
    why = ("versions 11 and 12 change only runs with a warmup under 10 steps whose first steps read neither aligned "
           "nor opposed; every hybrid run in this report had a longer warmup, read aligned or opposed, or was "
           "measured again at version 12")
    for path in sorted(Path(args.reports).glob(args.pattern)):
        report = json.loads(path.read_text())
        if _version(report.get("environment")) not in FROM or report.get("arm") == "baseline":
            continue
        runs = report["runs"] if "runs" in report else report.get("hybrid", [])
        moved = [run for run in runs if not untouched(run, warmup_steps(report))]
        if moved:
            lrs = ", ".join(f"{run.get('learning_rate', report.get('learning_rate')):g}" for run in moved)
            print(f"{path.name}: held in the first descent at {lrs}, to be measured again")
            continue
        carry(path, why)
        print(f"{path.name}: carried")


if __name__ == "__main__":
    main()
