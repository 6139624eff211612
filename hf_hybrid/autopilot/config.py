"""The LR autopilot's settings, read once from the flags (defaults and documentation: `HybridTrainingArguments`).
Its probe's noise margin is the payoff check's (`ChecksConfig.probe_noise_margin`), and its undo point the guard's
snapshot (`GuardConfig.snapshots`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..flags import FlagSettings, flag


@dataclass(frozen=True)
class AutopilotConfig(FlagSettings):
    enabled: bool = flag("hybrid_lr_autopilot")
