"""The faults run: a clean Trainer, the Trainer with injected faults, and HybridHFTrainer with the same faults.

    python scripts/benchmark.py --preset cpu-small --mode faults                 # all three faults
    python scripts/benchmark.py --preset cpu-small --mode faults --faults window  # the bad-batch window alone

Faults, at fixed optimizer steps (0-based, the same in every arm):
- window: `WINDOW_LENGTH` steps of random-label batches starting at 50% of the run;
- spike: one update taken at `SPIKE_FACTOR` x the learning rate at 70% (the loss spikes on the steps after it);
- nan: a NaN loss at 95%.
All arms share the init, data order and seed, and run in this process one after the other. Every arm is
evaluated each `eval_steps` updates in effect (for the hybrid, skipped and rolled-back steps do not count),
so the curves compare the same amount of training. Writes report.json and eval_loss_vs_step.png.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from environment import environment
from model_and_data import build_model_and_data
from transformers import TrainerCallback

WINDOW_LENGTH = 10
SPIKE_FACTOR = 100.0
ALL_FAULTS = ("window", "spike", "nan")


@dataclass
class FaultPlan:
    window: tuple[int, int] | None = None  # [start, end) steps whose labels are random tokens
    spike_step: int | None = None
    nan_step: int | None = None

    @classmethod
    def for_run(cls, max_steps: int, kinds) -> FaultPlan:
        start = max_steps // 2
        return cls(window=(start, start + WINDOW_LENGTH) if "window" in kinds else None,
                   spike_step=7 * max_steps // 10 if "spike" in kinds else None,
                   nan_step=19 * max_steps // 20 if "nan" in kinds else None)

    @property
    def first_step(self) -> int | None:
        """The first step a fault touches (0-based, as `global_step` before it), or None."""
        steps = [s for s in (self.window and self.window[0], self.spike_step, self.nan_step) if s is not None]
        return min(steps) if steps else None

    def describe(self) -> str:
        parts = []
        if self.window:
            parts.append(f"random labels at steps {self.window[0] + 1}-{self.window[1]}")
        if self.spike_step is not None:
            parts.append(f"{SPIKE_FACTOR:g}x learning rate at step {self.spike_step + 1}")
        if self.nan_step is not None:
            parts.append(f"NaN loss at step {self.nan_step + 1}")
        return ", ".join(parts) or "none"


def with_faults(trainer_cls: type, plan: FaultPlan) -> type:
    """A subclass of `trainer_cls` whose training steps' forwards (those with a backward) see the planned faults.
    Other forwards (evaluation, the hybrid's checks, probes and the guard's second look at an earlier batch) see
    clean data: the faults are in the batches and the updates, not in the model."""

    class FaultyTrainer(trainer_cls):
        in_training_step = False

        def training_step(self, *args, **kwargs):
            self.in_training_step = True
            try:
                return super().training_step(*args, **kwargs)
            finally:
                self.in_training_step = False

        def compute_loss(self, model, inputs, *args, **kwargs):
            if not (self.in_training_step and torch.is_grad_enabled()):
                return super().compute_loss(model, inputs, *args, **kwargs)
            step = self.state.global_step
            if plan.window and plan.window[0] <= step < plan.window[1]:
                labels = inputs["labels"]
                g = torch.Generator().manual_seed(10_000 + step)
                vocab = model.config.vocab_size if hasattr(model, "config") else model.module.config.vocab_size
                noise = torch.randint(0, vocab, labels.shape, generator=g).to(labels.device)
                inputs = {**inputs, "labels": noise}
            out = super().compute_loss(model, inputs, *args, **kwargs)
            if step == plan.nan_step:
                return (out[0] * float("nan"), *out[1:]) if isinstance(out, tuple) else out * float("nan")
            return out

    FaultyTrainer.__name__ = f"Faulty{trainer_cls.__name__}"
    return FaultyTrainer


class LearningRateSpike(TrainerCallback):
    """Multiplies the learning rate of one optimizer step: an update that looks fine when taken and damages the
    weights, the way a loss spike begins."""

    def __init__(self, step: int | None, factor: float = SPIKE_FACTOR) -> None:
        self.step, self.factor = step, factor

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if state.global_step == self.step:
            for group in optimizer.param_groups:
                group["lr"] = group["lr"] * self.factor

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if state.global_step == self.step:
            for group in optimizer.param_groups:
                group["lr"] = group["lr"] / self.factor


class UpdatesEval(TrainerCallback):
    """Evaluates each `every` updates in effect, and prints one progress line per evaluation."""

    def __init__(self, arm: str, every: int, total: int) -> None:
        self.arm, self.every, self.total = arm, every, total
        self.trainer = None
        self.evals: list[list] = []  # [global step, updates in effect, eval loss]
        self.last = 0
        self.t0 = time.perf_counter()

    def updates(self, state) -> int:
        engine = getattr(self.trainer, "_hybrid", None)
        return state.global_step - (engine.made_up_steps if engine is not None else 0)

    def on_step_end(self, args, state, control, **kwargs):
        updates = self.updates(state)
        if updates % self.every == 0 and updates != self.last:
            self.last = updates
            control.should_evaluate = True

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        updates = self.updates(state)
        self.evals.append([state.global_step, updates, metrics["eval_loss"]])
        loop = getattr(self.trainer, "_guard_loop", None)
        extra = f" | guard: {loop.guard.outliers} flagged, {loop.guard.rollbacks} rollbacks" if loop is not None else ""
        print(f"  [{self.arm:>15}] {updates:4d}/{self.total} updates, step {state.global_step:4d}, "
              f"eval loss {metrics['eval_loss']:.4f}, {time.perf_counter() - self.t0:5.0f}s{extra}", flush=True)


class SaveAt(TrainerCallback):
    """Saves one checkpoint, after optimizer step `step`: where a faulted arm can start from the clean one."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_save = True


