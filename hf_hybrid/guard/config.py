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
        for name in ("window", "max_skips"):
            self.require(name, getattr(self, name) >= 1, "must be >= 1")
        for name in ("snapshot_steps", "max_rollbacks"):
            self.require(name, getattr(self, name) >= 0, "must be >= 0")
        self.require("threshold", self.threshold > 0, "must be > 0")

    @property
    def snapshots(self) -> bool:
        """Whether the guard takes rollback snapshots (the undo point the LR autopilot's raises need too)."""
        return self.enabled and self.snapshot_steps > 0
