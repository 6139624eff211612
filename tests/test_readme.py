"""README.md is the front door: short, its first screen what a newcomer needs, and its results what
scripts/render_readme.py renders now from the reports kept in docs/survey/ (a summary by kind of run; every setting in
docs/results.md), with no number from a report measured before the library's current behaviour
(hf_hybrid.BEHAVIOUR_VERSION). No training, no network."""

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
import results_table  # noqa: E402

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


@pytest.mark.parametrize("path", [render_readme.README, render_readme.RESULTS], ids=lambda p: p.name)
def test_the_results_are_what_the_reports_render_now(path):
    assert render_readme.matches(path), "python scripts/render_readme.py --write"


def test_every_number_in_the_results_comes_from_a_current_report():
    rows = results_table.rows()
    measured = {path.name.split("-user-")[0] for path in results_table.SURVEY.glob("*-user-seed*.json")}
    settings = results_table.survey_settings({})
    assert len(rows) == len(measured & set(settings)), "a setting left out"
    held_out = sum(settings[name]["half"] != "tune" for name in measured)
    summary = render_readme.summary_rows()
    assert summary[-1].cells[:2] == ["all", f"{len(rows)} ({held_out})"]
    assert set(summary[-1].sources) == {path for row in rows for path in row.sources}
    for row in rows:
        assert all(len(cell) <= 100 for cell in row.cells), row.cells
        for path in row.sources:
            report = json.loads(path.read_text())
            plain_trainer_sweep = report.get("arm") == "baseline"  # no library change moves it
            assert plain_trainer_sweep or report["environment"]["behaviour_version"] == BEHAVIOUR_VERSION, path
            if "-user-" in path.name:  # timed with the early evaluations, as the setting is now
                assert report["preset_settings"]["early_eval_steps"] > 0, path
        if not row.sources:  # nothing current behind it: the row says so, with no number
            assert results_table.NOT_MEASURED in row.cells and not re.search(r"[0-9]", " ".join(row.cells[1:]))


@pytest.mark.parametrize("path", [render_readme.README, render_readme.RESULTS], ids=lambda p: p.name)
def test_a_hand_edited_number_fails_the_check(tmp_path, path):
    edited = tmp_path / path.name
    edited.write_text(path.read_text().replace(render_readme.START + "\n", render_readme.START + "\n| 1.23x |\n", 1))
    render = render_readme.BLOCKS[path]
    assert render_readme.matches(path) and not render_readme.matches(edited, render=render)


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
    [row] = results_table.rows(tmp_path)
    assert row.sources == [] and row.cells[1] == results_table.NOT_MEASURED
    assert "2.10x" not in results_table.render(tmp_path)


def test_a_report_evaluated_without_the_early_evaluations_renders_as_not_measured(tmp_path):
    report = _report(BEHAVIOUR_VERSION)
    del report["preset_settings"]["early_eval_steps"]  # its G had another resolution
    (tmp_path / "lora8-docs-linear-user-seed0.json").write_text(json.dumps(report))
    [row] = results_table.rows(tmp_path)
    assert row.sources == [] and row.cells[1] == results_table.NOT_MEASURED


def test_a_current_report_renders_its_numbers_with_the_best_peer(tmp_path):
    (tmp_path / "lora8-docs-linear-user-seed0.json").write_text(json.dumps(_report(BEHAVIOUR_VERSION)))
    (tmp_path / "lora8-docs-linear-user-seed1.json").write_text(json.dumps(_report(BEHAVIOUR_VERSION - 1)))
    [row] = results_table.rows(tmp_path)
    assert row.sources == [tmp_path / "lora8-docs-linear-user-seed0.json"]  # the older seed is left out
    assert row.cells == ["`lora8-docs-linear` (report): 3e-4 (3e-3)", "5.500; swept: 2.70x, 4.700",
                         "**2.10x (2.20x), 4.800**", "Prodigy: 1.40x, 5.200", results_table.NOT_MEASURED]


