"""hf_hybrid: hybrid predictive training for the Hugging Face Trainer.

Swap `Trainer` for `HybridHFTrainer` (and optionally `TrainingArguments` for `HybridTrainingArguments`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .jumps.controller import Phase, PhaseController

if TYPE_CHECKING:
    from .config import HybridTrainingArguments
    from .trainer import HybridHFTrainer, HybridMixin
    from .trl_trainers import (
        HybridDPOConfig,
        HybridDPOTrainer,
        HybridKTOConfig,
        HybridKTOTrainer,
        HybridRewardConfig,
        HybridRewardTrainer,
        HybridSFTConfig,
        HybridSFTTrainer,
    )

__all__ = [
    "HybridDPOConfig",
    "HybridDPOTrainer",
    "HybridHFTrainer",
    "HybridKTOConfig",
    "HybridKTOTrainer",
    "HybridMixin",
    "HybridRewardConfig",
    "HybridRewardTrainer",
    "HybridSFTConfig",
    "HybridSFTTrainer",
    "HybridTrainingArguments",
    "Phase",
    "PhaseController",
]
__version__ = "0.1.0"
# What a run does: raised by every commit that changes any run's numbers (a decision, a default, a gate), and recorded
# in every benchmark report, so that a report measured before the change is told apart from a current one.
BEHAVIOUR_VERSION = 12

_LAZY = {
    "HybridTrainingArguments": "config",
    "HybridHFTrainer": "trainer",
    "HybridMixin": "trainer",
    "HybridSFTConfig": "trl_trainers",  # needs TRL, which the import names if it is missing
    "HybridSFTTrainer": "trl_trainers",
    "HybridDPOConfig": "trl_trainers",
    "HybridDPOTrainer": "trl_trainers",
    "HybridKTOConfig": "trl_trainers",
    "HybridKTOTrainer": "trl_trainers",
    "HybridRewardConfig": "trl_trainers",
    "HybridRewardTrainer": "trl_trainers",
}


def __getattr__(name: str) -> type:
    # transformers takes seconds to import; `hf_hybrid.jumps.controller` does not need it.
    if name in _LAZY:
        from importlib import import_module

        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'hf_hybrid' has no attribute {name!r}")
