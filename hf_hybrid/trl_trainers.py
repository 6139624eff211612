"""TRL's trainers with hybrid phases, one import away: `HybridSFTTrainer` / `HybridSFTConfig` for supervised
fine-tuning, `HybridDPOTrainer` / `HybridDPOConfig` and `HybridKTOTrainer` / `HybridKTOConfig` for preference tuning,
and `HybridRewardTrainer` / `HybridRewardConfig` for reward models. TRL's online trainers (GRPO, RLOO) are not paired
here: through the mixin they get the non-finite step veto alone (launch.py says why).

Imported lazily by `hf_hybrid` (only TRL users pay for importing TRL); without TRL installed, importing any of them
names the package to install.
"""

from __future__ import annotations

from dataclasses import dataclass

try:
    import trl
except ImportError as err:
    raise ImportError(
        "HybridSFTTrainer, HybridDPOTrainer, HybridKTOTrainer, HybridRewardTrainer and their configs need TRL, which "
        "is not installed: pip install trl (or pip install 'hf-hybrid[trl]')."
    ) from err

from .config import HybridTrainingArguments
from .trainer import HybridMixin


# TRL's config first: dataclass fields are collected along the reversed MRO, and HybridTrainingArguments carries every
# TrainingArguments field with the TrainingArguments default. The other order would silently undo TRL's own
# defaults (SFT: learning_rate 2e-5, logging_steps 10, gradient_checkpointing, bf16; DPO: learning_rate 1e-6). Either
# order is a HybridTrainingArguments, so the mixin reads the hybrid flags and __post_init__ validates them.
@dataclass
class HybridSFTConfig(trl.SFTConfig, HybridTrainingArguments):
    """`trl.SFTConfig` with the `hybrid_*` fields of `HybridTrainingArguments`; TRL's defaults win."""


class HybridSFTTrainer(HybridMixin, trl.SFTTrainer):
    """A drop-in `trl.SFTTrainer` with Warmup, Full, Predict and Correct phases and the guard."""


@dataclass
class HybridDPOConfig(trl.DPOConfig, HybridTrainingArguments):
    """`trl.DPOConfig` with the `hybrid_*` fields of `HybridTrainingArguments`; TRL's defaults win."""


class HybridDPOTrainer(HybridMixin, trl.DPOTrainer):
    """A drop-in `trl.DPOTrainer` with the hybrid's phases and the guard. DPO's loss is over chosen-rejected pairs,
    which the probe cannot split by sequence, so a jump's and a raise's noise margin is 0 there."""


@dataclass
class HybridKTOConfig(trl.KTOConfig, HybridTrainingArguments):
    """`trl.KTOConfig` with the `hybrid_*` fields of `HybridTrainingArguments`; TRL's defaults win."""


class HybridKTOTrainer(HybridMixin, trl.KTOTrainer):
    """A drop-in `trl.KTOTrainer` with the hybrid's phases and the guard. KTO's loss is over desirable and undesirable
    completions against a batch-level KL term, which the probe cannot split by sequence: the noise margin is 0 there."""


@dataclass
class HybridRewardConfig(trl.RewardConfig, HybridTrainingArguments):
    """`trl.RewardConfig` with the `hybrid_*` fields of `HybridTrainingArguments`; TRL's defaults win."""


class HybridRewardTrainer(HybridMixin, trl.RewardTrainer):
    """A drop-in `trl.RewardTrainer` with the hybrid's phases and the guard. Its pairwise loss carries no labels for
    the probe to split by sequence: the noise margin is 0 there."""
