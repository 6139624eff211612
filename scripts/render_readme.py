"""The results README.md and docs/results.md show, rendered from the LR-autopilot survey's reports in docs/survey/
(scripts/survey.py), so that no number in either is typed by hand.

    python scripts/render_readme.py            # print both blocks
    python scripts/render_readme.py --check    # exit 1 when either file's block is not what this renders
    python scripts/render_readme.py --write    # rewrite both blocks

docs/results.md shows one row per setting (scripts/results_table.py). README.md sums the same settings up by kind of
run, for a reader deciding in two minutes: per kind, the medians over its settings of what each setting's row shows
(each itself a median over seeds; a speedup never reached counts as 0), G from `survey.py table`, and the worst
never-worse check of them all. Only current reports count, as in the table: a setting with none at the current
behaviour version is left out of the summary, and docs/results.md names it as not measured.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from results_table import REPO, SURVEY, Row, current_user_reports, median_speedup, never_worse_checks
from results_table import render as render_table
from survey import rows as g_rows
from survey_settings import survey_settings

README = REPO / "README.md"
RESULTS = REPO / "docs" / "results.md"
START, END = "<!-- results:start -->", "<!-- results:end -->"
KINDS = ("from scratch", "full fine-tune", "LoRA", "classifier")
HELD_OUT = ("fresh", "report")
SUMMARY_HEADER = ("| kind of run, at the LR a user types | settings (held out) | hybrid: speedup in updates (wall "
                  "clock), median and range | the swept LR's speedup | G in updates / wall clock: all (held out) | "
                  "settings where the hybrid's G in updates beats Mechanic's; Prodigy's | never worse: the worst "
                  "final loss minus the Trainer's (checks) |")
LEAD = (
    "Each setting trains at the LR a user types, {below} below its swept LR (the best of a coarse grid), beside the "
    "plain Trainer at both and two optimizers that need no LR: Prodigy, and Mechanic (AdamW with a learned multiplier "
    "on its schedule, the quantity the autopilot moves). A **speedup** is the updates the Trainer at the user's LR "
    "needs to reach its own final held-out loss, over the updates an arm needs to reach it. **G** is the log of the "
    "hybrid's speedup over the log of the swept LR's: the share of what a sweep buys that the hybrid recovers without "
    "one (1: all of it, 0: none).")
CAPTION = (
    "On a CPU: {models} ({layers} layers; the fine-tunes start from a 2-layer one pretrained here on Shakespeare) "
    "on the shipped corpora and torch's source, {updates} updates, {seeds}. The user's LR: `TrainingArguments`' 5e-5 "
    "to fine-tune; from scratch a tenth of the swept LR, or 5e-5 where every other argument is left at its default "
    "too. Held out: settings written after the tuning ended, or set aside before it (Known limits says what was read "
    "from them). Never worse: the hybrid alone at every LR of the setting's grid from the user's to 3x the swept, "
    "against the same seed's Trainer. Jumps: the hybrid's {runs} runs behind the table judged {judged} and kept "
    "{kept}. Rendered by `scripts/render_readme.py` from the survey's reports (`docs/survey/`); every setting, with "
    "each peer's figures: [docs/results.md](docs/results.md).")


def _span(values: set[int]) -> str:
    """'2-6' for a range of values, '3' for one, '-' for none."""
    return f"{min(values)}-{max(values)}" if len(values) > 1 else str(min(values)) if values else "-"


def kind(setting: dict) -> str:
    """A survey setting's kind of run (survey_settings.py)."""
    if "lora" in setting:
        return "LoRA"
    if "task" in setting:
        return "classifier"
    return "from scratch" if "model" in setting else "full fine-tune"


def _kind_row(label: str, names: list[str], settings: dict, reports: Path, g: dict) -> Row:
    """One kind's cells from its settings' current reports."""
    sources, updates, wall, swept, gaps = [], [], [], [], []
    for name in names:
        used = current_user_reports(name, settings[name], reports)
        sources += [path for path, _ in used]
        runs = [report for _, report in used]
        updates.append(median_speedup([r["update_speedups"][0] for r in runs]) or 0.0)
        wall.append(median_speedup([r["speedups"][0] for r in runs]) or 0.0)
        swept.append(median_speedup([r["swept_update_speedups"][0] for r in runs]) or 0.0)
        differences, check_sources = never_worse_checks(name, reports)
        sources += check_sources
        gaps += [gap for gap, _ in differences]
    held_out = [n for n in names if settings[n]["half"] in HELD_OUT]
    spread = f"; {min(updates):.1f}-{max(updates):.1f}x" if len(names) > 1 else ""
    hybrid = f"{statistics.median(updates):.1f}x ({statistics.median(wall):.1f}x){spread}"

    def median_g(among: list[str]) -> str:
        medians = (statistics.median(g[n][f"hybrid_{unit}"] or 0.0 for n in among) for unit in ("updates", "wall"))
        return "/".join(f"{m:.2f}" for m in medians)

    held = f" ({median_g(held_out)})" if held_out and len(held_out) < len(names) else ""

    def ahead(peer: str) -> int:
        return sum((g[n]["hybrid_updates"] or 0.0) > (g[n][f"{peer}_updates"] or 0.0) for n in names)

    never = f"{max(gaps):+.3f} ({len(gaps)})" if gaps else "-"
    return Row([label, f"{len(names)} ({len(held_out)})", hybrid, f"{statistics.median(swept):.1f}x",
                median_g(names) + held, f"{ahead('mechanic')} of {len(names)}; {ahead('prodigy')} of {len(names)}",
                never], sources)


