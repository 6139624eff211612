"""Carry the survey's reports from behaviour version 4 to 5 where version 5 cannot have moved them.

Version 5 changes only runs whose first steps read aligned (hf_hybrid/autopilot/alignment.py) under a schedule with a
warmup: such a run may now raise inside the warmup, from the alignment's last step. Any other run takes every decision
as at version 4, bit for bit (with no warmup an aligned run could already raise from that step).
scripts/start_alignment.py records, per setting and LR of the check grid, what the library reads there. A report is
carried when every hybrid run in it is at an LR that version 5 leaves alone, or was measured again at version 5
(`survey.py check NAME --learning_rates ...` merges those runs in, each with its own environment); otherwise it is
left as it is and said so.

    python scripts/carry_reports.py --evidence docs/reports/issue49-start-alignment.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
FROM, TO = 4, 5


def warmup_steps(setting: str) -> int:
    from survey import settings

    return settings()[setting]["warmup_steps"]


def _version(environment: dict | None) -> int | None:
    return (environment or {}).get("behaviour_version")


def carry(path: Path, evidence: str, why: str) -> None:
    report = json.loads(path.read_text())
    environment = report["environment"]
    earlier = environment.pop("behaviour_carried", None)
    environment["behaviour_version"] = TO
    environment["behaviour_carried"] = {"from": FROM, "evidence": evidence, "why": why,
                                        **({"earlier": earlier} if earlier else {})}
    path.write_text(json.dumps(report, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--evidence", required=True)
    parser.add_argument("--reports", default=str(HERE.parent / "docs" / "survey"))
    args = parser.parse_args()
    reports = Path(args.reports)
    aligned: dict[str, set[float]] = {}
    for row in json.loads(Path(args.evidence).read_text())["rows"]:
        moved = row["aligned"] and warmup_steps(row["setting"]) > 0
        aligned.setdefault(row["setting"], set()).update([row["learning_rate"]] if moved else [])
    why = ("version 5 changes only runs whose first steps read aligned under a warmup; this report's hybrid runs read "
           "below the gate or have no warmup at their LR ({}), or were measured again at version 5")
    for name, lrs in aligned.items():
        for path in sorted(reports.glob(f"{name}-user-seed*.json")):
            report = json.loads(path.read_text())
            if _version(report["environment"]) != FROM:
                continue
            if report["learning_rate"] in lrs:
                print(f"{path.name}: aligned under a warmup at {report['learning_rate']:g}, to be run again")
                continue
            carry(path, args.evidence, why.format(f"{report['learning_rate']:g}"))
            print(f"{path.name}: carried")
        path = reports / f"{name}-hybrid-seed0.json"
        check = json.loads(path.read_text()) if path.exists() else None
        if check is None or _version(check["environment"]) != FROM:
            continue
        runs = check["runs"]
        stale = [r["learning_rate"] for r in runs if r["learning_rate"] in lrs and _version(r.get("environment")) != TO]
        if stale:
            print(f"{path.name}: aligned at {', '.join(f'{lr:g}' for lr in stale)}, to be checked again")
            continue
        carry(path, args.evidence, why.format(", ".join(f"{r['learning_rate']:g}" for r in runs)))
        print(f"{path.name}: carried")


if __name__ == "__main__":
    main()