def test_a_peer_is_read_from_the_seeds_that_ran_it_and_says_how_many(tmp_path):
    alone = _report(BEHAVIOUR_VERSION)  # a seed that ran the hybrid alone beside the Trainers
    for arm in ("prodigy", "mechanic", "sf"):
        del alone[arm]
    alone["update_speedups"] = [3.1]
    (tmp_path / "lora8-docs-linear-user-seed0.json").write_text(json.dumps(_report(BEHAVIOUR_VERSION)))
    (tmp_path / "lora8-docs-linear-user-seed1.json").write_text(json.dumps(alone))
    [row] = results_table.rows(tmp_path)
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
    [row] = results_table.rows(tmp_path)
    assert row.cells[-1] == "+0.050 at 3e-3 (of 2 runs)"
    # Another seed, against its own Trainer: the worst over both seeds.
    (tmp_path / f"{name}-sweep-seed1.json").write_text(json.dumps(
        {"arm": "baseline", "runs": [{"learning_rate": 1e-3, "final_eval_loss": 4.9}]}))
    (tmp_path / f"{name}-hybrid-seed1.json").write_text(json.dumps(
        {**check, "runs": [{"learning_rate": 1e-3, "final_eval_loss": 4.97}]}))
    [row] = results_table.rows(tmp_path)
    assert row.cells[-1] == "+0.070 at 1e-3 (of 3 runs, 2 seeds)"
    check["environment"]["behaviour_version"] = BEHAVIOUR_VERSION - 1
    (tmp_path / f"{name}-hybrid-seed0.json").write_text(json.dumps(check))
    [row] = results_table.rows(tmp_path)
    assert row.cells[-1] == results_table.NOT_MEASURED


def _summed_report(version: int, speedup: float, g_hybrid: float, g_mechanic: float) -> dict:
    """`_report` with what `survey.py table` reads: each arm's G, and the two Trainers' updates to the target."""
    report = _report(version)
    report["update_speedups"] = [speedup]
    report["sweep_fraction"] = {arm: {"updates": [g], "wall": [g]} for arm, g in
                                (("hybrid", g_hybrid), ("mechanic", g_mechanic), ("prodigy", 0.1), ("sf", None))}
    report["baseline"][0]["updates_to_target"], report["swept"][0]["updates_to_target"] = 200, 50
    return report


def test_the_summary_adds_up_each_kind_of_run_from_its_current_reports(tmp_path):
    scratch, lora = "scratch-2x128-shakespeare-linear", "lora8-docs-linear"
    (tmp_path / f"{scratch}-user-seed0.json").write_text(json.dumps(_summed_report(BEHAVIOUR_VERSION, 2.1, 0.5, 0.9)))
    (tmp_path / f"{lora}-user-seed0.json").write_text(json.dumps(_summed_report(BEHAVIOUR_VERSION, 3.1, 0.8, 0.6)))
    # An older seed counts nowhere, whatever it says.
    (tmp_path / f"{lora}-user-seed1.json").write_text(json.dumps(_summed_report(BEHAVIOUR_VERSION - 1, 9.9, 0.0, 0.9)))
    sweep = {"arm": "baseline", "runs": [{"learning_rate": 3e-4, "final_eval_loss": 5.5},
                                         {"learning_rate": 3e-3, "final_eval_loss": 4.7}]}
    check = {"arm": "hybrid", "runs": [{"learning_rate": 3e-4, "final_eval_loss": 4.8},
                                       {"learning_rate": 3e-3, "final_eval_loss": 4.75}],
             "environment": {"behaviour_version": BEHAVIOUR_VERSION}}
    (tmp_path / f"{lora}-sweep-seed0.json").write_text(json.dumps(sweep))
    (tmp_path / f"{lora}-hybrid-seed0.json").write_text(json.dumps(check))
    rows = render_readme.summary_rows(tmp_path)
    assert [row.cells for row in rows] == [
        ["from scratch", "1 (1)", "2.1x (2.2x)", "2.7x", "0.50/0.50", "0 of 1; 1 of 1", "-"],
        ["LoRA", "1 (1)", "3.1x (2.2x)", "2.7x", "0.80/0.80", "1 of 1; 1 of 1", "+0.050 (2)"],
        ["all", "2 (2)", "2.6x (2.2x); 2.1-3.1x", "2.7x", "0.65/0.65", "1 of 2; 2 of 2", "+0.050 (2)"],
    ]
    assert tmp_path / f"{lora}-user-seed1.json" not in rows[-1].sources
    rendered = render_readme.render_summary(tmp_path)
    assert rendered.count("\n| ") == 4  # the header and its three rows, below the terms
    assert "small GPT-2s (2 layers; " in rendered and "300 updates, 1 seed. " in rendered  # the caption's scope
    assert rendered.startswith("Each setting trains at the LR a user types, 10x below its swept LR")  # the terms first
