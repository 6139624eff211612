"""The GPU suite's table (scripts/gpu_session.sh): one block per part that wrote a benchmark report, each arm's final
loss and its speedup to the same-LR Trainer's final loss in updates and in wall clock, with G where the swept
Trainer ran. Printed last, so that the device reply's tail carries it; also written as JSON.

    python scripts/gpu_summary.py /tmp/gpu_work --json /tmp/gpu_out/suite.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from presets import PEER_ARMS
from report import speedups

LABELS = {"baseline": "Trainer", "hybrid": "HybridHFTrainer", "ema": "EMA of the Trainer", "sf": "schedule-free AdamW",
          "sf-swept": "schedule-free AdamW, its swept LR", "swept": "Trainer at the reference LR",
          "prodigy": "Prodigy", "mechanic": "Mechanic"}
ORDER = ("scratch", "finetune", "cost", "scratch355")  # the suite's, most important first


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _g(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def part_rows(report: dict) -> list[dict]:
    """Per arm of pair 0 (or the median over pairs): final loss, speedups in updates and wall clock, G."""
    rows = []
    for arm in ("baseline", "hybrid", *PEER_ARMS):
        if not report.get(arm):  # not asked for, failed, or cut off before it ran
            continue
        wall = [s for s in speedups(report, arm) if s is not None]
        updates = [s for s in speedups(report, arm, "updates_to_target") if s is not None]
        g = report.get("sweep_fraction", {}).get(arm, {})
        rows.append({
            "arm": arm, "learning_rate": report.get(f"{arm}_learning_rate", report["learning_rate"]),
            "final_eval_loss": statistics.median(r["final_eval_loss"] for r in report[arm]),
            "wall": wall, "updates": updates,
            "wall_median": statistics.median(wall) if len(wall) == len(report[arm]) else None,
            "updates_median": statistics.median(updates) if len(updates) == len(report[arm]) else None,
            "g_updates": (g.get("updates") or [None])[0], "g_wall": (g.get("wall") or [None])[0],
            "tokens_per_second": statistics.median(r["tokens_per_second"] for r in report[arm]),
            "peak_memory_mb": report[arm][0]["peak_memory_mb"],
        })
    return rows


def render(name: str, report: dict, rows: list[dict]) -> list[str]:
    env = report.get("environment", {})
    asked = report.get("pairs_asked", report["repeats"])
    pairs = f"{report['repeats']} pair(s)" if asked == report["repeats"] else f"{report['repeats']} of {asked} pairs"
    lines = [f"{name}: {report['preset']} on {env.get('device', '?')}, lr {report['learning_rate']:g}, "
             f"{pairs}, target {_targets(report)} (the same-LR Trainer's final loss)",
             f"  {'arm':38} {'lr':>8} {'final':>7} {'updates':>8} {'wall':>8} {'G upd':>6} {'G wall':>6} {'tok/s':>8}"]
    for row in rows:
        lines.append(f"  {LABELS[row['arm']]:38} {row['learning_rate']:8.2g} {row['final_eval_loss']:7.4f} "
                     f"{_x(row['updates_median']):>8} {_x(row['wall_median']):>8} {_g(row['g_updates']):>6} "
                     f"{_g(row['g_wall']):>6} {row['tokens_per_second']:8.0f}")
    if report["repeats"] > 1:
        lines.append(f"  hybrid per pair, wall: {', '.join(map(_x, speedups(report, 'hybrid')))}; evaluations bit "
                     f"for bit: {', '.join(f'{e[0]}/{e[1]}' for e in report.get('equal_evals', []))}")
    for arm, reason in report.get("failed_arms", {}).items():
        lines.append(f"  {LABELS[arm]:38} failed: {reason}")
    if report.get("not_run"):
        lines.append(f"  not run (cut off by the part's limit, or after a failure): "
                     f"{', '.join(LABELS[arm] for arm in report['not_run'])}")
    stats = report["hybrid"][0].get("hybrid_stats") if report.get("hybrid") else None
    if stats:
        lines.append(f"  hybrid: lr scale {stats.get('lr_scale')}, {stats.get('lr_readings')} readings, "
                     f"{stats.get('predict_steps')} predicted steps, {stats.get('undone_steps', 0)} undone")
    return lines


def _targets(report: dict) -> str:
    return ", ".join(f"{t:.4f}" for t in report["targets"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("work", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    suite, lines = {}, []
    paths = args.work.glob("*/*/report.json")
    for path in sorted(paths, key=lambda p: (ORDER + (p.parent.parent.name,)).index(p.parent.parent.name)):
        report = json.loads(path.read_text())
        if report.get("mode") != "speed":
            continue  # the other modes print their own tables into the part's log
        name = path.parent.parent.name
        rows = part_rows(report)
        suite[name] = {"preset": report["preset"], "environment": report.get("environment"), "rows": rows,
                       "targets": report["targets"], "equal_evals": report.get("equal_evals"),
                       "failed_arms": report.get("failed_arms", {}), "not_run": report.get("not_run", [])}
        lines += render(name, report, rows)
    print("\n".join(lines) if lines else "no speed report was written")
    if args.json:
        args.json.write_text(json.dumps(suite, indent=2))


if __name__ == "__main__":
    main()
