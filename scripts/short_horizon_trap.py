"""The short-horizon trap of tests/test_lr_cooldown.py over seeds and LRs (issue 49): a tiny GPT-2 from scratch at a
constant LR after a 10-step warmup, 400 updates of 4 sequences, held-out loss at the end; the plain Trainer against
the hybrid with its defaults, side by side at each (seed, LR).

    python scripts/short_horizon_trap.py --out docs/reports/issue49-short-horizon-trap.json

Seed s draws the model's init from s and the training and held-out sequences from 2s and 2s + 1 (seed 0 is the test's).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from transformers import Trainer, TrainingArguments

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from hf_hybrid import HybridHFTrainer, HybridTrainingArguments  # noqa: E402
from tests.conftest import tiny_gpt2, token_dataset  # noqa: E402


def from_scratch(learning_rate: float, hybrid: bool, seed: int, output_dir: Path, eval_steps: int = 400):
    """One arm: the plain Trainer or the hybrid with its defaults. Its held-out losses every `eval_steps`, and the
    trainer."""
    args = dict(output_dir=str(output_dir), learning_rate=learning_rate, max_steps=400, per_device_train_batch_size=4,
                warmup_steps=10, lr_scheduler_type="constant_with_warmup", weight_decay=0.1, eval_strategy="steps",
                eval_steps=eval_steps, logging_steps=1000, save_strategy="no", report_to="none", seed=seed,
                data_seed=seed, use_cpu=True, disable_tqdm=True)
    trainer_cls, args_cls = (HybridHFTrainer, HybridTrainingArguments) if hybrid else (Trainer, TrainingArguments)
    trainer = trainer_cls(model=tiny_gpt2(seed), args=args_cls(**args), eval_dataset=token_dataset(128, 2 * seed + 1),
                          train_dataset=token_dataset(512, seed=2 * seed))
    trainer.train()
    return [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h], trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", default="0:4e-3,1:4e-3,2:4e-3,0:1e-3,0:2e-3,0:8e-3", help="seed:lr,...")
    parser.add_argument("--out", default="runs/short-horizon-trap.json")
    parser.add_argument("--output_dir", default="runs/short-horizon-trap")
    args = parser.parse_args()
    rows = []
    for pair in args.pairs.split(","):
        seed, lr = int(pair.split(":")[0]), float(pair.split(":")[1])
        trainer_loss = from_scratch(lr, False, seed, Path(args.output_dir) / "trainer")[0][-1]
        hybrid_losses, hybrid = from_scratch(lr, True, seed, Path(args.output_dir) / "hybrid")
        hybrid_loss, stats = hybrid_losses[-1], hybrid.hybrid_stats()
        rows.append(dict(seed=seed, learning_rate=lr, trainer=trainer_loss, hybrid=hybrid_loss,
                         lr_scale=stats["lr_scale"], raises_kept=stats["lr_raises_kept"]))
        print(f"seed {seed} lr {lr:g}: Trainer {trainer_loss:.4f}, hybrid {hybrid_loss:.4f} "
              f"({hybrid_loss - trainer_loss:+.4f}; scale {stats['lr_scale']:g})", flush=True)
    sys.path.insert(0, str(ROOT / "scripts"))
    from environment import environment

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(command=" ".join(sys.argv), rows=rows, environment=environment()),
                                         indent=1))


if __name__ == "__main__":
    main()
