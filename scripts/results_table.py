"""The survey's results per setting, from the LR-autopilot survey's reports in docs/survey/ (scripts/survey.py): the
table docs/results.md shows (scripts/render_readme.py writes it there), and the facts per setting that README.md's
summary adds up.

One row per setting that has a report at the LR a user types (NAME-user-seedS.json): the fresh settings first, then
the report half, then the tuning half, each in survey_settings.py's order: every one, the weak ones too. A setting
with no such report is left out.

A report is current when its environment's behaviour_version is hf_hybrid.BEHAVIOUR_VERSION (the library raises it
with every change that moves a run). A row's numbers come from current reports only, evaluated on the setting's
current schedule (survey_settings.py's `counts_now`), as the median over their seeds; a setting whose user
reports are all older renders as a row that says it is not measured at the current version. The
never-worse cell needs the hybrid's check (NAME-hybrid-seed0.json) current beside the Trainer's sweep
(NAME-sweep-seed0.json, the plain Trainer alone, which no library change moves), and says the same otherwise.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

from survey_settings import at_current_version, counts_now, survey_settings  # noqa: E402

SURVEY = REPO / "docs" / "survey"
NOT_MEASURED = "not measured at the current version"
PEERS = {"prodigy": "Prodigy", "mechanic": "Mechanic", "sf": "schedule-free AdamW"}
HEADER = ("| setting (half): the user's LR (the swept) | Trainer at the user's LR; at the swept LR | hybrid "
          "| best peer | never worse: hybrid's final loss - Trainer's, where it is highest |")

CAPTION = ("Rendered by `scripts/render_readme.py` from the LR-autopilot survey's reports (`docs/survey/`, "
           "`scripts/survey.py`), on a CPU, each setting at the LR a user types: `TrainingArguments`' 5e-5 to "
           "fine-tune, a tenth of the swept LR from scratch (but 5e-5 in `scratch-2x128-code-linear` and "
           "`scratch-2x96-docs-linear`, at every `TrainingArguments` default; the swept LR: the best final loss "
           "over a coarse grid of the Trainer's LRs). (fresh) rows come from settings "
           "written after the tuning ended and run once, "
           "(report) rows from the half set aside before any tuning and not tuned on (it was "
           "run between tuning rounds, and two gates were set with some of its readings in view: README.md's Known "
           "limits), (tune) rows from the half it was tuned on. An arm's cell: the Trainer's updates to "
           "its own final loss over the arm's (for the hybrid, wall clock in brackets), then the arm's held-out loss "
           "at the Trainer's number of updates; evaluations at the start, every hundredth of the run up to the "
           "first tenth, then every tenth. Peers: Prodigy, Mechanic, schedule-free AdamW. Never worse: the hybrid "
           "alone at each LR of the setting's grid from the user's to 3x the swept (seed 0), and on seed 1 at the "
           "grid's top and where seed 0 kept a raise at a third of the swept LR or above, each against the same "
           "seed's Trainer. Medians over seeds where several ran.")


@dataclass
class Row:
    cells: list[str]
    sources: list[Path] = field(default_factory=list)  # the reports its numbers come from


def counts(report: dict) -> bool:
    """Whether a report's numbers may reach the table: a current one, or a sweep of the plain Trainer alone, which no
    change to the library moves."""
    return at_current_version(report) or report.get("arm") == "baseline"


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def median_speedup(values: list[float | None]) -> float | None:
    """The median over seeds, a seed that never reached the loss counting lowest; median_low keeps it a seed's own
    value, so that an even count never averages a speedup with 'not reached'."""
    ranked = statistics.median_low([-1.0 if v is None else v for v in values])
    return None if ranked < 0 else ranked


def _lr(value: float) -> str:
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def _arm(updates: float | None, loss: float, wall: float | None = None) -> str:
    """An arm's cell: its speedup to the Trainer's final loss in updates (with the wall clock's, where given), then its
    own final loss."""
    if updates is None:
        return f"not reached, {loss:.3f}"
    return f"{updates:.2f}x{f' ({wall:.2f}x)' if wall else ''}, {loss:.3f}"


def _loss_at(arm: dict, updates: int) -> float:
    """The arm's held-out loss at its last evaluation within `updates` updates (its final one where it ran no more)."""
    within = [e for e in arm["evals"] if e[3] <= updates]
    return within[-1][2] if within else arm["final_eval_loss"]


def _user_cells(reports: list[dict]) -> list[str]:
    """The Trainer's, the hybrid's and the best peer's cells, from current reports at the user's LR. A peer is read
    from the seeds that ran it (a report may run the hybrid alone beside the Trainers), and says so when they are
    fewer than the hybrid's."""
    def final(arm: str, among: list[dict]) -> float:
        # At the Trainer's number of updates: under a constant schedule the benchmark lets the hybrid run on past it
        # to reach the target, and a loss after more updates is no final to set beside the Trainer's.
        return statistics.median(_loss_at(r[arm][0], r["baseline"][0]["steps"]) for r in among)

    def updates(prefix: str, among: list[dict]) -> float | None:
        return median_speedup([r[f"{prefix}update_speedups"][0] for r in among])

    trainer = f"{final('baseline', reports):.3f}; swept: {_arm(updates('swept_', reports), final('swept', reports))}"
    wall = median_speedup([r["speedups"][0] for r in reports])
    hybrid = f"**{_arm(updates('', reports), final('hybrid', reports), wall)}**"
    peers = []
    for arm in PEERS:
        among = [r for r in reports if arm in r]
        if among:
            peers.append((updates(f"{arm}_", among), final(arm, among), arm, len(among)))
    # The best peer reaches the Trainer's loss in the fewest updates; where none does, the one with the lowest loss.
    reached = [p for p in peers if p[0] is not None]
    if peers:
        speedup, loss, arm, seeds = max(reached, key=lambda p: p[0]) if reached else min(peers, key=lambda p: p[1])
        of = f" ({seeds} of {len(reports)} seeds)" if seeds < len(reports) else ""
        peer = f"{PEERS[arm]}: {_arm(speedup, loss)}{of}"
    else:
        peer = "-"
    return [trainer, hybrid, peer]


def never_worse_checks(name: str, reports: Path = SURVEY) -> tuple[list[tuple[float, float]], list[Path]]:
    """The hybrid alone at each LR from the user's to about 3x the swept one: (its final loss minus the same seed's
    Trainer's at the same LR, the LR) over every seed checked (seed 0 at every LR of the grid; another seed where it
    was run), and the reports they come from. None unless seed 0's check is current."""
    differences, sources = [], []
    for path in sorted(reports.glob(f"{name}-hybrid-seed*.json")):
        sweep_path = path.with_name(path.name.replace("-hybrid-", "-sweep-"))
        hybrid, sweep = _load(path), _load(sweep_path)
        if not (hybrid and sweep and counts(hybrid) and counts(sweep)):
            continue
        trainer = {run["learning_rate"]: run["final_eval_loss"] for run in sweep["runs"]}
        found = [(run["final_eval_loss"] - trainer[run["learning_rate"]], run["learning_rate"])
                 for run in hybrid["runs"] if run["learning_rate"] in trainer]
        differences += found
        sources += [path, sweep_path] if found else []
    if reports / f"{name}-hybrid-seed0.json" not in sources:
        return [], []
    return differences, sources


def _never_worse(name: str, reports: Path) -> tuple[str, list[Path]]:
    """The worst of `never_worse_checks`, and the LR where it came."""
    differences, sources = never_worse_checks(name, reports)
    if not differences:
        return NOT_MEASURED, []
    worst, lr = max(differences)
    seeds = len(sources) // 2
    return f"{worst:+.3f} at {_lr(lr)} (of {len(differences)} runs{f', {seeds} seeds' if seeds > 1 else ''})", sources


def current_user_reports(name: str, setting: dict, reports: Path = SURVEY) -> list[tuple[Path, dict]] | None:
    """The setting's reports at the user's LR that count now (survey_settings.py's `counts_now`); None where it has
    none at all."""
    paths = sorted(reports.glob(f"{name}-user-seed*.json"))
    if not paths:
        return None
    return [(path, report) for path in paths if counts_now(report := json.loads(path.read_text()), setting)]


def rows(reports: Path = SURVEY) -> list[Row]:
    """The table's rows, in order, each with the reports its numbers come from."""
    settings = survey_settings({})
    ordered = [n for half in ("fresh", "report", "tune") for n, s in settings.items() if s["half"] == half]
    out = []
    for name in ordered:
        used = current_user_reports(name, settings[name], reports)
        if used is None:
            continue
        setting = f"`{name}` ({settings[name]['half']})"
        if not used:
            out.append(Row([setting, NOT_MEASURED, "-", "-", "-"]))
        else:
            first = used[0][1]
            seeds = f", {len(used)} seeds" if len(used) > 1 else ""
            setting += f": {_lr(first['learning_rate'])} ({_lr(first['swept_learning_rate'])}){seeds}"
            check, check_sources = _never_worse(name, reports)
            out.append(Row([setting, *_user_cells([r for _, r in used]), check],
                           [p for p, _ in used] + check_sources))
    return out


def render(reports: Path = SURVEY) -> str:
    """docs/results.md's block: the table and its caption."""
    lines = [HEADER, "|" + "---|" * HEADER.count(" | ") + "---|"]
    lines += ["| " + " | ".join(row.cells) + " |" for row in rows(reports)]
    lines += ["", CAPTION]
    return "\n".join(lines)
