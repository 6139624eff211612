"""One benchmark arm, in its own process: the Trainer (`baseline`), the Trainer evaluated on a moving average of its
weights (`ema`), schedule-free AdamW (`sf`, `sf-swept`), Prodigy, Mechanic, the Trainer at the swept learning rate
(`swept`) or
HybridHFTrainer (`hybrid`), trained on a preset and measured (timing.py), its measurements an
`ArmResult` written as JSON for the parent process. The training stack is imported inside `run_arm`, so that the
parent process imports this module without it."""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from model_and_data import build_model_and_data
from presets import EMA_DECAY, PRESETS, SCHEDULE_FREE_ARMS


@dataclass
class ArmResult:
    arm: str
    evals: list = field(default_factory=list)  # [step, train_seconds, eval_loss, updates spent]
    steps: int = 0
    train_seconds: float = 0.0
    tokens: int = 0
    step_seconds: list = field(default_factory=list)  # per optimizer step, training time only
    phases: list = field(default_factory=list)  # per optimizer step
    hook_seconds: list = field(default_factory=list)  # per optimizer step: the clocked hooks and guard (timing.py)
    timing: dict = field(default_factory=dict)  # forward/backward/optimizer seconds
    peak_memory_mb: float = 0.0
    peak_pinned_mb: float | None = None  # pinned host memory held by PyTorch's pinned allocator (CUDA)
    memory_curve: list = field(default_factory=list)  # [step, peak allocated MB so far, reserved MB] (CUDA)
    n_params: int = 0
    cuda: bool = False
    device: str = "cpu"  # the GPU's name, read in the arm's own process: the parent makes no CUDA context of its own
    hybrid_stats: dict | None = None
    reached_step: int | None = None


class WeightAverage:
    """An exponential moving average of the trainable weights (fp32), updated after every optimizer step; `swapped_in`
    evaluates it in place of the weights. The early-step decay (1 + n) / (10 + n) keeps it from remembering the
    start."""

    def __init__(self, model, decay: float) -> None:
        self.decay, self.updates = decay, 0
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.average = [p.detach().float().clone() for p in self.params]

    def update(self) -> None:
        import torch

        self.updates += 1
        decay = min(self.decay, (1 + self.updates) / (10 + self.updates))
        with torch.no_grad():
            torch._foreach_lerp_(self.average, [p.float() for p in self.params], 1 - decay)

    @contextlib.contextmanager
    def swapped_in(self):
        import torch

        kept = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            torch._foreach_copy_(self.params, [a.to(p.dtype) for p, a in zip(self.params, self.average)])
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(self.params, kept)


def averaged(trainer_cls: type, average: WeightAverage) -> type:
    """`trainer_cls`, evaluating the weight average instead of the weights."""

    class Averaged(trainer_cls):
        def evaluate(self, *args, **kwargs):
            with average.swapped_in():
                return super().evaluate(*args, **kwargs)

    return Averaged


