"""The A/B benchmark script end to end, on its seconds-long smoke preset (benchmarks are not tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "benchmark.py"


def run(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, str(SCRIPT), "--preset", "smoke", *args], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_benchmark_smoke_writes_report_and_plot(tmp_path):
    # 40 steps, not the preset's 12: the autopilot reads only where a raise could still be judged before the end.
    done = run("--repeats", "1", "--arms", "hybrid,ema", "--max_steps", "40", "--output_dir", str(tmp_path))
    root = tmp_path / "smoke-speed"
    report = json.loads((root / "report.json").read_text())
    baseline, hybrid = report["baseline"][0], report["hybrid"][0]
    assert baseline["steps"] == 40 and baseline["hybrid_stats"] is None
    assert report["target_eval_loss"] == baseline["final_eval_loss"]
    env = report["environment"]
    head = subprocess.run(["git", "-C", str(SCRIPT.parent), "rev-parse", "HEAD"], capture_output=True, text=True)
    assert env["commit"] == (head.stdout.strip() if head.returncode == 0 else "")
    assert env["torch"] == torch.__version__ and env["cpu_capability"] and env["device"] == (
        torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    stats = hybrid["hybrid_stats"]
    assert stats["predict_steps"] > 0 and set(stats["phase_steps"]) == {"warmup", "full", "predict", "correct"}
    assert set(baseline["timing"]) == {"forward", "backward", "optimizer"}
    assert len(report["speedups"]) == len(report["update_speedups"]) == 1
    assert "time-to-target speedup" in done.stdout and "backward reduction" in done.stdout
    assert f"{stats['lr_readings']} readings" in done.stdout
    # The readings' own clock, so that what they cost on a GPU is measured in an A/B run, not inferred.
    assert stats["lr_readings"] > 0 and hybrid["timing"]["lr_readings"] > 0
    assert "lr autopilot readings, verdicts and undos" in done.stdout
    # The hybrid arm's end line about the learning rate, as a user's own run shows it.
    assert any(line.startswith("  hf_hybrid: ") and "learning rate" in line for line in done.stdout.splitlines())
    # Updates spent, beside each eval: the Trainer's steps, and the hybrid's steps that ran a backward.
    assert [e[3] for e in baseline["evals"]] == [e[0] for e in baseline["evals"]]
    assert hybrid["evals"][-1][3] == stats["backward_steps"] < hybrid["evals"][-1][0]
    assert "in updates" in done.stdout
    assert (root / "eval_loss_vs_wallclock.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The averaging arm trains exactly as the baseline does, and is evaluated on its weights' average.
    ema = report["ema"][0]
    assert ema["steps"] == baseline["steps"] and len(ema["evals"]) == len(baseline["evals"])
    assert ema["final_eval_loss"] != baseline["final_eval_loss"]
    assert len(report["ema_speedups"]) == 1 and "weight average" in done.stdout


def test_sweep_runs_the_trainer_at_each_learning_rate(tmp_path):
    run("--mode", "sweep", "--learning_rates", "1e-4,3e-3", "--output_dir", str(tmp_path))
    sweep = json.loads((tmp_path / "smoke-sweep" / "sweep-baseline.json").read_text())
    finals = {row["learning_rate"]: row["final_eval_loss"] for row in sweep["runs"]}
    assert set(finals) == {1e-4, 3e-3} and finals[1e-4] != finals[3e-3]
    assert sweep["best_learning_rate"] == min(finals, key=finals.get)
    # Schedule-free AdamW's own sweep, for the sf-swept arm: another optimizer, so another loss at the same LR.
    run("--mode", "sweep", "--sweep_arm", "sf", "--learning_rates", "3e-3", "--output_dir", str(tmp_path))
    sf = json.loads((tmp_path / "smoke-sweep" / "sweep-sf.json").read_text())
    assert sf["arm"] == "sf" and sf["runs"][0]["final_eval_loss"] != finals[3e-3]


def test_the_unswept_regime_runs_every_arm_at_a_fifth_and_reports_both_targets(tmp_path):
    done = run("--repeats", "1", "--lr_scale", "0.2", "--arms", "hybrid,sf,swept", "--set", "hybrid_predictor=outer",
               "--output_dir", str(tmp_path))
    report = json.loads((tmp_path / "smoke-speed" / "report.json").read_text())
    assert report["learning_rate"] == 0.2 * 3e-3 and report["swept_learning_rate"] == 3e-3
    assert report["overrides"] == {"hybrid_predictor": "outer"}
    # The swept Trainer trains the same steps at five times the LR: another loss, and the second target.
    swept, baseline, sf = report["swept"][0], report["baseline"][0], report["sf"][0]
    assert report["swept_targets"] == [swept["final_eval_loss"]] != [baseline["final_eval_loss"]]
    assert report["swept_target_speedups"]["swept"] == [1.0]
    assert sf["steps"] == baseline["steps"] and sf["final_eval_loss"] != baseline["final_eval_loss"]
    assert "schedule-free AdamW" in done.stdout and "vs swept Trainer's loss" in done.stdout


def test_a_hybrid_that_never_predicts_is_reported_equal_to_the_trainer_bit_for_bit(tmp_path):
    """The guard alone on clean data changes no step: the report must say the pair trained the same weights, which
    is what makes it 1.00x whatever the clock says."""
    done = run("--repeats", "2", "--set", "hybrid_predict=false", "--output_dir", str(tmp_path))
    report = json.loads((tmp_path / "smoke-speed" / "report.json").read_text())
    evaluations = len(report["baseline"][0]["evals"])
    assert evaluations >= 2 and report["equal_evals"] == [[evaluations, evaluations]] * 2
    assert report["update_speedups"] == [1.0, 1.0]
    assert f"bit for bit: {evaluations} of {evaluations}" in done.stdout
    # On a CPU every pair's Trainer ends alike, so the second pair runs the hybrid first, chasing the first's target.
    order = [line.split()[0] for line in done.stdout.splitlines() if line.endswith(" arm:")]
    assert order == ["baseline", "hybrid", "hybrid", "baseline"] and "not the" not in done.stdout, done.stdout


def test_the_overhead_mode_runs_both_arms_the_same_larger_steps(tmp_path):
    done = run("--mode", "overhead", "--repeats", "2", "--grad_accum", "2", "--max_steps", "8", "--output_dir",
               str(tmp_path))
    root = tmp_path / "smoke-overhead"
    report = json.loads((root / "report.json").read_text())
    assert report["preset_settings"]["grad_accum"] == 2 and report["preset_settings"]["max_steps"] == 8
    for arm in ("baseline", "hybrid"):
        result = json.loads((root / f"{arm}-0" / "arm_result.json").read_text())
        assert result["steps"] == 8 and result["tokens"] == 8 * 4 * 2 * 32  # steps x batch x accumulation x block
    assert len(report["step_time_ratios"]) == 2 and "median real-step time" in done.stdout
    # The second pair runs the hybrid first: a machine that runs the second of two processes faster favours neither.
    order = [line.split()[0] for line in done.stdout.splitlines() if line.endswith(" arm:")]
    assert order == ["baseline", "hybrid", "hybrid", "baseline"], order
    # The per-step hook clock is aligned with the steps and adds up to the run's totals of the clocks it splits.
    hybrid = json.loads((root / "hybrid-0" / "arm_result.json").read_text())
    clocks = sum(hybrid["timing"].get(k, 0.0) for k in ("hybrid_hooks_real", "hybrid_hooks_predict", "guard"))
    assert len(hybrid["hook_seconds"]) == 8 and all(s > 0 for s in hybrid["hook_seconds"])
    assert abs(sum(hybrid["hook_seconds"]) - clocks) < 1e-9
    assert "hooks and guard on the median real step" in done.stdout


def test_a_jumps_cost_leaves_out_the_first_which_allocates(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    from report import jump_cost

    phases = ["full", "predict", "full", "full", "predict", "full", "predict", "full"]
    seconds = [0.05, 0.95, 0.07, 0.05, 0.074, 0.075, 0.072, 0.08]
    cost = jump_cost(seconds, phases)
    assert cost["predicted"] == 3 and cost["first"] == 0.95
    assert abs(cost["median"] - 0.073) < 1e-12  # the two after the first; with it the median would be 0.074
    assert cost["next_median"] == 0.075
    assert jump_cost([0.05, 0.05], ["full", "full"]) is None


def test_a_run_cut_off_after_a_pair_keeps_that_pairs_report(tmp_path, monkeypatch):
    """The report is rewritten after every pair: a run stopped in its second pair (a GPU part's time limit) keeps the
    first pair's report."""
    sys.path.insert(0, str(SCRIPT.parent))
    import benchmark

    class CutOff(Exception):
        pass

    launched = []

    def launch(*args, **kwargs):
        if len(launched) == 2:
            raise CutOff
        launched.append(args[0])
        return real_launch(*args, **kwargs)

    real_launch = benchmark.launch
    monkeypatch.setattr(benchmark, "launch", launch)
    monkeypatch.setattr(sys, "argv", ["benchmark.py", "--preset", "smoke", "--mode", "overhead", "--repeats", "3",
                                      "--max_steps", "8", "--output_dir", str(tmp_path)])
    try:
        benchmark.main()
    except CutOff:
        pass
    report = json.loads((tmp_path / "smoke-overhead" / "report.json").read_text())
    assert launched == ["baseline", "hybrid"]
    assert report["repeats"] == 1 and len(report["baseline"]) == len(report["hybrid"]) == 1
    assert len(report["step_time_ratios"]) == 1


def test_a_peer_that_fails_is_named_and_a_part_cut_off_keeps_the_arms_it_ran(tmp_path, monkeypatch, capsys):
    """A GPU part runs its arms once each under a time limit: the report is rewritten after every arm, so one cut off
    keeps the arms it ran and names those it did not; the swept Trainer and the hybrid run before the other peers; and
    a peer whose optimizer does not import fails its own arm alone."""
    sys.path.insert(0, str(SCRIPT.parent))
    import benchmark
    import gpu_summary

    shadow = tmp_path / "shadow"
    (shadow / "prodigyopt").mkdir(parents=True)
    (shadow / "prodigyopt" / "__init__.py").write_text("raise ImportError('prodigyopt is shadowed for this test')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(shadow), os.environ.get("PYTHONPATH")])))

    class CutOff(Exception):
        pass

    launched = []

    def launch(*args, **kwargs):
        launched.append(args[0])
        if args[0] == "mechanic":
            raise CutOff
        return real_launch(*args, **kwargs)

    real_launch = benchmark.launch
    monkeypatch.setattr(benchmark, "launch", launch)
    work = tmp_path / "work"  # the suite's layout: a folder per part, which gpu_summary reads
    monkeypatch.setattr(sys, "argv", ["benchmark.py", "--preset", "smoke", "--repeats", "1", "--max_steps", "8",
                                      "--lr_scale", "0.1", "--arms", "hybrid,mechanic,prodigy,swept",
                                      "--output_dir", str(work / "scratch")])
    try:
        benchmark.main()
    except CutOff:
        pass
    assert launched == ["baseline", "swept", "hybrid", "prodigy", "mechanic"]
    report = json.loads((work / "scratch" / "smoke-speed" / "report.json").read_text())
    ran = [len(report.get(arm, [])) for arm in ("baseline", "swept", "hybrid", "prodigy", "mechanic")]
    assert ran == [1, 1, 1, 0, 0]
    assert report["failed_arms"] == {"prodigy": "ImportError: prodigyopt is shadowed for this test"}
    assert report["not_run"] == ["mechanic"]
    # G is read for the arms that ran, against the swept Trainer's loss.
    assert set(report["sweep_fraction"]) == {"hybrid", "swept"}
    assert report["sweep_fraction"]["swept"]["updates"] == [1.0]

    capsys.readouterr()
    monkeypatch.setattr(sys, "argv", ["gpu_summary.py", str(work)])
    gpu_summary.main()
    table = capsys.readouterr().out
    assert "Prodigy" in table and "failed: ImportError: prodigyopt is shadowed for this test" in table
    assert "not run (cut off by the part's limit, or after a failure): Mechanic" in table
    assert [line.split()[0] for line in table.splitlines()[2:5]] == ["Trainer", "HybridHFTrainer", "Trainer"]


def test_a_failed_hybrid_ends_the_benchmark_with_its_error_and_the_report_says_so(tmp_path, monkeypatch, capsys):
    """The Trainer's or the hybrid's failure still ends the benchmark with the arm's own error text, and the report
    written after it names the failure, not a cut-off, with the pairs asked beside the pairs run."""
    sys.path.insert(0, str(SCRIPT.parent))
    import benchmark
    import gpu_summary

    def launch(*args, **kwargs):
        if args[0] == "hybrid":
            raise benchmark.ArmFailed("hybrid", "Traceback (most recent call last):\nRuntimeError: out of memory\n")
        return real_launch(*args, **kwargs)

    real_launch = benchmark.launch
    monkeypatch.setattr(benchmark, "launch", launch)
    work = tmp_path / "work"
    monkeypatch.setattr(sys, "argv", ["benchmark.py", "--preset", "smoke", "--repeats", "2", "--max_steps", "8",
                                      "--output_dir", str(work / "cost")])
    try:
        benchmark.main()
    except SystemExit as ended:
        assert "the hybrid arm failed:" in str(ended.code) and "RuntimeError: out of memory" in str(ended.code)
    else:
        raise AssertionError("the benchmark went on past a failed hybrid arm")
    report = json.loads((work / "cost" / "smoke-speed" / "report.json").read_text())
    assert report["failed_arms"] == {"hybrid": "RuntimeError: out of memory"} and report["not_run"] == []
    assert (report["repeats"], report["pairs_asked"], report["hybrid"]) == (1, 2, [])

    capsys.readouterr()
    monkeypatch.setattr(sys, "argv", ["gpu_summary.py", str(work)])
    gpu_summary.main()
    table = capsys.readouterr().out
    assert "1 of 2 pairs" in table and "HybridHFTrainer" in table and "failed: RuntimeError: out of memory" in table
