"""The demo, `make demo`: the product in under 3 minutes on 2 CPU cores, ending on one summary screen.

1. The guard saving a run: the Trainer with injected faults (a window of random-label batches, a 100x learning-rate
   spike, a NaN loss) against HybridHFTrainer with the same faults, and a clean Trainer as the reference.
2. Speed at the LR a user runs without a sweep: the Trainer against HybridHFTrainer with its defaults (the LR
   autopilot, and jumps where they pay), both at one fifth of the preset's swept learning rate, timed to the Trainer's
   final eval loss; the swept-LR result is quoted beside it from its recorded report.

Everything runs in this process on one tokenized copy of the shipped corpus; reports and plots go to --output_dir:
    python scripts/demo.py                 # the demo preset
    python scripts/demo.py --preset smoke  # seconds, for the test
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from presets import DEMO_SWEPT_REPORT, PRESETS, TUNED_HOST_ALLOCATOR  # noqa: E402

if __name__ == "__main__" and any(os.environ.get(k) != v for k, v in TUNED_HOST_ALLOCATOR.items()):
    # glibc reads these at start-up only; as in the benchmark, they keep it from mapping and unmapping the large
    # gradient buffers every step (about 1.5x the step time here otherwise). Before the training stack is imported,
    # so that its several seconds of imports are paid once.
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **TUNED_HOST_ALLOCATOR})

import faults  # noqa: E402
from environment import environment  # noqa: E402
from model_and_data import build_model_and_data  # noqa: E402
from report import UPDATES, time_to  # noqa: E402
from results_table import NOT_MEASURED, rows  # noqa: E402
from survey_settings import at_current_version  # noqa: E402
from timing import spent_updates  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def quiet() -> None:
    """Only what the demo and hf_hybrid say: no progress bars from datasets, no notices from transformers."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def speed_arm(arm: str, preset: dict, learning_rate: float, seed: int, out_dir: Path, progress,
              target: float | None = None) -> dict:
    """One arm of the speed A/B: eval loss against training wall time (evaluation excluded). With `target`, the arm
    stops at the first evaluation that reaches it, as the benchmark's hybrid arm does: the time to it is the result,
    and the rest of the run would only make the user wait."""
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_callback import PrinterCallback

    from hf_hybrid import HybridHFTrainer, HybridTrainingArguments

    model, data, eval_set = build_model_and_data(preset, seed)
    common = dict(
        output_dir=str(out_dir), max_steps=preset["max_steps"], per_device_train_batch_size=preset["batch_size"],
        per_device_eval_batch_size=16, learning_rate=learning_rate, lr_scheduler_type="linear",
        warmup_steps=preset["warmup_steps"], weight_decay=preset["weight_decay"], eval_strategy="steps",
        eval_steps=preset["eval_steps"], logging_steps=10**6, save_strategy="no", report_to="none", seed=seed,
        data_seed=seed, disable_tqdm=True, use_cpu=True,
    )
    if arm == "hybrid":
        # The library's defaults, but for the preset's (a shorter Warmup phase, so that a 150-step run has jumps).
        trainer_cls, args = HybridHFTrainer, HybridTrainingArguments(**common, **preset["hybrid"])
    else:
        trainer_cls, args = Trainer, TrainingArguments(**common)
    evals: list[list[float]] = []

    class Clock(TrainerCallback):
        """Training time only: the clock stops while the Trainer evaluates. The hybrid evaluates on its counted
        steps, after as many of the Trainer's updates as the baseline (hf_hybrid/loop/step_veto.py); each evaluation
        also records the gradient updates spent so far."""

        def __init__(self) -> None:
            self.seconds, self.started = 0.0, None

        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds += time.perf_counter() - self.started
            if state.global_step % 10 == 0:
                progress(f"{arm}: step {state.global_step}/{state.max_steps}")

        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            evals.append([state.global_step, self.seconds, metrics["eval_loss"], spent_updates(trainer)])
            if target is not None and metrics["eval_loss"] <= target:
                control.should_training_stop = True

    trainer = trainer_cls(model=model, args=args, train_dataset=data["train"], eval_dataset=eval_set)
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(Clock())
    trainer.train()  # the Trainer evaluates at the last step too
    stats = trainer.hybrid_stats() if arm == "hybrid" else None
    return {"arm": arm, "learning_rate": learning_rate, "evals": evals, "final_eval_loss": evals[-1][2],
            "hybrid_stats": stats}


