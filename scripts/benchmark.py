"""A/B benchmark: the plain `Trainer` against `HybridHFTrainer`, by wall-clock time to the same eval loss.

    python scripts/benchmark.py --preset cpu-small            # the README's main job
    python scripts/benchmark.py --preset gpt2-124m            # on a GPU
    python scripts/benchmark.py --preset cpu-small --mode overhead   # the hybrid's per-step cost, hooks timed
    python scripts/benchmark.py --preset gpt2-124m --mode memory --max_steps 2000   # peak memory, forced prediction
    python scripts/benchmark.py --preset cpu-small --mode faults     # the guard against injected faults (faults.py)
    python scripts/benchmark.py --preset cpu-finetune --lr_scale 0.2 --arms hybrid,sf,sf-swept,swept   # unswept LR

Both arms share the model init, data order, seed and settings. Each arm runs in its own process (clean
timing and peak memory), arms alternate, and `--repeats` pairs are run; medians are reported. The
target is the baseline's final eval loss; the hybrid may run up to `--hybrid_budget` times the
baseline's steps to reach it. Training time excludes evaluation. Both arms are evaluated every `eval_steps`
applied updates (for the hybrid, predicted steps do not count). Writes JSON and a PNG to --output_dir.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from arms import ArmResult, arm_main
from arms import WeightAverage as WeightAverage  # re-exported: tests/test_weight_average.py imports it from here
from environment import environment
from presets import PEER_ARMS, PRESETS, TUNED_HOST_ALLOCATOR
from report import add_swept_target, equal_evals, plot, print_table, speedups, summarize, sweep_fraction


class ArmFailed(SystemExit):
    """An arm's process that ended in an error. A SystemExit, so that the Trainer's or the hybrid's failure ends the
    benchmark with the arm's own error text; a peer's is caught and recorded in the report."""

    def __init__(self, arm: str, stderr: str):
        lines = [line for line in stderr.splitlines() if line.strip()]
        self.reason = lines[-1] if lines else "no error text"
        super().__init__(f"benchmark: the {arm} arm failed:\n{stderr[-4000:]}")


def launch(arm: str, args, out_dir: Path, target: float | None, overrides: dict,
           learning_rate: float | None = None) -> ArmResult:
    # The memory mode needs no eval curve: one evaluation at the end keeps its long runs short.
    eval_at_end = args.mode == "memory"
    # Early evaluations time a target reached inside the first spacing; only the speed mode times one, and the other
    # modes stay comparable with their kept reports (an evaluation draws from the global RNG).
    early_evals = args.mode == "speed"
    # On a GPU, timing the hybrid's hooks synchronizes the device around each one, which the Trainer arm does not pay:
    # only the overhead mode, whose point is that share, times them there.
    spec = dict(arm=arm, preset=args.preset, seed=args.seed, budget=args.hybrid_budget, target=target,
                overrides=overrides, out_dir=str(out_dir), max_steps=args.max_steps, grad_accum=args.grad_accum,
                eval_at_end=eval_at_end, early_evals=early_evals,
                learning_rate=learning_rate or args.learning_rate, hook_clock_on_gpu=args.mode == "overhead",
                full_determinism=args.full_determinism, torch_compile=args.torch_compile)
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, __file__, "--_arm", json.dumps(spec)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           **TUNED_HOST_ALLOCATOR}
    if args.torch_compile:  # each arm compiles for itself, as a user's first run does: no graph cached by another arm
        env["TORCHINDUCTOR_CACHE_DIR"] = str(out_dir / "inductor-cache")
    print(f"{arm} arm:", flush=True)
    done = subprocess.run(cmd, env=env, stderr=subprocess.PIPE, text=True)  # its progress lines go to the screen
    if done.returncode != 0:
        raise ArmFailed(arm, done.stderr)
    for line in done.stderr.splitlines():  # the trainer's end lines, as a user's own run shows them
        if "hf_hybrid: " in line:
            print(f"  {line[line.index('hf_hybrid: '):]}", flush=True)
    return ArmResult(**json.loads((out_dir / "arm_result.json").read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu-small")
    parser.add_argument("--mode", choices=["speed", "overhead", "memory", "faults", "sweep"], default="speed",
                        help="speed: time to the baseline's eval loss; overhead: the same steps in both arms, the "
                             "hooks timed, the confidence gate shut (velocity and adam; outer's jumps keep their "
                             "schedule); memory: the same steps in both arms, the hybrid forced to predict as often "
                             "as it can, the autopilot off (CUDA peak memory curve, a jump's cost); faults: clean "
                             "Trainer, Trainer and hybrid with injected faults; sweep: the Trainer alone at each of "
                             "--learning_rates (the baseline's tuning)")
    parser.add_argument("--arms", default="baseline,hybrid",
                        help="speed mode: the arms after the baseline: hybrid, and from "
                             + "; ".join(f"{k} ({v})" for k, v in PEER_ARMS.items()))
    parser.add_argument("--learning_rate", type=float, default=0.0, help="override the preset's, in every arm")
    parser.add_argument("--lr_scale", type=float, default=1.0,
                        help="run every arm but swept and sf-swept at this fraction of the preset's swept learning "
                             "rate: 0.2 is the LR a user runs without a sweep")
    parser.add_argument("--swept_learning_rate", type=float, default=0.0,
                        help="the swept arm's learning rate and the one --lr_scale scales (default: the preset's)")
    parser.add_argument("--sf_learning_rate", type=float, default=0.0,
                        help="the sf-swept arm's learning rate (default: the preset's sf_learning_rate, from "
                             "schedule-free AdamW's own sweep, else its swept learning rate)")
    parser.add_argument("--learning_rates", default="", help="sweep mode: comma-separated learning rates")
    parser.add_argument("--sweep_arm", choices=["baseline", "sf", "hybrid"], default="baseline",
                        help="sweep mode: the arm swept: the Trainer, schedule-free AdamW (for --sf_learning_rate), "
                             "or the hybrid (with --set; the autopilot against the Trainer at each LR)")
    parser.add_argument("--faults", default="window,spike,nan",
                        help="faults mode: which faults to inject, from window, spike, nan")
    parser.add_argument("--repeats", type=int, default=2,
                        help="baseline/hybrid pairs; odd pairs run the hybrid first where no target or peer arm "
                             "stops them")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max_steps", type=int, default=0, help="override the preset's baseline steps")
    parser.add_argument("--grad_accum", type=int, default=0,
                        help="override the preset's gradient accumulation (not in the faults mode): larger steps, "
                             "against which the hybrid's per-step costs are measured (the autopilot's probe stays "
                             "one micro-batch)")
    parser.add_argument("--hybrid_budget", type=float, default=1.5,
                        help="the hybrid may run this many times the baseline's steps to reach the target")
    parser.add_argument("--set", nargs="*", default=[], metavar="FLAG=VALUE",
                        help="hybrid flag overrides, e.g. hybrid_predictor=adam hybrid_monitor_interval=4")
    parser.add_argument("--full_determinism", action="store_true",
                        help="every arm with TrainingArguments' full_determinism (and eager attention on a GPU), "
                             "where kernels otherwise differ run to run: a hybrid whose jumps were all rolled back can "
                             "then be checked bit for bit, and in the faults mode the faults and the guard are the "
                             "only difference between the arms")
    parser.add_argument("--torch_compile", action="store_true",
                        help="every arm with TrainingArguments' torch_compile (inductor), its compile time counted as "
                             "training time")
    parser.add_argument("--output_dir", default="runs/benchmark")
    parser.add_argument("--_arm", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._arm:
        return arm_main(args._arm)
    if args.mode == "faults":
        import faults

        return faults.main(args, dict(PRESETS[args.preset]))

    overrides = {}
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = json.loads(value) if value not in ("velocity", "adam", "outer") else value
    if args.mode == "overhead":
        overrides["hybrid_confidence_threshold"] = 1.0
    if args.mode == "memory":
        # The autopilot's readings would pass the turns (steps already long enough): memory mode wants the jumps.
        overrides.update(hybrid_confidence_threshold=0.0, hybrid_payoff_check=False, hybrid_lr_autopilot=False)
    root = Path(args.output_dir) / f"{args.preset}-{args.mode}"
    if args.mode == "sweep":
        return sweep(args, root, overrides)
    settings = {**PRESETS[args.preset], **{k: v for k, v in (("max_steps", args.max_steps),
                                                              ("grad_accum", args.grad_accum)) if v}}
    swept_lr = args.swept_learning_rate or PRESETS[args.preset]["learning_rate"]
    lr = args.learning_rate or swept_lr * args.lr_scale
    sf_swept_lr = args.sf_learning_rate or PRESETS[args.preset].get("sf_learning_rate", swept_lr)
    peer_lrs = {"ema": lr, "sf": lr, "sf-swept": sf_swept_lr, "swept": swept_lr, "prodigy": 1.0, "mechanic": 1.0}
    peers = {name: [] for name in PEER_ARMS if name in args.arms.split(",")}
    baselines, hybrids, failed = [], [], {}
    target, alternating = None, alternates(args, peers)
    for r in range(args.repeats):
        # Odd pairs run the hybrid first where they may, so that the machine's speed drifting across a pair falls on
        # each arm alike; it chases the previous pair's target, which `alternates` makes this pair's too. Otherwise the
        # Trainer runs first, then the swept Trainer (whose loss the hybrid may chase), the hybrid, and the other peers:
        # a run cut off by its time limit has run the arms that matter most.
        hybrid_first = r % 2 == 1 and alternating
        order = ["hybrid", "baseline"] if hybrid_first else [
            "baseline", *(["swept"] if "swept" in peers else []), "hybrid", *(n for n in peers if n != "swept")]
        order = [arm for arm in order if arm not in failed]
        for ran, arm in enumerate(order, 1):
            fatal = None
            try:
                if arm == "baseline":
                    base = launch("baseline", args, root / f"baseline-{r}", target=None, overrides={},
                                  learning_rate=lr)
                    if hybrid_first and args.mode == "speed" and base.evals[-1][2] != target:
                        print(f"[pair {r}] the Trainer ended at {base.evals[-1][2]:.6f}, not the {target:.6f} the "
                              "hybrid chased: this pair's time to target is read against its own Trainer's loss",
                              flush=True)
                    target = base.evals[-1][2]
                    baselines.append(base)
                elif arm == "hybrid":
                    # Outside the speed mode both arms run the same steps; in it the hybrid chases the target, or the
                    # swept Trainer's loss where that is lower.
                    swept = peers.get("swept", [])
                    chase = min(target, swept[-1].evals[-1][2]) if len(swept) == r + 1 else target
                    hyb = launch("hybrid", args, root / f"hybrid-{r}", target=chase if args.mode == "speed" else None,
                                 overrides=overrides, learning_rate=lr)
                    hybrids.append(hyb)
                else:
                    peers[arm].append(launch(arm, args, root / f"{arm}-{r}", target=None, overrides={},
                                             learning_rate=peer_lrs[arm]))
                    print(f"[pair {r}] {PEER_ARMS[arm]}: eval {peers[arm][-1].evals[-1][2]:.4f}", flush=True)
            except ArmFailed as failure:
                # A peer's optimizer that does not import fails its own arm alone; the Trainer's or the hybrid's
                # failure ends the benchmark, its report saying so rather than leaving the arm as not yet run.
                failed[arm] = failure.reason
                print(f"[pair {r}] the {arm} arm failed: {failure.reason}", flush=True)
                fatal = failure if arm in ("baseline", "hybrid") else None
            if len(baselines) == r + 1:  # a hybrid run first waits for its pair's target
                report = write_report(args, root, settings, overrides, lr, swept_lr, peer_lrs, baselines, hybrids,
                                      peers, failed, not_run=order[ran:])
            if fatal is not None:
                raise fatal
        print(f"[pair {r}] baseline {base.train_seconds:.1f}s eval {target:.4f} | hybrid {hyb.train_seconds:.1f}s "
              f"eval {hyb.evals[-1][2]:.4f} reached={hyb.reached_step}", flush=True)
    print_table(report)
    plot(root, baselines[0], hybrids[0], target)


def write_report(args, root: Path, settings: dict, overrides: dict, lr: float, swept_lr: float, peer_lrs: dict,
                 baselines: list, hybrids: list, peers: dict, failed: dict, not_run: list) -> dict:
    """The report of the arms run so far, rewritten after each: a run cut off by its time limit keeps what it ran, and
    names the arms of its last pair that it did not (`not_run`) and those that failed (`failed_arms`)."""
    # Each pair has its own target, its baseline's final eval loss: on a GPU, runs with the same seed still differ
    # in the last digits (non-deterministic kernels), so one pair's target is not another's.
    targets = [b.evals[-1][2] for b in baselines]
    report = {"preset": args.preset, "mode": args.mode, "repeats": len(baselines), "target_eval_loss": targets[0],
              "targets": targets, "overrides": overrides, "preset_settings": settings,
              "learning_rate": lr, "lr_scale": args.lr_scale, "swept_learning_rate": swept_lr,
              "baseline": [summarize(b, t) for b, t in zip(baselines, targets)],
              "hybrid": [summarize(h, t) for h, t in zip(hybrids, targets)],
              "environment": environment(device=baselines[0].device), "pairs_asked": args.repeats,
              "failed_arms": failed, "not_run": not_run}
    for name, results in ((n, r) for n, r in peers.items() if r):
        report[name] = [summarize(a, t) for a, t in zip(results, targets)]
        report[f"{name}_speedups"] = speedups(report, name)
        report[f"{name}_update_speedups"] = speedups(report, name, "updates_to_target")
        report[f"{name}_learning_rate"] = peer_lrs[name]
    if peers.get("swept"):
        ran = [arm for arm in ("hybrid", *peers) if arm in report]
        add_swept_target(report, [s.evals[-1][2] for s in peers["swept"]], ["baseline", *ran])
        report["sweep_fraction"] = {arm: sweep_fraction(report, arm) for arm in ran}
    if args.mode == "memory":
        report["memory_curves"] = {"baseline": [b.memory_curve for b in baselines],
                                   "hybrid": [h.memory_curve for h in hybrids]}
    if args.mode == "overhead":
        ratios = [h["median_real_step_seconds"] / b["median_real_step_seconds"]
                  for b, h in zip(report["baseline"], report["hybrid"])]
        report["step_time_ratio_median"] = statistics.median(ratios) if ratios else None
        report["step_time_ratios"] = ratios
    else:
        report["speedups"] = speedups(report, "hybrid")
        report["update_speedups"] = speedups(report, "hybrid", "updates_to_target")
        report["equal_evals"] = [equal_evals(b, h) for b, h in zip(report["baseline"], report["hybrid"])]
        reached = [s for s in report["speedups"] if s is not None]
        report["speedup_median"] = statistics.median(reached) if reached and len(reached) == len(
            report["speedups"]) else None
    (root / "report.json").write_text(json.dumps(report, indent=2))
    return report


def alternates(args, peers: dict) -> bool:
    """Whether odd pairs run the hybrid before the Trainer: where the hybrid needs no target, or where it needs the
    Trainer's final loss and every pair's Trainer ends bit for bit alike (on a CPU, and under `--full_determinism`),
    so the previous pair's serves. With peer arms, or a target a GPU's kernels move in the last digits, the Trainer
    runs first every time."""
    import torch

    return not peers and (args.mode != "speed" or args.full_determinism or not torch.cuda.is_available())


def sweep(args, root: Path, overrides: dict) -> None:
    """One arm alone at each learning rate: the baseline's tuning, recorded before any A/B, schedule-free AdamW's, or
    the hybrid's final loss at each (is it ever worse than the Trainer at the same LR?)."""
    rows = []
    for lr in (float(x) for x in args.learning_rates.split(",")):
        arm = launch(args.sweep_arm, args, root / f"{args.sweep_arm}-lr-{lr:g}", target=None,
                     overrides=overrides if args.sweep_arm == "hybrid" else {}, learning_rate=lr)
        rows.append({"learning_rate": lr, "final_eval_loss": arm.evals[-1][2], "best_eval_loss": min(
            e[2] for e in arm.evals), "train_seconds": arm.train_seconds, "evals": arm.evals,
                     "hybrid_stats": arm.hybrid_stats})
    best = min(rows, key=lambda row: row["final_eval_loss"])
    out = root / f"sweep-{args.sweep_arm}.json"
    out.write_text(json.dumps({"preset": args.preset, "seed": args.seed, "arm": args.sweep_arm, "runs": rows,
                               "best_learning_rate": best["learning_rate"],
                               "environment": environment(device=arm.device)}, indent=2))
    print(f"\n{args.preset} learning-rate sweep of the {args.sweep_arm} arm, seed {args.seed} (final eval loss):")
    for row in rows:
        print(f"  lr {row['learning_rate']:<8g} {row['final_eval_loss']:.4f}{'  <- best' if row is best else ''}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
