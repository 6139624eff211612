"""`HybridTrainingArguments`: the Trainer's arguments plus the hybrid flags.

Each field shows in `HfArgumentParser(...)` `--help`, and is documented and given its default here alone.
`HybridHFTrainer` also accepts a plain `TrainingArguments`; it then uses the defaults below (`hybrid_flags`). The run
reads them once, typed by capability, as a `HybridConfig`; each capability checks its own ranges.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from types import SimpleNamespace
from typing import Literal

from transformers import TrainingArguments

from .autopilot.config import AutopilotConfig
from .flags import FlagSettings, flag, section
from .guard.config import GuardConfig
from .jumps.config import JumpsConfig
from .jumps.predictors import PREDICTORS

PredictorName = Literal["velocity", "adam", "outer"]


@dataclass
class HybridTrainingArguments(TrainingArguments):
    r"""
    [`~transformers.TrainingArguments`] plus the settings of hybrid predictive training.

    Parameters:
        hybrid (`bool`, defaults to `True`):
            Turn hybrid training on. `False` makes [`HybridHFTrainer`] the plain `Trainer`, bit for bit.
        hybrid_predict (`bool`, defaults to `True`):
            Predict weight updates. `False` turns the jumps off: every step is a real step; the guard and the LR
            autopilot stay on.
        hybrid_warmup_steps (`int`, defaults to `100`):
            Plain optimizer steps at the start that only collect statistics.
        hybrid_full_steps (`int`, defaults to `20`):
            Plain steps in a Full phase before a prediction may start; doubles after each prediction that is
            rolled back or does not pay. At least 1.
        hybrid_min_predict_steps (`int`, defaults to `2`):
            Shortest Predict phase.
        hybrid_max_predict_steps (`int`, defaults to `15`):
            Longest Predict phase; the length grows with the square of the confidence.
        hybrid_correct_steps (`int`, defaults to `2`):
            Real steps after each Predict phase that measure the prediction's residual and correct it.
        hybrid_confidence_threshold (`float`, defaults to `0.6`):
            Confidence in [0, 1] needed to start predicting; 0 predicts whenever the schedule allows, 1 never
            (unless the confidence is exactly 1).
        hybrid_max_consecutive_predicts (`int`, defaults to `5`):
            Predict/Correct cycles in a row before a Full phase is forced.
        hybrid_max_rejections (`int`, defaults to `3`):
            After this many jumps in a row are rolled back (by the payoff check or a divergence), stop predicting
            for the rest of the run and give back the predictor's buffers: the run then costs what the Trainer
            does, plus a loss and gradient-norm check per step. 0 never stops.
        hybrid_predictor (`str`, defaults to `"outer"`):
            How deltas are predicted: `velocity` (EMA of real updates per unit learning rate, one extra
            parameter-sized buffer), `adam` (AdamW's step with its moments held fixed, no extra buffer) or `outer`
            (an outer Nesterov step on the pseudo-gradient every `hybrid_outer_period` real steps, as DiLoCo with
            one worker; two extra buffers; it sets its own schedule: full steps = the period, one-step jumps, no
            Correct steps, no confidence gate).
        hybrid_velocity_beta (`float`, defaults to `0.95`):
            EMA decay of the `velocity` predictor, in [0, 1).
        hybrid_outer_period (`int`, defaults to `30`):
            Real steps between two jumps of the `outer` predictor (DiLoCo's H).
        hybrid_outer_lr (`float`, defaults to `0.6`):
            Outer learning rate of the `outer` predictor; 1 with no momentum is no jump at all.
        hybrid_outer_momentum (`float`, defaults to `0.9`):
            Nesterov momentum of the `outer` predictor, in [0, 1).
        hybrid_lr_autopilot (`bool`, defaults to `True`):
            Raise the learning rate when a probe along the optimizer's next step (three forwards, every 10 real steps,
            every 5 while a raise is under way past the warmup and the 10 steps after it, the gap doubling while it
            reads no line a step long) shows the steps are too short: one multiplier on the whole schedule (logged as
            `hybrid/lr_scale`), sized to the readings (two in a row 4 or more steps long, or three in a row whose median
            is 1 step or more), up to 2x at a time and 32x in all, never below the user's. Where the first steps'
            gradient still points on along the way come (their alignment), the LR is far too small: one long reading is
            enough, and a raise may be 4x, or up to the cap in one raise (ramped in over 5 steps past 4x) where they
            read strongly aligned, as LoRA's do; where it points back (opposed), no raise starts at all. Each raise is
            judged at the next reading, on the probe, against the point the user's LR would have reached over the same
            batches (two forwards), and undone bit for bit (to the guard's snapshot) when it did worse by more than
            `hybrid_probe_noise_margin`. No raise in the schedule's warmup or the 10 steps after it (unless the first
            steps read aligned: then from step 10; with a warmup under 10 steps or none, a line read before step 20
            counts only from 16 steps on), once it has decayed below half its peak, in the last 10 steps, or before the
            third reading after a step the guard flagged; a guard rollback halves a raised scale. Where the schedule has
            no decay of its own (constant), a raised scale returns to 1 over the run's last fifth, and no raise starts
            in the 10 steps before that. Needs the guard's snapshots, torch's Adam or AdamW without amsgrad (every
            `adamw_torch*` optim; not schedule-free AdamW, Prodigy or Mechanic) and a schedule that scales with its base
            learning rate, a `LambdaLR` (every named schedule but `reduce_lr_on_plateau`; a scheduler passed in
            `optimizers` must be one too). `False` keeps `--learning_rate` exactly.
        hybrid_monitor_interval (`int`, defaults to `1`):
            Run a forward pass to check the loss on every N-th predicted step (and always on a phase's last);
            skipped steps cost almost nothing but are unchecked until the next check.
        hybrid_loss_band (`float`, defaults to `3.0`):
            Roll back when a predicted step's loss is more than this many standard deviations above the
            forecast loss.
        hybrid_grad_explosion_factor (`float`, defaults to `10.0`):
            Roll back when the first real step after a prediction has a gradient norm this many times its trend.
        hybrid_payoff_check (`bool`, defaults to `True`):
            Gate each Predict phase on a probe batch (its first batch, never trained on): keep the jump only if
            the probe loss fell by at least what plain training would have gained for the phase's cost, else roll
            back. Each rejection doubles the next Full phase; each kept jump halves it back. When off, a jump
            that comes through its last step (its Correct steps, if it has any) without a rollback counts as kept.
        hybrid_probe_noise_margin (`float`, defaults to `2.0`):
            The payoff check keeps a jump only if its probe gain beats plain training's by this many standard errors
            of the gain over the probe's sequences (read for transformers' language models and single-label sequence
            classifiers; elsewhere 0). 0 keeps any gain that beats plain training's.
        hybrid_predict_step_cost (`float`, defaults to `0.35`):
            Cost of a forward pass (a checked predicted step, a probe) relative to a real step, for the payoff
            check (a forward is about a third of forward+backward+step). The benchmark measures it; a fixed
            number keeps decisions identical across ranks and across resumes. A judged outer jump is charged two
            forwards; on a GPU its copies over the host link cost more, and 1.0 charges about what they cost
            (docs/benchmarks-history.md, "What the payoff check charges a jump, against its wall time").
        hybrid_trace (`bool`, defaults to `True`):
            Write one JSON line per optimizer step to `<output_dir>/hybrid_trace.jsonl` (main process).
        hybrid_vram_min_free_mb (`float`, defaults to `0.0`):
            On a GPU, ask for a checkpoint when free memory falls below this many MiB. 0 turns it off.
        hybrid_offload_snapshot (`bool`, defaults to `False`):
            Keep the copy of the weights that undoes a Predict phase (and the LR autopilot's copy while a reading moves
            the weights) in pinned host memory rather than on the GPU,
            for a device-to-host copy of the weights at each Predict phase's start and a copy back at each rollback.
            It lowers the device peak by one parameter-sized buffer only for `velocity` and `adam`, whose jumps stay
            open through their Correct steps: the copy exists only until a jump is judged, so with `outer` it never
            meets the gradients of a real step. No effect on CPU.
        hybrid_device_copies_share (`float`, defaults to `0.1`):
            On a GPU, the share of the device memory left free at the run's peak (measured at its second step) that
            the rollback copies may take there: the guard's snapshot and the outer predictor's anchor and momentum,
            up to 5x the parameters' bytes with AdamW. Where they fit, they stay on the GPU and every copy is a
            device-to-device one; otherwise they go to pinned host memory, which costs no device memory but a copy
            over the host link each time. Through step 10 the autopilot's copy of the start weights (1x more) joins
            them on the GPU where it fits too. A line at the start says which. 0 keeps them on the host.
        hybrid_guard (`bool`, defaults to `True`):
            Guard every real optimizer step. A step whose loss or gradient norm is not finite, or is an outlier against
            the recent steps, is skipped: its update is vetoed (weights, optimizer state and learning-rate schedule stay
            as they were, and the GradScaler unless the step overflowed, which lowers its scale as usual) and its batch
            is dropped. A skipped step does not count toward `max_steps`. When the weights themselves turn out damaged,
            or outliers persist, the run rolls back to the last good snapshot; after too many rollbacks it saves a
            checkpoint and stops.
        hybrid_guard_window (`int`, defaults to `128`):
            Accepted steps whose loss and gradient norm make up the guard's running statistics.
        hybrid_guard_threshold (`float`, defaults to `6.0`):
            A loss or gradient norm more than this many robust standard deviations (1.4826 x the median absolute
            deviation) above the window's median is an outlier. The gradient norm is compared in log scale, and
            only when the Trainer does not clip gradients (`max_grad_norm` 0): a clipped step is already bounded.
        hybrid_guard_max_skips (`int`, defaults to `25`):
            Outlier steps in a row after which the guard rolls back rather than skip again.
        hybrid_guard_snapshot_steps (`int`, defaults to `50`):
            Take the rollback snapshot (weights, optimizer state, schedule, RNG) every this many steps: on the
            accelerator where the rollback copies fit `hybrid_device_copies_share`, else in pinned host memory. With
            the `outer` predictor it is also taken at each cycle's start, on the anchor's copy of the weights. 0 takes
            none: the guard then only skips, and a needed rollback stops the run.
        hybrid_guard_max_rollbacks (`int`, defaults to `3`):
            Rollbacks allowed in a run; the next needed one saves a checkpoint and stops training with an error.
    """

    hybrid: bool = field(default=True, metadata={"help": "Turn hybrid predictive training on (false = plain Trainer)."})
    hybrid_predict: bool = field(
        default=True, metadata={"help": "Jumps (false = every step real; the guard and the autopilot stay)."}
    )
    hybrid_warmup_steps: int = field(default=100, metadata={"help": "Plain steps that only collect statistics."})
    hybrid_full_steps: int = field(
        default=20, metadata={"help": "Plain steps per Full phase before predicting (>= 1); doubles on back-off."}
    )
    hybrid_min_predict_steps: int = field(default=2, metadata={"help": "Shortest Predict phase."})
    hybrid_max_predict_steps: int = field(default=15, metadata={"help": "Longest Predict phase."})
    hybrid_correct_steps: int = field(default=2, metadata={"help": "Real steps after each Predict phase."})
    hybrid_confidence_threshold: float = field(
        default=0.6, metadata={"help": "Confidence in [0, 1] needed to predict; 0 = whenever the schedule allows."}
    )
    hybrid_max_consecutive_predicts: int = field(
        default=5, metadata={"help": "Predict/Correct cycles in a row before a Full phase is forced."}
    )
    hybrid_max_rejections: int = field(
        default=3, metadata={"help": "Stop predicting after this many rolled-back jumps in a row (0 = never)."}
    )
    hybrid_predictor: PredictorName = field(default="outer", metadata={"help": "Delta predictor."})
    hybrid_velocity_beta: float = field(default=0.95, metadata={"help": "EMA decay of the velocity predictor."})
    hybrid_outer_period: int = field(default=30, metadata={"help": "Real steps between outer-momentum jumps (H)."})
    hybrid_outer_lr: float = field(default=0.6, metadata={"help": "Outer learning rate of the outer predictor."})
    hybrid_outer_momentum: float = field(
        default=0.9, metadata={"help": "Nesterov momentum of the outer predictor, in [0, 1)."}
    )
    hybrid_lr_autopilot: bool = field(
        default=True, metadata={"help": "Raise the learning rate when probes show it is too small (judged, undone)."}
    )
    hybrid_monitor_interval: int = field(
        default=1, metadata={"help": "Check the loss with a forward pass on every N-th predicted step."}
    )
    hybrid_loss_band: float = field(
        default=3.0, metadata={"help": "Roll back when a predicted loss exceeds the forecast by this many sigmas."}
    )
    hybrid_grad_explosion_factor: float = field(
        default=10.0, metadata={"help": "Roll back when the gradient norm after a prediction is this x its trend."}
    )
    hybrid_payoff_check: bool = field(
        default=True, metadata={"help": "Keep a jump only if a probe batch shows it beat plain training's gain."}
    )
    hybrid_probe_noise_margin: float = field(
        default=2.0, metadata={"help": "Standard errors of the probe gain a kept jump must clear; 0 = none."}
    )
    hybrid_predict_step_cost: float = field(
        default=0.35, metadata={"help": "Cost of a forward pass / a real step, for the payoff check."}
    )
    hybrid_trace: bool = field(default=True, metadata={"help": "Write <output_dir>/hybrid_trace.jsonl."})
    hybrid_vram_min_free_mb: float = field(
        default=0.0, metadata={"help": "GPU: checkpoint when free VRAM falls below this (MiB); 0 = off."}
    )
    hybrid_offload_snapshot: bool = field(
        default=False, metadata={"help": "GPU: keep the undo copy of the weights in pinned host memory."}
    )
    hybrid_device_copies_share: float = field(
        default=0.1, metadata={"help": "GPU: rollback copies stay on the device within this share of its free memory."}
    )
    hybrid_guard: bool = field(
        default=True, metadata={"help": "Skip outlier or non-finite real steps; roll back damaged weights."}
    )
    hybrid_guard_window: int = field(default=128, metadata={"help": "Steps in the guard's running statistics."})
    hybrid_guard_threshold: float = field(
        default=6.0, metadata={"help": "Outlier: this many robust sigmas above the window's median."}
    )
    hybrid_guard_max_skips: int = field(
        default=25, metadata={"help": "Outlier steps in a row before the guard rolls back."}
    )
    hybrid_guard_snapshot_steps: int = field(
        default=50,
        metadata={"help": "Steps between rollback snapshots (on the device where they fit, else pinned host memory; "
                          "outer: also each cycle's start); 0 = none."},
    )
    hybrid_guard_max_rollbacks: int = field(
        default=3, metadata={"help": "Rollbacks allowed before the run saves a checkpoint and stops."}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        HybridConfig.from_flags(self)  # validates, naming the flag


@dataclass(frozen=True)
class HybridConfig(FlagSettings):
    """Every hybrid setting, typed and validated, by capability; built once from the flags (`hybrid_config`)."""

    enabled: bool = flag("hybrid")
    trace: bool = flag("hybrid_trace")
    vram_min_free_mb: float = flag("hybrid_vram_min_free_mb")
    device_copies_share: float = flag("hybrid_device_copies_share")
    jumps: JumpsConfig = section(JumpsConfig)
    guard: GuardConfig = section(GuardConfig)
    autopilot: AutopilotConfig = section(AutopilotConfig)

    def __post_init__(self) -> None:
        self.at_least(0, "vram_min_free_mb", "device_copies_share")
        self.require("device_copies_share", self.device_copies_share <= 1, "must be <= 1")


HYBRID_FIELDS = [f for f in fields(HybridTrainingArguments) if f.name.startswith("hybrid")]


def hybrid_flags(args: TrainingArguments) -> HybridTrainingArguments | SimpleNamespace:
    """The `hybrid_*` flags of `args`: its own fields, or the defaults for a plain `TrainingArguments`."""
    if isinstance(args, HybridTrainingArguments):
        return args
    return SimpleNamespace(**{f.name: getattr(args, f.name, f.default) for f in HYBRID_FIELDS})


def hybrid_config(args: TrainingArguments) -> HybridConfig:
    """The run's settings from `args` (validated)."""
    return HybridConfig.from_flags(hybrid_flags(args))


def ignored_flags(args: TrainingArguments) -> list[str]:
    """The flags set away from their defaults that only other predictors than the active one read."""
    flags = hybrid_flags(args)
    if not (flags.hybrid and flags.hybrid_predict):
        return []
    active = PREDICTORS[flags.hybrid_predictor].flags
    others = {name for cls in PREDICTORS.values() for name in cls.flags} - set(active)
    return [f.name for f in HYBRID_FIELDS if f.name in others and getattr(flags, f.name) != f.default]