def run_faults(preset: dict, seed: int, out: Path) -> dict:
    preset = dict(preset, eval_steps=max(preset["max_steps"] // 6, 1))
    plan = faults.FaultPlan.for_run(preset["max_steps"], faults.ALL_FAULTS)
    # The Trainer with the faults is the clean Trainer until the first fault: it resumes from the clean run's
    # checkpoint there instead of training those steps again, and shares its evaluations up to it.
    start = plan.first_step
    arms = {"trainer-clean": faults.run_arm("trainer-clean", dict(preset), plan, seed, out / "trainer-clean",
                                            save_at=start)}
    print(f"  [ trainer-faults] resumes from the clean Trainer's checkpoint at step {start}, before the first fault",
          flush=True)
    faulted = faults.run_arm("trainer-faults", dict(preset), plan, seed, out / "trainer-faults",
                             resume_from=out / "trainer-clean" / f"checkpoint-{start}")
    shared = [e for e in arms["trainer-clean"]["evals"] if e[0] <= start]
    arms["trainer-faults"] = dict(faulted, evals=shared + faulted["evals"])
    shutil.rmtree(out / "trainer-clean" / f"checkpoint-{start}")  # served its one purpose; a user's disk is not ours
    arms["hybrid-faults"] = faults.run_arm("hybrid-faults", dict(preset), plan, seed, out / "hybrid-faults")
    clean = arms["trainer-clean"]["final_eval_loss"]
    report = {"seed": seed, "max_steps": preset["max_steps"], "faults": list(faults.ALL_FAULTS),
              "plan": plan.describe(), "arms": arms,
              "damage": {arm: r["final_eval_loss"] - clean for arm, r in arms.items() if arm != "trainer-clean"}}
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    faults.plot(out, report)
    return report


def run_speed(preset: dict, seed: int, out: Path, progress) -> dict:
    lr = preset["learning_rate"] * preset["demo_lr_scale"]
    arms = {"baseline": speed_arm("baseline", preset, lr, seed, out / "baseline", progress)}
    target = arms["baseline"]["final_eval_loss"]
    arms["hybrid"] = speed_arm("hybrid", preset, lr, seed, out / "hybrid", progress, target=target)
    times = {arm: time_to(r["evals"], target) for arm, r in arms.items()}
    updates = {arm: time_to(r["evals"], target, UPDATES) for arm, r in arms.items()}
    speedup = times["baseline"] / times["hybrid"] if times["hybrid"] else None
    update_speedup = updates["baseline"] / updates["hybrid"] if updates["hybrid"] else None
    report = {"seed": seed, "learning_rate": lr, "swept_learning_rate": preset["learning_rate"], "target": target,
              "time_to_target": times, "speedup": speedup, "updates_to_target": updates,
              "update_speedup": update_speedup, "arms": arms, "environment": environment(), "preset": preset}
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    return report


def _loss(value: float) -> str:
    return "NaN" if math.isnan(value) else f"{value:.3f}"


def _speedup(report: dict) -> str:
    """Wall clock to the Trainer's final loss, and updates beside it (absent from reports recorded before them)."""
    if report["speedup"] is None:
        return "not reached"
    if report.get("update_speedup") is None:
        return f"{report['speedup']:.2f}x"
    updates = report["updates_to_target"]
    return (f"{report['speedup']:.2f}x ({report['update_speedup']:.2f}x in updates: {updates['hybrid']:.0f} against "
            f"{updates['baseline']:.0f})")


def _damage(value: float) -> str:
    return "ruined: NaN" if math.isnan(value) else f"{value:+.3f} from the clean run"


def summary(faults_report: dict, speed: dict, swept: dict | None, out: Path, seconds: float) -> str:
    """The one screen the demo ends on."""
    arms, damage = faults_report["arms"], faults_report["damage"]
    guard = arms["hybrid-faults"]["hybrid_stats"]
    stats = speed["arms"]["hybrid"]["hybrid_stats"]
    times = speed["time_to_target"]
    result = _speedup(speed)
    lines = [
        f"hf_hybrid demo, {seconds / 60:.1f} min on this machine",
        "",
        f"GUARD   faults injected: {faults_report['plan']}",
        f"  Trainer, clean run               eval loss {_loss(arms['trainer-clean']['final_eval_loss'])}",
        f"  Trainer, with the faults         eval loss {_loss(arms['trainer-faults']['final_eval_loss'])}"
        f"   ({_damage(damage['trainer-faults'])})",
        f"  HybridHFTrainer, same faults     eval loss {_loss(arms['hybrid-faults']['final_eval_loss'])}"
        f"   ({_damage(damage['hybrid-faults'])})",
        f"  the guard flagged {guard['guard_outliers']} steps: {guard['skipped_steps']} skipped, "
        f"{guard['guard_rollbacks']} rolled back to a snapshot",
        "",
        f"SPEED   the LR a user runs without a sweep: {speed['learning_rate']:.2g}, 1/5 of the swept "
        f"{speed['swept_learning_rate']:.2g}; the hybrid with its defaults (the LR autopilot on)",
        f"  time to the Trainer's final eval loss ({speed['target']:.3f}): Trainer {times['baseline']:.1f} s, "
        f"HybridHFTrainer " + ("-" if times["hybrid"] is None else f"{times['hybrid']:.1f} s")
        + f": {result}",
        f"  {stats['predictions_kept']} of {stats['predictions_judged']} jumps kept, worth about "
        f"{stats['jump_worth_steps']:.0f} real steps" if stats["predictions_judged"] else "  no jump was judged",
    ]
    lr, even = speed["learning_rate"], stats["lr_raises_kept_even"]
    lines.append(f"  LR autopilot: {lr:.2g} -> {lr * stats['lr_scale']:.2g} ({stats['lr_scale']:.1f}x; raises: "
                 f"{stats['lr_raises_kept']} kept{f' ({even} on an even probe reading)' if even else ''}, "
                 f"{stats['lr_trials_undone']} undone)")
    if swept is not None:
        lines.append(f"  at the swept LR (recorded: {swept['path']}): {swept['result']}")
    if (finetune := recorded_finetune()) is not None:
        lines.append(f"  recorded, fine-tuning at 5e-5 ({finetune})")
    lines += [
        "",
        f"REPORTS {out / 'faults' / 'report.json'}, {out / 'speed' / 'report.json'}",
        f"PLOTS   {out / 'faults' / 'eval_loss_vs_step.png'}, {out / 'speed' / 'eval_loss_vs_wallclock.png'}",
    ]
    return "\n".join(lines)


def plot_speed(out: Path, speed: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for arm, style, label in (("baseline", "k-o", "Trainer"), ("hybrid", "C3-s", "HybridHFTrainer (defaults)")):
        evals = speed["arms"][arm]["evals"]
        ax.plot([e[1] for e in evals], [e[2] for e in evals], style, ms=3, label=label)
    ax.axhline(speed["target"], color="grey", ls="--", lw=1, label="target: the Trainer's final eval loss")
    ax.set_xlabel("training wall clock (s, evaluation excluded)")
    ax.set_ylabel("eval loss")
    ax.set_title(f"learning rate {speed['learning_rate']:.2g} (1/5 of the swept {speed['swept_learning_rate']:.2g})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "eval_loss_vs_wallclock.png", dpi=110)
    plt.close(fig)


def recorded_swept_result(preset_name: str) -> dict | None:
    """The speed A/B at the swept LR, as recorded by `python scripts/demo.py --lr_scale 1 --skip_faults`, where it
    was measured at the library's current behaviour version on the demo's current preset: else it is not quoted."""
    path = ROOT / DEMO_SWEPT_REPORT
    if preset_name != "demo" or not path.exists():
        return None
    report = json.loads(path.read_text())
    if not at_current_version(report) or report.get("preset") != dict(PRESETS["demo"], demo_lr_scale=1.0):
        return None
    losses = [[e[2] for e in report["arms"][arm]["evals"]] for arm in ("baseline", "hybrid")]
    if losses[0] == losses[1]:  # the same run: the clock's difference is noise, not speed
        result = f"1.00x, every evaluation bit for bit the Trainer's (the clock read {report['speedup']:.2f}x)"
        return {"path": DEMO_SWEPT_REPORT, "result": result}
    stats = report["arms"]["hybrid"]["hybrid_stats"]
    return {"path": DEMO_SWEPT_REPORT, "result": f"{_speedup(report)}; {stats['predictions_kept']} of "
            f"{stats['predictions_judged']} jumps kept, retired: {stats['retired']}"}


def recorded_finetune() -> str | None:
    """The survey's fine-tune at `TrainingArguments`' 5e-5 as docs/results.md's table renders it from its current
    reports (scripts/results_table.py), with those reports named; None where none is current."""
    for row in rows():
        if row.cells[0].startswith("`finetune-docs-linear`") and NOT_MEASURED not in row.cells[1]:
            sources = ", ".join(str(path.relative_to(ROOT)) for path in row.sources[:1])
            cells = [cell.replace("**", "") for cell in row.cells]  # the table's bold is markdown
            return f"{sources}: Trainer {cells[1]}; hybrid {cells[2]}; best peer {cells[3]}"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=["demo", "smoke"], default="demo")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr_scale", type=float, default=0.2, help="the speed A/B's fraction of the swept LR")
    parser.add_argument("--skip_faults", action="store_true", help="the speed A/B alone")
    parser.add_argument("--output_dir", default="runs/demo")
    args = parser.parse_args()
    quiet()
    started = time.perf_counter()

    def progress(message: str) -> None:
        print(f"  [{time.perf_counter() - started:5.0f}s] {message}", flush=True)

    preset = dict(PRESETS[args.preset], demo_lr_scale=args.lr_scale)
    out = Path(args.output_dir)
    progress("tokenizing the shipped corpus (once)")
    build_model_and_data(preset, args.seed)
    faults_report = None
    if not args.skip_faults:
        progress("1/2 the guard: a clean Trainer, the Trainer with faults, the hybrid with the same faults")
        faults_report = run_faults(preset, args.seed, out / "faults")
    progress(f"2/2 speed at {args.lr_scale:g}x the swept learning rate: the Trainer, then the hybrid")
    speed = run_speed(preset, args.seed, out / "speed", progress)
    plot_speed(out / "speed", speed)
    if faults_report is None:
        keys = ("learning_rate", "target", "time_to_target", "speedup", "updates_to_target", "update_speedup")
        print(json.dumps({k: speed[k] for k in keys}))
        return
    screen = summary(faults_report, speed, recorded_swept_result(args.preset), out, time.perf_counter() - started)
    (out / "summary.txt").write_text(screen + "\n")
    print("\n" + "=" * 100 + "\n" + screen + "\n" + "=" * 100)


if __name__ == "__main__":
    main()
