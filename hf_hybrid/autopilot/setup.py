"""What the learning-rate autopilot needs of a run (the flags, and a schedule that scales with its base learning rates),
and what `hybrid_stats()` reports where it is off."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from .scale import LrScale

if TYPE_CHECKING:
    from ..config import HybridConfig
    from ..jumps.lr_advice import AutopilotUse
    from ..loop.seam import HybridTrainer


def lr_autopilot_missing(config: HybridConfig) -> list[str] | None:
    """What the learning-rate autopilot asked for by the flags lacks to run: None when it is not asked for, else the
    list (empty: it runs)."""
    if not (config.enabled and config.autopilot.enabled):
        return None
    return [] if config.guard.snapshots else ["the guard's snapshots (the undo point): --hybrid_guard and "
                                 "--hybrid_guard_snapshot_steps > 0"]


def autopilot_use(config: HybridConfig, autopilot: object | None) -> AutopilotUse:
    """For the end lines (jumps/lr_advice.py): "on" where the run has an autopilot, "unavailable" where the flag asked
    for one and the run lacked what it needs, "off" where the flag turned it off."""
    return "on" if autopilot is not None else "unavailable" if lr_autopilot_missing(config) is not None else "off"


def inner_scheduler(trainer: HybridTrainer) -> LRScheduler:
    """The Trainer's scheduler itself, unwrapped from accelerate's."""
    return getattr(trainer.lr_scheduler, "scheduler", trainer.lr_scheduler)


def unscalable_schedule(trainer: HybridTrainer) -> str | None:
    """What the autopilot lacks in the Trainer's scheduler, or None where it scales with its base learning rates (a
    `LambdaLR`: every named schedule but `reduce_lr_on_plateau`), naming the scheduler the run has."""
    scheduler = inner_scheduler(trainer)
    if isinstance(scheduler, LambdaLR):  # not MultiplicativeLR, whose lambdas are each step's factor, not the schedule
        return None
    return (f"a schedule that scales with its base learning rate, a LambdaLR as every --lr_scheduler_type but "
            f"reduce_lr_on_plateau builds (this run's is a {type(scheduler).__name__})")


def plain_stats() -> dict:
    """`hybrid_stats()`'s autopilot keys where it is off: a fresh scale's (1.0, nothing tried), so that the keys never
    depend on the flags."""
    return {**LrScale().stats(), "lr_start_alignment": 0.0}
