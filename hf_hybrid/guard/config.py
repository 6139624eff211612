"""The guard's settings, read once from the flags (their defaults and documentation: `HybridTrainingArguments`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..flags import FlagSettings, flag


@dataclass(frozen=True)
class GuardConfig(FlagSettings):
    enabled: bool = flag("hybrid_guard")
    window: int = flag("hybrid_guard_window")
    threshold: float = flag("hybrid_guard_threshold")
    max_skips: int = flag("hybrid_guard_max_skips")
    snapshot_steps: int = flag("hybrid_guard_snapshot_steps")
    max_rollbacks: int = flag("hybrid_guard_max_rollbacks")

    def __post_init__(self) -> None:
        self.at_least(1, "window", "max_skips")
        self.at_least(0, "snapshot_steps", "max_rollbacks")
        self.positive("threshold")

    @property
    def snapshots(self) -> bool:
        """Whether the guard takes rollback snapshots (the undo point the LR autopilot's raises need too)."""
        return self.enabled and self.snapshot_steps > 0
