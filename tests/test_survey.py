"""The LR autopilot's survey runner end to end on one setting at a few steps: the split is fixed, the sweep picks the
swept LR, the arms run at a tenth of it from scratch, the never-worse check compares the hybrid with the Trainer at
the same LR, and the table reads G from the reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))
from survey_settings import FINETUNE_LR, survey_settings  # noqa: E402


def test_the_split_is_fixed_and_covers_what_matters_to_a_learning_rate():
    found = survey_settings({"pretrained": "x"})
    halves = {half: [n for n, s in found.items() if s["half"] == half] for half in ("tune", "report", "fresh")}
    assert len(halves["tune"]) == len(halves["report"]) == 6 and len(halves["fresh"]) == 10
    assert {s["model"].get("architecture", "gpt2") for s in found.values() if "model" in s} == {"gpt2", "llama"}
    for half in (halves["tune"], halves["report"]):  # each half holds runs from scratch, full fine-tunes and LoRA
        assert {n.split("-")[0].rstrip("0123456789") for n in half} == {"scratch", "finetune", "lora"}
    schedules = {s["scheduler"] for s in found.values()}
    assert schedules == {"linear", "cosine", "constant_with_warmup", "warmup_stable_decay"}
    assert {s["user_lr"] for s in found.values() if "pretrained" in s} == {FINETUNE_LR}


def test_g_on_the_swept_path_late_falls_with_the_delay_and_inverts():
    import survey as runner

    assert runner.late_g(300, 10, 0) == pytest.approx(1.0)  # the swept Trainer itself
    assert runner.late_g(300, 10, 290) == pytest.approx(0.0)  # as late as the Trainer at the user's LR
    # lora8-docs-linear's Trainers (300 and 4.9 updates): G 0.9 allows 2.5 updates late; 10 late gives 0.73.
    assert runner.late_for(0.9, 300, 4.9) == pytest.approx(2.5, abs=0.05)
    assert runner.late_g(300, 4.9, runner.late_for(0.9, 300, 4.9)) == pytest.approx(0.9)
    assert runner.late_g(300, 4.9, 10) == pytest.approx(0.73, abs=0.005)


def survey(*args: str) -> str:
    done = subprocess.run([sys.executable, str(SCRIPTS / "survey.py"), *args], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_a_setting_is_swept_then_run_at_a_tenth_of_its_swept_lr(tmp_path):
    where = ["--reports", str(tmp_path / "reports"), "--work", str(tmp_path / "work"), "--max_steps", "8"]
    name = "scratch-2x64-shakespeare-cosine"
    survey("sweep", name, "--learning_rates", "1e-4,1e-2", *where)
    survey("sweep", name, "--learning_rates", "1e-3", *where)  # one more LR joins the kept sweep
    kept = json.loads((tmp_path / "reports" / f"{name}-sweep-seed0.json").read_text())
    assert [r["learning_rate"] for r in kept["runs"]] == [1e-4, 1e-3, 1e-2]
    swept = kept["best_learning_rate"]
    assert swept == min(kept["runs"], key=lambda r: r["final_eval_loss"])["learning_rate"]
    survey("run", name, *where)
    report = json.loads((tmp_path / "reports" / f"{name}-user-seed0.json").read_text())
    assert report["learning_rate"] == pytest.approx(swept / 10) and report["swept_learning_rate"] == swept
    assert {"hybrid", "prodigy", "mechanic", "sf"} <= set(report["sweep_fraction"])
    # Every arm is evaluated at the start and every early_eval_steps (3) updates before the first eval_steps (30).
    assert [e[0] for e in report["baseline"][0]["evals"]] == [0, 3, 6, 8]
    assert [e[0] for e in report["swept"][0]["evals"]][:3] == [0, 3, 6]
    # The never-worse check: the hybrid alone at an LR the sweep ran; in 8 steps it raises nothing and jumps nowhere,
    # so it must end exactly where the Trainer did.
    checked = survey("check", name, "--learning_rates", f"{swept:g}", *where)
    hybrid = json.loads((tmp_path / "reports" / f"{name}-hybrid-seed0.json").read_text())
    assert [r["learning_rate"] for r in hybrid["runs"]] == [swept] and hybrid["arm"] == "hybrid"
    assert hybrid["runs"][0]["hybrid_stats"]["lr_scale"] == 1.0 and "difference +0.0000" in checked
    # What the readings cost there, in forwards of a micro-batch: 3 a reading and 1 a judged raise, over 3 an update's
    # micro-batch. (The 8-step run read nothing; the counts of a longer one are put in its place.)
    hybrid["runs"][0]["hybrid_stats"].update(lr_readings=6, backward_steps=200, lr_raises_kept=1, lr_trials_undone=1)
    (tmp_path / "reports" / f"{name}-hybrid-seed0.json").write_text(json.dumps(hybrid))
    cost = survey("readings", "--half", "all", *where[:4])
    assert f"{name}" in cost and "updates  200 x 1 micro-batches, readings  6, raises judged 2: 3.3%" in cost
    # Another seed: its own Trainer at the LR checked, against which its hybrid is judged; seed 0's reports stay.
    survey("sweep", name, "--seed", "1", "--learning_rates", f"{swept:g}", *where)
    checked = survey("check", name, "--seed", "1", "--learning_rates", f"{swept:g}", *where)
    seed1 = {arm: json.loads((tmp_path / "reports" / f"{name}-{arm}-seed1.json").read_text())
             for arm in ("sweep", "hybrid")}
    seed0_there = next(r for r in kept["runs"] if r["learning_rate"] == swept)
    assert seed1["sweep"]["runs"][0]["final_eval_loss"] != seed0_there["final_eval_loss"]  # another init
    assert seed1["hybrid"]["runs"][0]["final_eval_loss"] == seed1["sweep"]["runs"][0]["final_eval_loss"]
    assert "difference +0.0000" in checked
    out = survey("table", "--half", "all", "--json", str(tmp_path / "table.json"), *where[:4])
    rows = json.loads((tmp_path / "table.json").read_text())
    assert [row["setting"] for row in rows] == [name] and name in out
    # A report evaluated without the early evaluations no longer counts: its G had another resolution.
    path = tmp_path / "reports" / f"{name}-user-seed0.json"
    report["preset_settings"].pop("early_eval_steps")
    path.write_text(json.dumps(report))
    survey("table", "--half", "all", "--json", str(tmp_path / "table.json"), *where[:4])
    assert json.loads((tmp_path / "table.json").read_text()) == []


def test_only_reports_whose_hybrid_runs_cannot_have_been_held_in_the_first_descent_or_were_measured_again_are_carried(
        tmp_path):
    import carry_reports

    def write(name: str, report: dict) -> Path:
        (tmp_path / name).write_text(json.dumps(report))
        return tmp_path / name

    def stats(alignment: float | None, kept: int = 1, scale: float = 2.0) -> dict:
        return {"hybrid_stats": {"lr_start_alignment": alignment, "lr_raises_kept": kept, "lr_trials_undone": 0,
                                 "lr_lowered": 0, "lr_scale": scale}}

    old_version, new_version = carry_reports.FROM[-1], carry_reports.TO
    old = {"behaviour_version": old_version, "behaviour_carried": {"from": old_version - 1}}

    def user(name: str, run: dict, warmup: int) -> Path:
        return write(name, {"learning_rate": 1e-4, "environment": dict(old),
                            "preset_settings": {"warmup_steps": warmup}, "hybrid": [run]})

    aligned = user("a-user-seed0.json", stats(0.11), warmup=0)
    unaligned = user("a-user-seed1.json", stats(0.03), warmup=0)
    opposed = user("b-user-seed0.json", stats(-0.01), warmup=0)
    long_warmup = user("b-user-seed1.json", stats(0.03), warmup=10)
    short_warmup = user("c-user-seed0.json", stats(0.03), warmup=5)
    not_recorded = user("c-user-seed1.json", stats(None, kept=0, scale=1.0), warmup=0)
    checked_again = write("a-hybrid-seed0.json", {"arm": "hybrid", "preset": "survey-classify-source-linear",
                                                  "environment": dict(old), "runs": [
        {"learning_rate": 1e-4, **stats(0.02), "environment": {"behaviour_version": new_version}},
        {"learning_rate": 1e-3, **stats(0.09)}]})
    stale = write("b-hybrid-seed0.json", {"arm": "hybrid", "preset": "survey-classify-source-linear",
                                          "environment": dict(old), "runs": [
        {"learning_rate": 1e-4, **stats(0.09)}, {"learning_rate": 1e-3, **stats(0.02)}]})
    sweep = write("a-sweep-seed0.json", {"arm": "baseline", "environment": dict(old), "runs": []})
    argv = sys.argv
    try:
        sys.argv = ["carry_reports.py", "--reports", str(tmp_path)]
        carry_reports.main()
    finally:
        sys.argv = argv
    paths = (aligned, unaligned, opposed, long_warmup, short_warmup, not_recorded, checked_again, stale, sweep)
    version = {p.name: json.loads(p.read_text())["environment"]["behaviour_version"] for p in paths}
    carried = {"a-user-seed0.json", "b-user-seed0.json", "b-user-seed1.json", "a-hybrid-seed0.json"}
    assert version == {p.name: new_version if p.name in carried else old_version for p in paths}
    record = json.loads(aligned.read_text())["environment"]["behaviour_carried"]
    assert record["from"] == old_version and record["earlier"] == {"from": old_version - 1}


def test_a_run_of_the_hybrid_alone_carries_the_peers_from_the_kept_report_and_says_so():
    from survey import carry_peers

    def arm(seconds: float) -> list[dict]:
        return [{"train_seconds": seconds}]

    kept = {"hybrid": arm(1.0), "prodigy": arm(2.0), "prodigy_speedups": [1.5], "prodigy_update_speedups": [1.4],
            "prodigy_learning_rate": 1.0, "sf": arm(3.0), "sf_learning_rate": 1e-3,
            "sweep_fraction": {"hybrid": {"updates": [0.7]}, "prodigy": {"updates": [0.5]}, "sf": {"updates": [0.0]}},
            "environment": {"behaviour_version": 5, "commit": "abc"}}
    new = {"hybrid": arm(9.0), "swept": arm(8.0), "sweep_fraction": {"hybrid": {"updates": [0.9]}},
           "environment": {"behaviour_version": 6}}
    other_schedule = dict(new, preset_settings={"eval_steps": 30, "early_eval_steps": 3})
    carry_peers(other_schedule, kept)
    assert "prodigy" not in other_schedule and "peers_carried" not in other_schedule["environment"]
    carry_peers(new, kept)
    assert new["hybrid"] == arm(9.0) and new["sweep_fraction"]["hybrid"] == {"updates": [0.9]}  # this run's own
    assert new["prodigy"] == arm(2.0) and new["prodigy_speedups"] == [1.5] and new["sf_learning_rate"] == 1e-3
    assert new["sweep_fraction"]["prodigy"] == {"updates": [0.5]} and "mechanic" not in new["sweep_fraction"]
    assert new["environment"]["peers_carried"] == {"arms": ["prodigy", "sf"], "behaviour_version": 5, "commit": "abc"}