def _summary(reports: Path) -> tuple[list[Row], dict[str, str]]:
    """README.md's rows (one per kind of run with current reports at the user's LR, then all of them), and the scope
    of the settings behind them for the caption: their layers from scratch, their updates, their seeds, how far below
    the swept LR the user's is, and the jumps the hybrid's runs judged and kept."""
    settings = survey_settings({})
    g = {row["setting"]: row for row in g_rows(reports, "all")}
    seeds = {n: len(used) for n in settings if n in g and (used := current_user_reports(n, settings[n], reports))}
    by_kind = {k: [n for n in seeds if kind(settings[n]) == k] for k in KINDS}
    rows = [_kind_row(k, names, settings, reports, g) for k, names in by_kind.items() if names]
    if len(rows) > 1:
        rows.append(_kind_row("all", list(seeds), settings, reports, g))
    scope = dict(layers=_span({settings[n]["model"]["n_layer"] for n in by_kind["from scratch"]}),
                 updates=_span({settings[n]["max_steps"] for n in seeds}))
    llamas = sum(settings[n]["model"].get("architecture") == "llama" for n in by_kind["from scratch"])
    scope["models"] = "small GPT-2s" + {0: "", 1: " and a Llama"}.get(llamas, f" and {llamas} Llamas")
    scope["seeds"] = "1 seed" if set(seeds.values()) == {1} else f"{_span(set(seeds.values()))} seeds"
    used = [report for n in seeds for _, report in current_user_reports(n, settings[n], reports)]
    scope["below"] = f"{_span({round(r['swept_learning_rate'] / r['learning_rate']) for r in used})}x"
    hybrid_runs = [run.get("hybrid_stats") or {} for r in used for run in r.get("hybrid", [])]
    scope.update(runs=len(hybrid_runs), judged=sum(s.get("predictions_judged", 0) for s in hybrid_runs),
                 kept=sum(s.get("predictions_kept", 0) for s in hybrid_runs))
    return rows, scope


def summary_rows(reports: Path = SURVEY) -> list[Row]:
    return _summary(reports)[0]


def render_summary(reports: Path = SURVEY) -> str:
    """README.md's block: what the summary's terms mean, the summary and its caption."""
    rows, scope = _summary(reports)
    lines = [LEAD.format(**scope), "", SUMMARY_HEADER, "|" + "---|" * SUMMARY_HEADER.count(" | ") + "---|"]
    lines += ["| " + " | ".join(row.cells) + " |" for row in rows]
    lines += ["", CAPTION.format(**scope)]
    return "\n".join(lines)


BLOCKS: dict[Path, Callable[[Path], str]] = {README: render_summary, RESULTS: render_table}


def _split(text: str) -> tuple[str, str, str]:
    """A file's text before the start marker, the block between the markers, and the text after the end one."""
    if text.count(START) != 1 or text.count(END) != 1:
        raise ValueError(f"the file needs one {START} and one {END}")
    head, rest = text.split(START, 1)
    block, tail = rest.split(END, 1)
    return head, block.strip("\n"), tail


def block(path: Path) -> str:
    return _split(path.read_text())[1]


def matches(path: Path, reports: Path = SURVEY, render: Callable[[Path], str] | None = None) -> bool:
    """Whether a file's block is what the reports render now (README.md's summary or docs/results.md's table)."""
    return block(path) == (render or BLOCKS[path])(reports)


def write(path: Path, reports: Path = SURVEY) -> None:
    head, _, tail = _split(path.read_text())
    path.write_text(f"{head}{START}\n{BLOCKS[path](reports)}\n{END}{tail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 when a block is stale")
    parser.add_argument("--write", action="store_true", help="rewrite both blocks")
    args = parser.parse_args()
    for path, render in BLOCKS.items():
        if args.write:
            write(path)
        elif args.check and not matches(path):
            sys.exit(f"{path.relative_to(REPO)}'s results are not what the reports render: "
                     "python scripts/render_readme.py --write")
        elif not args.check:
            print(render(SURVEY) + "\n")


if __name__ == "__main__":
    main()
