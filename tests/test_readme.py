"""README.md is the front door: short, its first screen what a newcomer needs, and its results table what
scripts/render_readme.py renders now from the reports kept in docs/survey/, with no number from a report measured
before the library's current behaviour (hf_hybrid.BEHAVIOUR_VERSION). No training, no network."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from hf_hybrid import BEHAVIOUR_VERSION

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import render_readme  # noqa: E402

README = ROOT / "README.md"
HISTORY = re.compile(r"\bruns? [0-9]+|\bsessions? [0-9]+|\b20[0-9]{2}-[01][0-9]-[0-3][0-9]\b")
COMMIT = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")


def test_the_readme_is_at_most_150_lines_and_its_first_screen_has_the_commands_and_the_swap():
    lines = README.read_text().splitlines()
    assert len(lines) <= 150
    first_screen = "\n".join(lines[:40])
    for needle in ("make demo", "make test", "+from hf_hybrid import HybridHFTrainer as Trainer"):
        assert needle in first_screen


def test_the_readme_has_no_run_numbers_dates_or_commits():
    text = README.read_text()
    assert HISTORY.findall(text) == [] and COMMIT.findall(text) == []


def test_the_results_table_is_what_the_reports_render_now():
    assert render_readme.readme_table() == render_readme.render(), "python scripts/render_readme.py --write"


def test_every_number_in_the_table_comes_from_a_current_report():
    rows = render_readme.rows()
    measured = {path.name.split("-user-")[0] for path in render_readme.SURVEY.glob("*-user-seed*.json")}
    assert len(rows) == len(measured & set(render_readme.survey_settings({}))), "a setting left out"
    for row in rows:
        assert all(len(cell) <= 100 for cell in row.cells), row.cells
        for path in row.sources:
            report = json.loads(path.read_text())
            plain_trainer_sweep = report.get("arm") == "baseline"  # no library change moves it
            assert plain_trainer_sweep or report["environment"]["behaviour_version"] == BEHAVIOUR_VERSION, path
            if "-user-" in path.name:  # timed with the early evaluations, as the setting is now
                assert report["preset_settings"]["early_eval_steps"] > 0, path
        if not row.sources:  # nothing current behind it: the row says so, with no number
            assert render_readme.NOT_MEASURED in row.cells and not re.search(r"[0-9]", " ".join(row.cells[1:]))


def test_a_hand_edited_number_fails_the_check(tmp_path):
    text = README.read_text()
    edited = tmp_path / "README.md"
    edited.write_text(text.replace(render_readme.START + "\n", render_readme.START + "\n| 1.23x |\n", 1))
    assert render_readme.matches(README) and not render_readme.matches(edited)


def _report(version: int) -> dict:
    """A user report of the survey's shape, its numbers made up."""
    arms = {arm: [{"final_eval_loss": loss, "steps": 200, "evals": [[200, 10.0, loss, 200]]}] for arm, loss in
            (("baseline", 5.5), ("hybrid", 4.8), ("swept", 4.7), ("prodigy", 5.2), ("mechanic", 5.3), ("sf", 6.0))}
    # Under a constant schedule the hybrid runs on past the Trainer's updates; the table reads it at 200.
    arms["hybrid"][0].update(final_eval_loss=4.6, steps=240, evals=[[200, 10.0, 4.8, 200], [240, 12.0, 4.6, 240]])
    speedups = {"update_speedups": [2.1], "speedups": [2.2], "swept_update_speedups": [2.7],
                "prodigy_update_speedups": [1.4], "mechanic_update_speedups": [None], "sf_update_speedups": [None]}
    # Evaluated as the survey's 300-step settings are now: early, every 3 updates before the first 30.
    return {"learning_rate": 3e-4, "swept_learning_rate": 3e-3, **arms, **speedups,
            "preset_settings": {"eval_steps": 30, "early_eval_steps": 3},
            "environment": {"behaviour_version": version, "commit": "0" * 40}}


@pytest.mark.parametrize("version", [BEHAVIOUR_VERSION - 1, None])
def test_a_report_of_an_older_behaviour_renders_as_not_measured(tmp_path, version):
    report = _report(BEHAVIOUR_VERSION)
    if version is None:
        del report["environment"]["behaviour_version"]
    else:
        report["environment"]["behaviour_version"] = version
    (tmp_path / "scratch-2x128-shakespeare-linear-user-seed0.json").write_text(json.dumps(report))
    [row] = render_readme.rows(tmp_path)
    assert row.sources == [] and row.cells[1] == render_readme.NOT_MEASURED
    assert "2.10x" not in render_readme.render(tmp_path)


