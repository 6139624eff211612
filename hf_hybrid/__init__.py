"""hf_hybrid: hybrid predictive training for the Hugging Face Trainer.

Swap `Trainer` for `HybridHFTrainer` (and optionally `TrainingArguments` for `HybridTrainingArguments`).
"""

from .config import HybridTrainingArguments
from .controller import Phase, PhaseController
from .trainer import HybridHFTrainer, HybridMixin

__all__ = ["HybridHFTrainer", "HybridMixin", "HybridTrainingArguments", "Phase", "PhaseController"]
__version__ = "0.1.0"
