"""Which survey runs the first steps' alignment (hf_hybrid/autopilot/alignment.py) calls aligned: the hybrid as the
survey runs it, per setting and LR of its check grid (the user's LR to about 3x the swept), stopped once the window has
closed. A run that reads below the gate takes the same decisions as before the alignment existed (a raise needs the
line twice, 2x at most), so its reports stand at the new behaviour version; one above it must run again.

    python scripts/start_alignment.py --settings scratch-2x128-docs-constant,finetune-docs-linear \
        --out docs/reports/issue49-start-alignment.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from model_and_data import build_model_and_data  # noqa: E402
from survey import settings, user_and_swept_lr  # noqa: E402


def start_alignment(preset: dict, learning_rate: float, out_dir: str) -> dict:
    """The library's alignment and verdict for the hybrid at `learning_rate`, trained only through the window."""
    from transformers import TrainerCallback

    from hf_hybrid import HybridHFTrainer, HybridTrainingArguments
    from hf_hybrid.autopilot.alignment import LAST_STEP

    class StopAfterWindow(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step >= LAST_STEP

    model, datasets, _ = build_model_and_data(preset, 0)
    args = HybridTrainingArguments(
        output_dir=out_dir, max_steps=preset["max_steps"], per_device_train_batch_size=preset["batch_size"],
        gradient_accumulation_steps=preset["grad_accum"], learning_rate=learning_rate,
        lr_scheduler_type=preset["scheduler"], lr_scheduler_kwargs=preset["scheduler_kwargs"],
        warmup_steps=preset["warmup_steps"], weight_decay=preset["weight_decay"], optim=preset["optim"],
        save_strategy="no", report_to="none", seed=0, data_seed=0, disable_tqdm=True, use_cpu=True,
        logging_steps=10**6, **preset["hybrid"])
    trainer = HybridHFTrainer(model=model, args=args, train_dataset=datasets["train"], callbacks=[StopAfterWindow()])
    trainer.train()
    alignment = trainer._lr_autopilot.alignment
    return {"alignment": alignment.mean, "aligned": alignment.aligned}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", required=True, help="comma-separated survey settings")
    parser.add_argument("--reports", default=str(HERE.parent / "docs" / "survey"))
    parser.add_argument("--out", default="runs/start_alignment.json")
    args = parser.parse_args()
    from hf_hybrid.autopilot.alignment import ALIGNED

    rows = []
    for name in args.settings.split(","):
        preset = settings()[name]
        user, swept = user_and_swept_lr(name, Path(args.reports))
        for lr in [lr for lr in preset["grid"] if user * 0.99 <= lr <= swept * 3.5]:
            row = {"setting": name, "half": preset["half"], "learning_rate": lr,
                   **start_alignment(preset, lr, f"runs/start_alignment/{name}-{lr:g}")}
            print(f"{name} {lr:g}: alignment {row['alignment']:.3f}, aligned {row['aligned']}", flush=True)
            rows.append(row)
    command = f"python scripts/start_alignment.py --settings {args.settings} --out {args.out}"
    Path(args.out).write_text(json.dumps({"command": command, "gate": ALIGNED, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
