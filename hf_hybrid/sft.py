"""TRL's supervised fine-tuning with hybrid phases: `HybridSFTTrainer` and `HybridSFTConfig`, one import away.

Imported lazily by `hf_hybrid` (only TRL users pay for importing TRL); without TRL installed, importing either names the
package to install.
"""

from __future__ import annotations

from dataclasses import dataclass

try:
    import trl
except ImportError as err:
    raise ImportError(
        "HybridSFTTrainer and HybridSFTConfig need TRL, which is not installed: pip install trl "
        "(or pip install 'hf-hybrid[trl]')."
    ) from err

from .config import HybridTrainingArguments
from .trainer import HybridMixin


# SFTConfig first: dataclass fields are collected along the reversed MRO, and HybridTrainingArguments carries every
# TrainingArguments field with the TrainingArguments default. The other order would silently undo TRL's own
# defaults (learning_rate 2e-5, logging_steps 10, gradient_checkpointing, bf16). Either order is a
# HybridTrainingArguments, so the mixin reads the hybrid flags and __post_init__ validates them.
@dataclass
class HybridSFTConfig(trl.SFTConfig, HybridTrainingArguments):
    """`trl.SFTConfig` with the `hybrid_*` fields of `HybridTrainingArguments`; TRL's defaults win."""


class HybridSFTTrainer(HybridMixin, trl.SFTTrainer):
    """A drop-in `trl.SFTTrainer` with Warmup, Full, Predict and Correct phases and the guard."""