def early_evaluations(trainer, every: int):
    """A callback that evaluates every `every` updates before the first of `eval_steps`: the arms that reach a target
    inside the first evaluation spacing (a swept LR often does) are timed there, not at the spacing's end. Counted as
    the Trainer's updates, as the library counts its own evaluations (hf_hybrid/loop/step_veto.py), so that both arms
    evaluate, and draw the evaluation DataLoader's seed from the global RNG, after the same updates."""
    from transformers import TrainerCallback

    class EarlyEvaluations(TrainerCallback):
        done = 0  # the last early evaluation's count

        def on_step_end(self, args, state, control, **kwargs):
            engine = getattr(trainer, "hybrid_engine", None)
            counted = state.global_step - (engine.made_up_steps if engine is not None else 0)
            self.done = min(self.done, counted // every * every)  # an undo took the count back
            if counted < args.eval_steps and counted >= self.done + every and not (engine and engine.jump_open):
                control.should_evaluate, self.done = True, counted // every * every

    return EarlyEvaluations()


def run_arm(arm: str, preset: dict, out_dir: Path, seed: int, hybrid_overrides: dict, budget: float,
            target: float | None, hook_clock_on_gpu: bool, watchers: tuple = ()) -> ArmResult:
    """One arm's run. `watchers`: an experiment's callbacks, added last, so that their step-end hooks run after the
    hybrid's step-end work (a reading, a jump's verdict)."""
    import torch
    from timing import TrainingClock, add_optimizer_clock, spent_updates, time_hybrid_hooks, timed_trainer
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_callback import PrinterCallback

    from hf_hybrid import HybridHFTrainer, HybridTrainingArguments

    cuda = torch.cuda.is_available()
    model, datasets, eval_set = build_model_and_data(preset, seed)

    hybrid = arm == "hybrid"
    # Under a decaying schedule the step count defines the schedule: the hybrid keeps the baseline's, and must reach the
    # target inside it. A constant schedule lets it run on for `budget` times the steps.
    constant = preset.get("scheduler", "constant_with_warmup").startswith("constant")
    max_steps = preset["max_steps"]
    if hybrid and target is not None and constant:
        max_steps = math.ceil(preset["max_steps"] * budget)
    common = dict(
        output_dir=str(out_dir), max_steps=max_steps, per_device_train_batch_size=preset["batch_size"],
        per_device_eval_batch_size=max(preset["batch_size"], 16), gradient_accumulation_steps=preset["grad_accum"],
        learning_rate=preset["learning_rate"], lr_scheduler_type=preset.get("scheduler", "constant_with_warmup"),
        lr_scheduler_kwargs=preset.get("scheduler_kwargs", {}), warmup_steps=preset["warmup_steps"],
        weight_decay=preset["weight_decay"], optim=preset["optim"],
        bf16=preset["bf16"] and cuda, eval_strategy="steps", eval_steps=preset["eval_steps"], logging_steps=25,
        eval_on_start=bool(preset.get("early_eval_steps")), save_strategy="no", report_to="none", seed=seed,
        data_seed=seed, disable_tqdm=True,
        dataloader_num_workers=0, use_cpu=not cuda, full_determinism=preset.get("full_determinism", False),
        torch_compile=preset.get("torch_compile", False),
    )
    result = ArmResult(arm=arm)

    optimizer_cls_and_kwargs = None
    if arm == "prodigy":
        # Its README's settings: lr 1.0 under the preset's schedule, with safeguard_warmup since the schedule warms up,
        # bias correction, and decoupled weight decay from the Trainer's parameter groups.
        from prodigyopt import Prodigy

        common.update(learning_rate=1.0)
        optimizer_cls_and_kwargs = (Prodigy, dict(lr=1.0, safeguard_warmup=True, use_bias_correction=True,
                                                  weight_decay=preset["weight_decay"]))
    if arm == "mechanic":
        # Mechanic learns one multiplier on the base optimizer's steps, the quantity the autopilot moves: AdamW under
        # it at lr 1.0 and the preset's schedule, as its README runs it.
        from mechanic_pytorch import mechanize

        common.update(learning_rate=1.0)
        optimizer_cls_and_kwargs = (mechanize(torch.optim.AdamW), dict(lr=1.0, weight_decay=preset["weight_decay"]))
    if arm in SCHEDULE_FREE_ARMS:
        # The optimizer warms up by itself (the Trainer passes warmup_steps on) and needs no decay: that is its point.
        common.update(optim="schedule_free_adamw", lr_scheduler_type="constant", lr_scheduler_kwargs={})
    if hybrid:
        if hook_clock_on_gpu or not cuda:
            time_hybrid_hooks(result, cuda)
        trainer_cls = timed_trainer(HybridHFTrainer, "TimedHybrid", result, cuda)
        # Its evaluations come on the library's counted steps: after as many of the Trainer's updates as the
        # baseline's, and so at the same place in the dropout RNG (hf_hybrid/loop/step_veto.py).
        args = HybridTrainingArguments(**common, **{**preset["hybrid"], **hybrid_overrides})
    else:
        trainer_cls = timed_trainer(Trainer, "TimedTrainer", result, cuda)
        args = TrainingArguments(**common)
    average = None
    if arm == "ema":
        average = WeightAverage(model, EMA_DECAY)
        trainer_cls = averaged(trainer_cls, average)
    trainer = trainer_cls(model=model, args=args, train_dataset=datasets["train"], eval_dataset=eval_set,
                          optimizer_cls_and_kwargs=optimizer_cls_and_kwargs)
    trainer.remove_callback(PrinterCallback)  # one progress line per evaluation instead of the log dicts
    # Added after construction so they run after the hybrid's own hooks: its per-step work is timed too.
    if average is not None:

        class AverageUpdate(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                average.update()

        trainer.add_callback(AverageUpdate())  # before the clock's step end: its cost is training time
    if preset.get("early_eval_steps"):
        trainer.add_callback(early_evaluations(trainer, preset["early_eval_steps"]))
    clock = TrainingClock(trainer, result, target, stop_at_target=hybrid, cuda=cuda)
    trainer.add_callback(clock)
    for watcher in watchers:
        trainer.add_callback(watcher)
    add_optimizer_clock(trainer, result, cuda)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    result.steps = trainer.state.global_step
    result.n_params = sum(p.numel() for p in model.parameters())
    result.cuda = cuda
    result.device = torch.cuda.get_device_name() if cuda else "cpu"
    result.train_seconds = clock.train_seconds
    autopilot = getattr(trainer, "_lr_autopilot", None)
    if autopilot is not None:  # the library's own clock on its readings (a device wait on either side of each)
        result.timing["lr_readings"] = autopilot.reading_seconds
    result.tokens = result.steps * preset["batch_size"] * preset["grad_accum"] * preset["block_size"]
    if not result.evals or result.evals[-1][0] != result.steps:
        metrics = trainer.evaluate()
        result.evals.append([result.steps, result.train_seconds, metrics["eval_loss"], spent_updates(trainer)])
    if cuda:
        result.peak_memory_mb = torch.cuda.max_memory_allocated() / 2**20
        if hasattr(torch.cuda, "host_memory_stats"):
            result.peak_pinned_mb = torch.cuda.host_memory_stats().get("allocated_bytes.peak", 0) / 2**20
    else:
        import resource

        result.peak_memory_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if hybrid:
        result.hybrid_stats = trainer.hybrid_stats()
    return result


def arm_main(spec_json: str) -> None:
    """The arm process's work: `spec_json` as benchmark.py's `launch` writes it, the result to `arm_result.json`."""
    spec = json.loads(spec_json)
    preset = dict(PRESETS[spec["preset"]])
    if spec["max_steps"]:
        preset["max_steps"] = spec["max_steps"]
    if spec["grad_accum"]:
        preset["grad_accum"] = spec["grad_accum"]
    if spec["eval_at_end"]:
        preset["eval_steps"] = preset["max_steps"]
    if not spec.get("early_evals"):
        preset.pop("early_eval_steps", None)
    if spec["learning_rate"]:
        preset["learning_rate"] = spec["learning_rate"]
    preset["full_determinism"] = spec["full_determinism"]
    preset["torch_compile"] = spec.get("torch_compile", False)
    out_dir = Path(spec["out_dir"])
    result = run_arm(spec["arm"], preset, out_dir, spec["seed"], spec["overrides"], spec["budget"], spec["target"],
                     spec["hook_clock_on_gpu"])
    (out_dir / "arm_result.json").write_text(json.dumps(asdict(result)))