def run_arm(arm: str, preset: dict, plan: FaultPlan, seed: int, out_dir: Path, save_at: int | None = None,
            resume_from: Path | None = None) -> dict:
    """One arm's run. `save_at`: also save a checkpoint after that step; `resume_from`: start from such a
    checkpoint (the Trainer's own resume: weights, optimizer, schedule, RNG and data position)."""
    from transformers import Trainer, TrainingArguments
    from transformers.trainer_callback import PrinterCallback

    from hf_hybrid import HybridHFTrainer, HybridTrainingArguments

    model, datasets, eval_set = build_model_and_data(preset, seed)
    cuda = torch.cuda.is_available()
    common = dict(
        output_dir=str(out_dir), max_steps=preset["max_steps"], per_device_train_batch_size=preset["batch_size"],
        per_device_eval_batch_size=max(preset["batch_size"], 16), learning_rate=preset["learning_rate"],
        lr_scheduler_type="constant_with_warmup", warmup_steps=preset["warmup_steps"],
        weight_decay=preset["weight_decay"], optim=preset["optim"], bf16=preset["bf16"] and cuda,
        eval_strategy="no", logging_steps=50, save_strategy="no", report_to="none", seed=seed, data_seed=seed,
        disable_tqdm=True, use_cpu=not cuda, full_determinism=preset.get("full_determinism", False),
    )
    if arm.startswith("hybrid"):
        trainer_cls, args = HybridHFTrainer, HybridTrainingArguments(**common)  # the library's defaults
    else:
        trainer_cls, args = Trainer, TrainingArguments(**common)
    faulty = arm != "trainer-clean"
    if faulty:
        trainer_cls = with_faults(trainer_cls, plan)
    trainer = trainer_cls(model=model, args=args, train_dataset=datasets["train"], eval_dataset=eval_set)
    trainer.remove_callback(PrinterCallback)  # one progress line per evaluation instead of the log dicts
    evaluator = UpdatesEval(arm, preset["eval_steps"], preset["max_steps"])
    evaluator.trainer = trainer
    trainer.add_callback(evaluator)
    if faulty:
        trainer.add_callback(LearningRateSpike(plan.spike_step))
    if save_at is not None:
        trainer.add_callback(SaveAt(save_at))
    trainer.train(resume_from_checkpoint=str(resume_from) if resume_from is not None else None)
    stats = trainer.hybrid_stats() if hasattr(trainer, "hybrid_stats") else None
    final = evaluator.evals[-1][2] if evaluator.evals else float("nan")
    return {"arm": arm, "evals": evaluator.evals, "final_eval_loss": final, "global_steps": trainer.state.global_step,
            "hybrid_stats": stats}


