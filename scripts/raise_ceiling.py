"""The most a raise can recover once it is allowed to start (issue 49): G for an oracle that knows the swept LR and
switches the user's schedule to it, all at once, at a given step. No raise of the autopilot starts in the schedule's
warmup or the FIRST_DESCENT_STEPS after it, and the first needs two readings READ_EVERY steps apart, so what an oracle
switched there recovers bounds what any rule of readings can recover in that setting.

    python scripts/raise_ceiling.py --settings finetune-docs-linear,finetune-docs-constant-batch16 --at 10,16 \
        --scale 32 --out docs/reports/issue49-raise-ceiling-finetunes-32x.json

Per setting (its run at the user's LR in docs/survey/, `NAME-user-seedS.json` for `--seed S`, gives the user's and
the swept LR and the two Trainers' evaluations, early ones included): the plain Trainer at the user's LR, its
schedule's base LRs multiplied by swept / user (or `--scale`) at each `--at` step (default: where the first raise may
start, and one reading later), evaluated where that report's runs were; G in updates as survey.py computes it, to the
user-LR Trainer's final loss.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from arms import early_evaluations
from model_and_data import build_model_and_data, plain_training_args
from presets import PRESETS
from report import UPDATES, time_to

from hf_hybrid.autopilot.runner import FIRST_DESCENT_STEPS, READ_EVERY


def switched_run(preset: dict, user: float, scale: float, at: int, out_dir: str, seed: int = 0) -> list[list[float]]:
    """The Trainer at `user`, its schedule scaled by `scale` from step `at` on: its evaluations as the benchmark
    records them ([step, seconds, loss, updates])."""
    from transformers import Trainer, TrainerCallback

    model, datasets, eval_set = build_model_and_data(preset, seed)
    args = plain_training_args(preset, user, out_dir, seed=seed, eval_strategy="steps", eval_steps=preset["eval_steps"],
                               per_device_eval_batch_size=max(preset["batch_size"], 16), eval_on_start=True)
    evals: list[list[float]] = []

    class Switch(TrainerCallback):
        def on_step_end(self, args_, state, control, optimizer=None, lr_scheduler=None, **kwargs):
            if state.global_step == at:
                scheduler = getattr(lr_scheduler, "scheduler", lr_scheduler)
                scheduler.base_lrs = [lr * scale for lr in scheduler.base_lrs]
                for group in optimizer.param_groups:
                    group["lr"] *= scale

        def on_evaluate(self, args_, state, control, metrics=None, **kwargs):
            evals.append([state.global_step, 0.0, metrics["eval_loss"], state.global_step])

    trainer = Trainer(model=model, args=args, train_dataset=datasets["train"], eval_dataset=eval_set,
                      callbacks=[Switch()])
    trainer.add_callback(early_evaluations(trainer, preset["early_eval_steps"]))
    trainer.train()
    return evals


def g_in_updates(base: list, arm: list, best: list, target: float) -> float | None:
    base_t, arm_t, best_t = (time_to(e, target, UPDATES) for e in (base, arm, best))
    if arm_t is None:
        return 0.0
    return math.log(base_t / arm_t) / math.log(base_t / best_t)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", required=True,
                        help="comma-separated survey settings with a run at the user's LR in --reports")
    parser.add_argument("--at", default="", help="comma-separated steps (default: the first a raise may start "
                                                 "at, and one reading later)")
    parser.add_argument("--scale", type=float, default=0.0, help="the multiplier switched to (default: swept / user)")
    parser.add_argument("--reports", default=str(Path(__file__).resolve().parent.parent / "docs" / "survey"))
    parser.add_argument("--seed", type=int, default=0, help="the seed of the run at the user's LR read, and of the "
                                                                "switched Trainer's init and data order")
    parser.add_argument("--out", default="runs/raise-ceiling.json")
    args = parser.parse_args()
    rows = []
    for name in args.settings.split(","):
        preset = PRESETS[f"survey-{name}"]
        report = json.loads((Path(args.reports) / f"{name}-user-seed{args.seed}.json").read_text())
        user, swept = report["learning_rate"], report["swept_learning_rate"]
        base, best = report["baseline"][0]["evals"], report["swept"][0]["evals"]
        target = report["target_eval_loss"]
        scale = args.scale or swept / user
        first = preset["warmup_steps"] + FIRST_DESCENT_STEPS
        for at in [int(a) for a in args.at.split(",")] if args.at else [first, first + READ_EVERY]:
            evals = switched_run(preset, user, scale, at, f"runs/raise-ceiling/{name}-{at}", args.seed)
            row = {"setting": name, "seed": args.seed, "half": preset["half"], "learning_rate": user,
                   "swept_learning_rate": swept,
                   "scale": scale, "switched_at": at, "target": target,
                   "g_updates": g_in_updates(base, evals, best, target),
                   "updates_to_target": time_to(evals, target, UPDATES), "final_eval_loss": evals[-1][2],
                   "evals": evals}
            rows.append(row)
            print(f"{name}: switched to {user * scale:g} at step {at}: G in updates {row['g_updates']:.2f}, "
                  f"{row['updates_to_target']} updates to {target:.4f}, final {row['final_eval_loss']:.4f}",
                  flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"command": "python scripts/raise_ceiling.py " + " ".join(
        f"--{k} {v}" for k, v in vars(args).items() if k != "reports" and v), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