def test_a_report_evaluated_without_the_early_evaluations_renders_as_not_measured(tmp_path):
    report = _report(BEHAVIOUR_VERSION)
    del report["preset_settings"]["early_eval_steps"]  # its G had another resolution
    (tmp_path / "lora8-docs-linear-user-seed0.json").write_text(json.dumps(report))
    [row] = render_readme.rows(tmp_path)
    assert row.sources == [] and row.cells[1] == render_readme.NOT_MEASURED


def test_a_current_report_renders_its_numbers_with_the_best_peer(tmp_path):
    (tmp_path / "lora8-docs-linear-user-seed0.json").write_text(json.dumps(_report(BEHAVIOUR_VERSION)))
    (tmp_path / "lora8-docs-linear-user-seed1.json").write_text(json.dumps(_report(BEHAVIOUR_VERSION - 1)))
    [row] = render_readme.rows(tmp_path)
    assert row.sources == [tmp_path / "lora8-docs-linear-user-seed0.json"]  # the older seed is left out
    assert row.cells == ["`lora8-docs-linear` (report): 3e-4 (3e-3)", "5.500; swept: 2.70x, 4.700",
                         "**2.10x (2.20x), 4.800**", "Prodigy: 1.40x, 5.200", render_readme.NOT_MEASURED]


def test_a_peer_is_read_from_the_seeds_that_ran_it_and_says_how_many(tmp_path):
    alone = _report(BEHAVIOUR_VERSION)  # a seed that ran the hybrid alone beside the Trainers
    for arm in ("prodigy", "mechanic", "sf"):
        del alone[arm]
    alone["update_speedups"] = [3.1]
    (tmp_path / "lora8-docs-linear-user-seed0.json").write_text(json.dumps(_report(BEHAVIOUR_VERSION)))
    (tmp_path / "lora8-docs-linear-user-seed1.json").write_text(json.dumps(alone))
    [row] = render_readme.rows(tmp_path)
    assert row.cells[2:4] == ["**2.10x (2.20x), 4.800**", "Prodigy: 1.40x, 5.200 (1 of 2 seeds)"]


def test_the_never_worse_cell_needs_a_current_check_beside_any_plain_trainer_sweep(tmp_path):
    name = "lora8-docs-linear"
    (tmp_path / f"{name}-user-seed0.json").write_text(json.dumps(_report(BEHAVIOUR_VERSION)))
    sweep = {"arm": "baseline", "runs": [{"learning_rate": lr, "final_eval_loss": loss}
                                         for lr, loss in ((3e-4, 5.5), (3e-3, 4.7))]}  # no environment: older
    (tmp_path / f"{name}-sweep-seed0.json").write_text(json.dumps(sweep))
    check = {"arm": "hybrid", "runs": [{"learning_rate": 3e-4, "final_eval_loss": 4.8},
                                       {"learning_rate": 3e-3, "final_eval_loss": 4.75}],
             "environment": {"behaviour_version": BEHAVIOUR_VERSION}}
    (tmp_path / f"{name}-hybrid-seed0.json").write_text(json.dumps(check))
    [row] = render_readme.rows(tmp_path)
    assert row.cells[-1] == "+0.050 at 3e-3 (of 2 runs)"
    # Another seed, against its own Trainer: the worst over both seeds.
    (tmp_path / f"{name}-sweep-seed1.json").write_text(json.dumps(
        {"arm": "baseline", "runs": [{"learning_rate": 1e-3, "final_eval_loss": 4.9}]}))
    (tmp_path / f"{name}-hybrid-seed1.json").write_text(json.dumps(
        {**check, "runs": [{"learning_rate": 1e-3, "final_eval_loss": 4.97}]}))
    [row] = render_readme.rows(tmp_path)
    assert row.cells[-1] == "+0.070 at 1e-3 (of 3 runs, 2 seeds)"
    check["environment"]["behaviour_version"] = BEHAVIOUR_VERSION - 1
    (tmp_path / f"{name}-hybrid-seed0.json").write_text(json.dumps(check))
    [row] = render_readme.rows(tmp_path)
    assert row.cells[-1] == render_readme.NOT_MEASURED