def main(args, preset: dict) -> None:
    if args.max_steps:
        preset["max_steps"] = args.max_steps
    preset["eval_steps"] = max(preset["max_steps"] // 10, 1)
    # On a GPU two plain runs with the same seed differ by up to 0.057 (run 124): deterministic kernels leave the
    # faults and the guard as the only difference between the arms.
    preset["full_determinism"] = args.full_determinism
    kinds = [k for k in args.faults.split(",") if k]
    unknown = set(kinds) - set(ALL_FAULTS)
    if unknown:
        raise SystemExit(f"--faults: unknown {sorted(unknown)}; choose from {','.join(ALL_FAULTS)}")
    plan = FaultPlan.for_run(preset["max_steps"], kinds)
    root = Path(args.output_dir) / f"{args.preset}-faults"
    print(f"faults run, {args.preset}, {preset['max_steps']} updates per arm, seed {args.seed}: {plan.describe()}",
          flush=True)
    arms = {}
    for arm in ("trainer-clean", "trainer-faults", "hybrid-faults"):
        print(f"{arm}:", flush=True)
        arms[arm] = run_arm(arm, dict(preset), plan, args.seed, root / arm)
    clean = arms["trainer-clean"]["final_eval_loss"]
    report = {"preset": args.preset, "seed": args.seed, "max_steps": preset["max_steps"], "faults": kinds,
              "plan": plan.describe(), "arms": arms,
              "damage": {arm: r["final_eval_loss"] - clean for arm, r in arms.items() if arm != "trainer-clean"},
              "environment": environment()}
    root.mkdir(parents=True, exist_ok=True)
    (root / "report.json").write_text(json.dumps(report, indent=2))
    print_table(report)
    plot(root, report)


def print_table(report: dict) -> None:
    print(f"\nfaults ({report['plan']}), {report['max_steps']} updates, seed {report['seed']}")
    print(f"{'':16}{'final eval loss':>17}{'vs clean':>10}{'optimizer steps':>17}  guard")
    for arm, r in report["arms"].items():
        loss = r["final_eval_loss"]
        delta = report["damage"].get(arm)
        stats = r["hybrid_stats"] or {}
        guard = (f"{stats['guard_outliers']} flagged, {stats['skipped_steps']} skipped, "
                 f"{stats['guard_rollbacks']} rollbacks" if stats else "-")
        fdelta = "-" if delta is None else ("nan" if math.isnan(delta) else f"{delta:+.4f}")
        print(f"{arm:16}{loss:>17.4f}{fdelta:>10}{r['global_steps']:>17}  {guard}")


def plot(root: Path, report: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no PNG; pip install hf-hybrid[plot])")
        return
    fig, ax = plt.subplots(figsize=(9, 5))
    styles = {"trainer-clean": "k-o", "trainer-faults": "C0-s", "hybrid-faults": "C3-^"}
    for arm, r in report["arms"].items():
        evals = [(u, loss) for _, u, loss in r["evals"] if math.isfinite(loss)]
        ax.plot([u for u, _ in evals], [loss for _, loss in evals], styles[arm], ms=3, label=arm)
        lost = [u for _, u, loss in r["evals"] if not math.isfinite(loss)]
        if lost:  # a NaN run has no point to plot from there on: say where it went
            ax.annotate(f"{arm}: NaN", (lost[0], evals[-1][1]), color=styles[arm][:2], fontsize=8)
    ax.set_xlabel("updates in effect (optimizer steps that count)")
    ax.set_ylabel("eval loss")
    ax.set_title(report["plan"], fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(root / "eval_loss_vs_step.png", dpi=120)
    print(f"wrote {root / 'report.json'} and {root / 'eval_loss_vs_step.png'}")
