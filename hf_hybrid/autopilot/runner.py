"""The learning-rate autopilot at the Trainer's loop: what `LrScale` (autopilot/scale.py) decides, carried out.

The scale multiplies the schedule's base learning rates, so the Trainer's `LambdaLR` keeps applying its own shape
(warmup, decay) on top and never overwrites it; the learning rate in effect is rescaled at once. AdamW's decoupled
weight decay is multiplied by the learning rate, so it scales with it, exactly as it would in a run started with the
raised `--learning_rate`, which is what the end line tells the user to pass next time.

A raise's undo point is the guard's snapshot (weights, optimizer state, schedule, RNG; placed by memory/placement.py),
asked for at the first accepted step after the raise and held until the raise is judged: a trial costs no memory
beyond the guard's. A checkpoint saved during a trial takes a new snapshot as always, the undo point a resumed run
takes too, so resumed and uninterrupted runs stay bit for bit equal. An undone trial gives the batches since its undo
point back to the data stream (loop/replay.py), as a rolled-back jump does, or the run would end apart from the
Trainer on another data order (docs/benchmarks-history.md, "An undone trial gives its batches back").
"""

from __future__ import annotations

import time

import torch
from transformers.utils import logging

from ..guard.rules import Action
from ..guard.runner import GuardAtLoop
from ..loop.adam_state import unreadable_optimizer
from ..loop.replay import move_batch
from ..loop.seam import HybridTrainer
from ..memory.snapshot import WeightSnapshot
from .alignment import LAST_STEP as ALIGNMENT_LAST_STEP
from .alignment import StartAlignment
from .cooldown import HALF_PEAK, cooldown_start, cooled_scale, schedule_factor
from .end_line import RunEnd, end_line
from .line import SPACING, next_step_line
from .ramp import RaiseRamp
from .scale import LrScale, RaiseVerdict
from .setup import inner_scheduler, lr_autopilot_missing, unscalable_schedule
from .verdict import raise_gain

logger = logging.get_logger(__name__)

# Real steps between two readings while a raise is asked for, judged or building up (a steady reach takes several
# readings of a step or more): early enough to raise in the first tens of steps, where a too-small LR costs the most. A
# reading costs three forwards (one more where it judges a raise), more than a training step's time, so one that asks
# for nothing and leaves no steady reach within reach doubles the gap, without a bound: a tuned run reads about
# log2(steps) times, a share of its time that falls as the run grows (docs/benchmarks-history.md, "a reading's moves in
# multi-tensor lists, and readings that back off without a cap"). Lines of 0-1 steps (tuned runs) count as no line. A
# building steady reach still keeps readings close, so a tuned run can still raise late; the verdict is what catches
# such a raise. The end line says what the readings cost.
READ_EVERY = 10
# While a raise is under way past the warmup and the first descent (after a reading that raised or kept one, and while
# one is on trial) the next reading comes sooner: from scratch the autopilot moves 2x a reading there, far slower than
# Mechanic's learned LR grows over the same steps (docs/benchmarks.md, "Mechanic's learned learning rate, step by
# step"). Not before: a run raises there only on its first steps' alignment (FIRST_DESCENT_STEPS), which does not
# tell a third of the swept LR from a tenth from scratch, and at this pace such a run rides far past the swept LR
# (docs/benchmarks.md, "A reading every 5 steps while a raise is under way").
RAISING_READ_EVERY = 5
# No raise starts in the first steps after the schedule's warmup either: a run from scratch is still in its first
# descent there, which reads long at any LR, and a raise there can make a run at a good LR worse (docs/benchmarks-
# history.md, "a raise in the first descent at cpu-small's own LR"). With a shorter warmup than this, or none, the
# descent outlasts these steps: up to 2x this many, only a far longer line counts (autopilot/scale.py; docs/
# benchmarks.md, "The first descent of a run with no warmup"). A run whose first steps read aligned
# (autopilot/alignment.py) may raise from the alignment's last step instead: the alignment tells its LR apart there.
FIRST_DESCENT_STEPS = 10


