"""The LR autopilot's survey (issue 49): per setting of survey_settings.py, a coarse sweep of the Trainer, then every
arm at the LR a user types beside the Trainer at the swept LR, and G, the share of the sweep's gain each arm recovers.

    python scripts/survey.py list
    python scripts/survey.py sweep scratch-2x128-docs-constant            # the Trainer over the setting's grid
    python scripts/survey.py run scratch-2x128-docs-constant --seed 1     # the arms at the user's LR
    python scripts/survey.py check scratch-2x128-docs-constant            # the hybrid from the user's LR to the swept
    python scripts/survey.py table --half tune                             # G per setting and arm
    python scripts/survey.py readings --half all                           # what the readings cost at the swept LR

Reports are kept in docs/survey/ (`--reports`): NAME-sweep-seedS.json, NAME-user-seedS.json and
NAME-hybrid-seedS.json (`check`: the hybrid alone at each grid LR from the user's to about 3x the swept, against the
same seed's Trainer at the same LR: never worse is the goal). Seed 0's sweep names the swept LR; another seed's sweep
and check run at the LRs named (`--seed 1 --learning_rates ...`). The tuning half is
read while choosing gates, caps and cadences; the report half only once they are fixed.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from presets import PRESETS
from report import UPDATES, time_to
from survey_settings import counts_now

from hf_hybrid.autopilot.alignment import LAST_STEP as FIRST_RAISE_UPDATE

HERE = Path(__file__).resolve().parent
ARMS = "hybrid,prodigy,mechanic,sf,swept"
G_ARMS = ("hybrid", "prodigy", "mechanic", "sf")


def settings() -> dict[str, dict]:
    return {name.removeprefix("survey-"): p for name, p in PRESETS.items() if name.startswith("survey-")}


def benchmark(*args: str) -> None:
    subprocess.run([sys.executable, str(HERE / "benchmark.py"), *args], check=True)


def sweep(name: str, args) -> None:
    grid = args.learning_rates or ",".join(f"{lr:g}" for lr in settings()[name]["grid"])
    out = Path(args.work) / name
    benchmark("--preset", f"survey-{name}", "--mode", "sweep", "--learning_rates", grid, "--seed", str(args.seed),
              *_steps(args), "--output_dir", str(out))
    keep(out / f"survey-{name}-sweep" / "sweep-baseline.json",
         Path(args.reports) / f"{name}-sweep-seed{args.seed}.json", merge=bool(args.learning_rates))


def keep(new: Path, kept: Path, merge: bool) -> None:
    """Copy a sweep mode's report into the reports; with `merge` (LRs named on the command line), its runs join the
    kept report's, replacing any at the same LR, the best is chosen again, and each added run keeps its environment
    (the grid grows one step where a sweep's best was at its edge)."""
    if not (merge and kept.exists()):
        shutil.copy(new, kept)
        return
    old, added = json.loads(kept.read_text()), json.loads(new.read_text())
    runs = {r["learning_rate"]: r for r in old["runs"]}
    runs.update({r["learning_rate"]: dict(r, environment=added["environment"]) for r in added["runs"]})
    old["runs"] = [runs[lr] for lr in sorted(runs)]
    old["best_learning_rate"] = min(old["runs"], key=lambda r: r["final_eval_loss"])["learning_rate"]
    kept.write_text(json.dumps(old, indent=2))


def user_and_swept_lr(name: str, reports: Path) -> tuple[float, float]:
    """The setting's swept LR (its sweep's best final loss) and the LR a user types there."""
    swept = json.loads((reports / f"{name}-sweep-seed0.json").read_text())["best_learning_rate"]
    return settings()[name]["user_lr"] or swept / 10, swept


def run(name: str, args) -> None:
    user, swept = user_and_swept_lr(name, Path(args.reports))
    out = Path(args.work) / name
    benchmark("--preset", f"survey-{name}", "--repeats", "1", "--seed", str(args.seed), "--learning_rate", f"{user:g}",
              "--swept_learning_rate", f"{swept:g}", "--sf_learning_rate", f"{swept:g}", "--arms", args.arms,
              *_steps(args), "--output_dir", str(out))
    kept = Path(args.reports) / f"{name}-user-seed{args.seed}.json"
    report = json.loads((out / f"survey-{name}-speed" / "report.json").read_text())
    if kept.exists():
        carry_peers(report, json.loads(kept.read_text()))
    kept.write_text(json.dumps(report, indent=2))


def carry_peers(report: dict, kept: dict) -> None:
    """The peers this run left out (`--arms hybrid,swept`: the hybrid measured again at a new behaviour version), from
    the kept report of the same setting and seed. A peer runs with the hybrid off, so the library's version does not
    move it, and its G is computed against the baseline and the swept Trainer of its own run: in updates it is the same
    number, in wall clock it carries that run's clock. The report says which arms were carried and from which run.
    Nothing is carried from a run evaluated on another schedule: its G has another resolution."""
    new_settings, kept_settings = report.get("preset_settings") or {}, kept.get("preset_settings") or {}
    if any(new_settings.get(k) != kept_settings.get(k) for k in ("eval_steps", "early_eval_steps")):
        return
    carried = [arm for arm in G_ARMS if arm != "hybrid" and arm not in report.get("sweep_fraction", {})
               and arm in kept.get("sweep_fraction", {})]
    for arm in carried:
        for key in (arm, f"{arm}_speedups", f"{arm}_update_speedups", f"{arm}_learning_rate"):
            if key in kept:
                report[key] = kept[key]
        report["sweep_fraction"][arm] = kept["sweep_fraction"][arm]
    if carried:
        report["environment"]["peers_carried"] = {
            "arms": carried, "behaviour_version": kept["environment"].get("behaviour_version"),
            "commit": kept["environment"].get("commit")}


def check(name: str, args) -> None:
    """The hybrid alone at every grid LR from the user's to about 3x the swept one, each final loss against the
    Trainer's: never worse is the goal at every one of them."""
    reports = Path(args.reports)
    user, swept = user_and_swept_lr(name, reports)
    grid = [lr for lr in settings()[name]["grid"] if user * 0.99 <= lr <= swept * 3.5]
    out = Path(args.work) / name
    benchmark("--preset", f"survey-{name}", "--mode", "sweep", "--sweep_arm", "hybrid", "--seed", str(args.seed),
              "--learning_rates", args.learning_rates or ",".join(f"{lr:g}" for lr in grid), *_steps(args),
              *(["--set", *args.set] if args.set else []), "--output_dir", str(out))
    keep(out / f"survey-{name}-sweep" / "sweep-hybrid.json", reports / f"{name}-hybrid-seed{args.seed}.json",
         merge=bool(args.learning_rates))
    print_check(name, reports, args.seed)


def print_check(name: str, reports: Path, seed: int = 0) -> list[dict]:
    """Per LR: the Trainer's final loss (the same seed's sweep), the hybrid's, the difference and the scale the hybrid
    ended on; and G in updates where the Trainer ran at that LR and at the swept one (seed 0's best), from the same
    evaluations. A seed other than 0 needs its own sweep at the LRs checked: `sweep NAME --seed S --learning_rates`."""
    trainer = {r["learning_rate"]: r
               for r in json.loads((reports / f"{name}-sweep-seed{seed}.json").read_text())["runs"]}
    swept = trainer.get(user_and_swept_lr(name, reports)[1])
    rows = []
    for run in json.loads((reports / f"{name}-hybrid-seed{seed}.json").read_text())["runs"]:
        lr, final, plain = run["learning_rate"], run["final_eval_loss"], trainer.get(run["learning_rate"])
        row = {"learning_rate": lr, "trainer": plain and plain["final_eval_loss"], "hybrid": final,
               "difference": final - plain["final_eval_loss"] if plain else None,
               "lr_scale": (run.get("hybrid_stats") or {}).get("lr_scale"), "g_updates": None}
        if plain and swept is not None and swept is not plain:
            target = plain["final_eval_loss"]
            base, arm, best = (time_to(r["evals"], target, UPDATES) for r in (plain, run, swept))
            if arm and best and base / best > 1:
                row["g_updates"] = math.log(base / arm) / math.log(base / best)
        rows.append(row)
        print(f"  {name} lr {lr:<8g} Trainer {_g(row['trainer'], 4)}  hybrid {final:.4f}  "
              f"difference {_g(row['difference'], 4, '+')}  scale {row['lr_scale']}  G {_g(row['g_updates'])}")
    return rows


def _steps(args) -> list[str]:
    return ["--max_steps", str(args.max_steps)] if args.max_steps else []


def rows(reports: Path, half: str) -> list[dict]:
    """Per setting with reports at the library's current behaviour version, evaluated on the setting's current
    schedule: each arm's median G over seeds, in updates and in wall clock."""
    out = []
    for name, setting in settings().items():
        runs = [json.loads(path.read_text()) for path in sorted(reports.glob(f"{name}-user-seed*.json"))]
        runs = [r for r in runs if counts_now(r, setting)]
        if half != "all" and setting["half"] != half or not runs:
            continue
        row = {"setting": name, "half": setting["half"], "seeds": len(runs),
               "learning_rate": runs[0]["learning_rate"], "swept_learning_rate": runs[0]["swept_learning_rate"]}
        for arm in G_ARMS:
            for unit in ("updates", "wall"):
                values = [r["sweep_fraction"][arm][unit][0] for r in runs if arm in r.get("sweep_fraction", {})]
                # An arm that never reached the same-LR Trainer's loss recovered nothing of the sweep's gain.
                values = [0.0 if v is None else v for v in values]
                row[f"{arm}_{unit}"] = statistics.median(values) if values else None
        user, swept = (statistics.median(r[arm][0]["updates_to_target"] or math.inf for r in runs)
                       for arm in ("baseline", "swept"))
        if swept < user:
            row.update(user_updates=user, swept_updates=swept, late_for_0_9=late_for(0.9, user, swept),
                       g_late=late_g(user, swept, FIRST_RAISE_UPDATE))
        out.append(row)
    return out


def late_g(user: float, swept: float, late: float) -> float:
    """G in updates of a run that follows the swept Trainer's path `late` updates after it, having gained nothing
    before. The updates are each Trainer's to the user-LR Trainer's final loss. A yardstick for what G asks, not a
    ceiling: inside a long warmup the swept Trainer's own first updates are small, and a switch there loses less
    (docs/benchmarks.md, "What G 0.9 asks")."""
    return math.log(user / (swept + late)) / math.log(user / swept)


def late_for(g: float, user: float, swept: float) -> float:
    """How many updates late on the swept Trainer's path a run may be and still reach G `g` (the inverse of
    `late_g`)."""
    return user ** (1 - g) * swept ** g - swept


def table(args) -> None:
    found = rows(Path(args.reports), args.half)
    print(f"G, the share of the sweep's gain recovered at the user's LR (median over seeds; {args.half} half):")
    print(f"  {'setting':38} {'half':6} {'lr':>8} {'swept':>8} " + " ".join(f"{arm:>15}" for arm in G_ARMS))
    for row in found:
        cells = " ".join(f"{_g(row[f'{arm}_updates'])}/{_g(row[f'{arm}_wall'])}".rjust(15) for arm in G_ARMS)
        print(f"  {row['setting']:38} {row['half']:6} {row['learning_rate']:8.2g} {row['swept_learning_rate']:8.2g} "
              f"{cells}")
    print("  what G 0.9 in updates asks, from the two Trainers' updates to the target: the swept Trainer's path at "
          f"most this many updates late; and G on that path {FIRST_RAISE_UPDATE} updates late, where this design's "
          "first raise may start at the soonest:")
    for row in (row for row in found if "g_late" in row):
        print(f"  {row['setting']:38} Trainer {row['user_updates']:5.0f}, swept {row['swept_updates']:5.1f}: "
              f"late by {row['late_for_0_9']:4.1f} at most; G {row['g_late']:.2f} from update {FIRST_RAISE_UPDATE}")
    if found:
        ahead = sum((r["hybrid_updates"] or 0) > (r["prodigy_updates"] or 0) for r in found)
        print(f"  (updates/wall clock) hybrid ahead of Prodigy in updates in {ahead} of {len(found)} settings; "
              f"median G of the hybrid {statistics.median(r['hybrid_updates'] or 0 for r in found):.2f} in updates")
        late = [r["g_late"] for r in found if "g_late" in r]
        if late:
            print(f"  median G on the swept Trainer's path {FIRST_RAISE_UPDATE} updates late: "
                  f"{statistics.median(late):.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(found, indent=2))


def readings(args) -> None:
    """Seed 0's hybrid at the swept LR (the never-worse check's run there): its readings, and their forwards as a
    share of the run's compute in forward-equivalents: a reading is 3 forwards of one micro-batch, 1 more where it
    judges a raise; an update is a forward and a backward (about 2 forwards) of each micro-batch it accumulates. A
    proxy on any machine for what the readings add to a tuned run; the wall clock's share differs where a step is
    host-bound (docs/benchmarks.md, "The readings' compute at the swept LR")."""
    reports = Path(args.reports)
    print("The readings at the swept LR (seed 0): forwards as a share of the run's forward-equivalents")
    for name, setting in settings().items():
        kept = reports / f"{name}-hybrid-seed0.json"
        if args.half != "all" and setting["half"] != args.half or not kept.exists():
            continue
        swept = user_and_swept_lr(name, reports)[1]
        run = next((r for r in json.loads(kept.read_text())["runs"] if r["learning_rate"] == swept), None)
        if run is None:
            continue
        stats = run["hybrid_stats"]
        judged = stats["lr_raises_kept"] + stats["lr_trials_undone"]
        share = (3 * stats["lr_readings"] + judged) / (3 * stats["backward_steps"] * setting["grad_accum"])
        print(f"  {name:38} {setting['half']:6} swept {swept:<7g} updates {stats['backward_steps']:4} x "
              f"{setting['grad_accum']} micro-batches, readings {stats['lr_readings']:2}, raises judged {judged}: "
              f"{100 * share:.1f}%")


def _g(value: float | None, digits: int = 2, sign: str = "") -> str:
    return "-" if value is None else f"{value:{sign}.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["list", "sweep", "run", "check", "table", "readings"])
    parser.add_argument("setting", nargs="?")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--half", choices=["tune", "report", "fresh", "all"], default="tune")
    parser.add_argument("--max_steps", type=int, default=0, help="override the setting's steps (smoke runs)")
    parser.add_argument("--learning_rates", default="",
                        help="sweep, check: only these LRs, merged into the kept report")
    parser.add_argument("--reports", default=str(HERE.parent / "docs" / "survey"))
    parser.add_argument("--work", default="runs/survey")
    parser.add_argument("--json", help="table: also write the rows here")
    parser.add_argument("--arms", default=ARMS, help="run: the arms beside the baseline; peers left out are carried "
                        "from the kept report of the same seed")
    parser.add_argument("--set", nargs="*", default=[], metavar="FLAG=VALUE", help="check: hybrid flag overrides")
    args = parser.parse_args()
    Path(args.reports).mkdir(parents=True, exist_ok=True)
    if args.command == "list":
        for name, setting in settings().items():
            print(f"{setting['half']:6} {name:38} user LR {setting['user_lr'] or 'a tenth of the swept'}")
    elif args.command == "table":
        table(args)
    elif args.command == "readings":
        readings(args)
    elif args.setting not in settings():
        sys.exit(f"survey: unknown setting {args.setting!r}; `survey.py list` names them")
    else:
        {"sweep": sweep, "run": run, "check": check}[args.command](args.setting, args)


if __name__ == "__main__":
    main()