class LrAutopilot:
    """The judged learning-rate scale of one run, identical on every rank."""

    def __init__(self, trainer: HybridTrainer, guard_loop: GuardAtLoop) -> None:
        self.trainer, self.guard_loop = trainer, guard_loop
        self.scale = LrScale()
        self.ramp = RaiseRamp()
        self.user_base_lrs = list(self._scheduler.base_lrs)
        self.probe: dict | None = None  # the run's first micro-batch, read at every reading
        # The weights while a reading or a verdict moves them, held only meanwhile; placed as a jump's undo copy.
        self.scratch = WeightSnapshot(on_host=trainer.hybrid_config.jumps.offload_snapshot)
        engine = trainer.hybrid_engine
        self.alignment = StartAlignment(engine.params, engine.placement, trainer.state.global_step)
        self.last_reading = 0  # the global step of the last reading
        self.read_every = READ_EVERY
        self.last_line: tuple[float, float, float] | None = None  # for the step trace
        self.last_verdict: tuple[float, float] | None = None  # a trial's (gain, noise), for the step trace
        guard_loop.raise_on_trial = lambda: self.scale.on_trial
        # What the readings cost this process, for the end line: measured, as their share of a step varies.
        self.readings_here, self.reading_seconds = 0, 0.0
        self.train_started = time.perf_counter()

    def take_probe(self, inputs: dict) -> None:
        """Keep the run's first micro-batch as the probe. Trained on once, at the first step, which later readings
        no longer see; a batch never trained on would have to be held out of the user's data."""
        if self.probe is None:
            self.probe = {k: v.detach().clone() for k, v in self.trainer.prepare_inputs(inputs).items()
                          if isinstance(v, torch.Tensor)}

    def before_update(self, step: int) -> None:
        """Before optimizer step `step`'s update (1-based), with the gradients in place: the first steps' alignment."""
        self.alignment.before_update(step, self.trainer.hybrid_engine.params)

    @property
    def _scheduler(self) -> torch.optim.lr_scheduler.LRScheduler:
        return inner_scheduler(self.trainer)

    def _cooldown_start(self) -> int | None:
        return cooldown_start(self._scheduler.lr_lambdas, self.trainer.state.max_steps)

    def _scale_in_effect(self) -> float:
        """The judged scale, on its way there (autopilot/ramp.py) or back to 1 at the end (autopilot/cooldown.py)."""
        position = self._scheduler.last_epoch
        return cooled_scale(self.ramp.in_effect(self.scale.scale, position), position, self._cooldown_start(),
                            self.trainer.state.max_steps)

    def _apply(self) -> None:
        """Base learning rates = the user's x the scale in effect; the learning rate in effect follows at once."""
        scheduler, scale = self._scheduler, self._scale_in_effect()
        for i, group in enumerate(self.trainer.optimizer.param_groups):
            base = self.user_base_lrs[i] * scale
            lr = float(group["lr"]) * base / scheduler.base_lrs[i] if scheduler.base_lrs[i] else base
            scheduler.base_lrs[i] = base
            if isinstance(group["lr"], torch.Tensor):  # a fused or capturable optimizer's device tensor
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        scheduler._last_lr = [float(group["lr"]) for group in self.trainer.optimizer.param_groups]

    def _schedule_factor(self) -> float:
        return schedule_factor(self._scheduler.lr_lambdas, self._scheduler.last_epoch)

    def _raises_end(self) -> int:
        """Where the scale stops being judged: the cooldown's start, else the run's end."""
        start = self._cooldown_start()
        return self.trainer.state.max_steps if start is None else start

    def _warmup_steps(self) -> int:
        return self.trainer.args.get_warmup_steps(self.trainer.state.max_steps)

    def _raise_from(self) -> int:
        """The first step at which a raise may start: past the schedule's warmup and the first descent's last steps, or
        in an aligned run the alignment's last step."""
        if self.alignment.aligned:
            return ALIGNMENT_LAST_STEP
        return self._warmup_steps() + FIRST_DESCENT_STEPS

    def _in_first_descent(self, position: int) -> bool:
        """Whether an unaligned run whose warmup is shorter than FIRST_DESCENT_STEPS is still in its first descent."""
        end = max(self._warmup_steps(), FIRST_DESCENT_STEPS) + FIRST_DESCENT_STEPS
        return not self.alignment.aligned and position < end

    def _frozen(self) -> bool:
        """No raise starts before `_raise_from`, where a run's first descent reads as a line tens of steps long at any
        LR (docs/benchmarks-history.md, "the autopilot reads Adam's next step instead of the cycle's line"), nor in the
        schedule's final decay (below half its peak past the warmup), nor where the run or the judged scale would end
        before its verdict, READ_EVERY steps on: such a raise would never be judged."""
        epoch = self._scheduler.last_epoch
        return (epoch < self._raise_from() or (epoch >= self._warmup_steps() and self._schedule_factor() < HALF_PEAK)
                or self._raises_end() - self.trainer.state.global_step < READ_EVERY)

    def _wants_reading(self, step: int, real_step: bool) -> bool:
        engine = self.trainer.hybrid_engine
        due = step - self.last_reading >= self.read_every and self.probe is not None
        idle = real_step and not engine.jump_open  # a jump's weights may yet be undone
        # Asked only then: where a raise may start depends on the first steps' alignment, read on the host once.
        if not (due and idle and self.scale.wants_readings):
            return False
        # One reading before raises may start, so that the first one after it has a rate and can raise.
        start = self._raise_from()
        freeze_ending = start - READ_EVERY <= self._scheduler.last_epoch < start
        return self.scale.on_trial or not self._frozen() or freeze_ending

    def end_step(self, step: int, real_step: bool, guard_action: Action | None) -> None:
        """At an optimizer step's end: act on a guard flag, and every few real steps read the next step's line."""
        scale, before = self.scale, self.scale.scale
        replay = self.trainer.hybrid_engine.replay
        self.last_line = self.last_verdict = None
        if guard_action is not None:
            replay.end_trial()  # the guard dropped batches inside the trial; they are not given back
            scale.guard_flagged(weights_damaged=guard_action is Action.ROLLBACK)
        if guard_action is not Action.ROLLBACK and self._wants_reading(step, real_step):
            started = self._clock()
            had_rate = scale.last_loss is not None  # a first reading, or one after a rollback, asks for nothing yet
            trainer = self.trainer
            local, rows = next_step_line(trainer, trainer.model_wrapped, trainer.hybrid_engine.shards(), self.scratch,
                                         self.probe, by_sequence=scale.on_trial)
            line = trainer.reduce_across_ranks(*local)
            self.last_line = tuple(line)
            # The line runs along the step at the LR set after the last position, before this step's raise, if any.
            position = self._scheduler.last_epoch
            decision = scale.reading(*line, spacing=SPACING, steps=step - self.last_reading,
                                     schedule_factor=self._schedule_factor() * self.ramp.share(before, position - 1),
                                     frozen=self._frozen() or self.ramp.under_way(before, position),
                                     trial_verdict=self._raise_verdict((local[0], rows)) if scale.on_trial else None,
                                     aligned=self.alignment.aligned is True,
                                     strongly_aligned=self.alignment.strongly_aligned is True,
                                     opposed=self.alignment.opposed is True,
                                     first_descent=self._in_first_descent(position))
            self.last_reading = step
            busy = decision in ("raise", "keep") or scale.on_trial or not had_rate or scale.evidence_building
            raising = decision in ("raise", "keep") or scale.on_trial
            past_descent = position >= self._warmup_steps() + FIRST_DESCENT_STEPS
            self.read_every = (RAISING_READ_EVERY if raising and past_descent else READ_EVERY if busy
                               else 2 * self.read_every)
            if decision == "raise":
                self.guard_loop.snapshot_asked = True  # the undo point: before the first update at the new scale
                self.ramp.begin(position, scale.trial_from, scale.scale)
            elif decision == "undo":
                self._undo(step, before)
            self.readings_here += 1
            self.reading_seconds += self._clock() - started
        if scale.scale != before or self._cooling() or self.ramp.moving(scale.scale, self._scheduler.last_epoch):
            self._apply()
        if not scale.on_trial:
            replay.end_trial()

    def _cooling(self) -> bool:
        """Whether a raised scale is on its way back to 1 (autopilot/cooldown.py): its LR moves every step."""
        start = self._cooldown_start()
        return start is not None and self._scheduler.last_epoch > start and self.scale.scale != 1.0

    def _clock(self) -> float:
        """Wall time, once the device's queued work is done: a reading reads its losses on the host anyway."""
        if self.trainer.args.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def _raise_verdict(self, raised: tuple[torch.Tensor, torch.Tensor | None]) -> RaiseVerdict:
        """The verdict on the raise under trial (autopilot/verdict.py, which says why an even result keeps it), as its
        steps took it (autopilot/ramp.py), given the probe's loss at the raised weights and each sequence's, unreduced
        (the reading's first forward). With no undo point (a trial whose steps the guard all vetoed), the raise cannot
        be judged and is undone."""
        trainer, undo_point, scale = self.trainer, self.guard_loop.snapshot, self.scale
        if not undo_point.valid:
            return RaiseVerdict.WORSE
        made_up = trainer.hybrid_engine.made_up_steps - undo_point.made_up  # steps the schedule took again
        taken = self.ramp.mean_raise(scale.trial_from, scale.scale, self._scheduler.last_epoch,
                                     trainer.state.global_step - undo_point.step - made_up)
        gain, noise = raise_gain(trainer, trainer.model_wrapped, trainer.hybrid_engine.shards(), self.scratch,
                                 self.probe, undo_point, taken, raised)
        self.last_verdict = (gain, noise)
        return RaiseVerdict.of(gain, noise, trainer.hybrid_config.jumps.checks.probe_noise_margin)

    def _undo(self, step: int, tried: float) -> None:
        undone = 0
        if self.guard_loop.snapshot.valid:
            undone = self.guard_loop.restore_snapshot(step)
            self.trainer.hybrid_engine.replay.undo_trial()  # the undone updates train again on their own batches
        if self.trainer.is_world_process_zero():
            logger.warning(f"hf_hybrid: a learning rate {tried / self.scale.scale:.2g}x higher did not pay over the "
                           f"steps since it was raised; undone ({undone} updates), back to {self.learning_rate:.2g}.")

    @property
    def learning_rate(self) -> float:
        return self.user_base_lrs[0] * self.scale.scale

    def summary(self) -> str | None:
        """The end line (autopilot/end_line.py)."""
        return end_line(self.scale, RunEnd(
            user_lr=self.user_base_lrs[0], opposed_at=self.alignment.mean if self.alignment.opposed else None,
            cooldown_steps=self.trainer.state.max_steps - self._cooldown_start() if self._cooling() else None,
            readings=self.readings_here, reading_seconds=self.reading_seconds,
            train_seconds=time.perf_counter() - self.train_started))

    def stats(self) -> dict:
        """For `hybrid_stats()`: the scale's counts and the first steps' alignment."""
        return {**self.scale.stats(), "lr_start_alignment": self.alignment.mean}

    def log_metrics(self) -> dict[str, float]:
        """The scale the next step uses: the judged one, on its way there, or on its way back to 1 in the cooldown."""
        return {"hybrid/lr_scale": float(self._scale_in_effect())}

    def state_dict(self) -> dict:
        return {"scale": self.scale.state_dict(), "user_base_lrs": list(self.user_base_lrs),
                "last_reading": self.last_reading, "read_every": self.read_every,
                "probe": move_batch(self.probe, "cpu"), "alignment": self.alignment.state_dict(),
                "ramp": self.ramp.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        # The scheduler's own state, loaded with the checkpoint, holds the scaled base LRs.
        self.scale.load_state_dict(state["scale"])
        self.user_base_lrs, self.last_reading = state["user_base_lrs"], state["last_reading"]
        self.read_every = state["read_every"]
        self.alignment.load_state_dict(state["alignment"], self.trainer.hybrid_engine.params)
        self.ramp.load_state_dict(state["ramp"])
        self.probe = move_batch(state["probe"], self.trainer.args.device)


def build_autopilot(trainer: HybridTrainer, guard_loop: GuardAtLoop | None) -> LrAutopilot | None:
    """The run's autopilot when `--hybrid_lr_autopilot` asks for it and the run has what it needs; otherwise None,
    with one line saying why."""
    missing = lr_autopilot_missing(trainer.hybrid_config)
    if missing is None:
        return None
    if reason := unscalable_schedule(trainer):
        missing.append(reason)
    if reason := unreadable_optimizer(trainer.optimizer):
        missing.append(reason)
    if missing:
        if trainer.is_world_process_zero():
            logger.warning(f"hf_hybrid: the learning-rate autopilot is off for this run: it needs "
                           f"{'; '.join(missing)}.")
        return None
    return LrAutopilot(trainer, guard_loop)
