"""Mechanic's learned multiplier, step by step (issue 49): the learning rate Mechanic puts in effect inside a run's
warmup and first descent, where the autopilot cannot yet tell a too-small LR from a good one from scratch. Tuning-half
settings only.

    python scripts/mechanic_scale.py --setting scratch-2x64-shakespeare-cosine --learning_rates 1 --steps 60 \
        --out docs/reports/issue49-mechanic-scale-scratch-2x64-shakespeare-cosine.json

`mechanize(AdamW)` at lr 1.0 under the setting's schedule, as the survey's Mechanic arm runs it (the LR given is the
base AdamW's, 1 there). After every optimizer step: [step, s, the schedule's factor, s x the factor]: the last is the
learning rate Mechanic's steps were taken at, to set beside the setting's swept LR.
"""

from __future__ import annotations

import torch
from model_and_data import build_model_and_data, plain_training_args
from tuning_half import per_learning_rate


def mechanic_path(preset: dict, learning_rate: float, steps: int, out_dir: str) -> list[list[float]]:
    from mechanic_pytorch import mechanize
    from transformers import Trainer, TrainerCallback

    model, datasets, _ = build_model_and_data(preset, 0)
    args = plain_training_args(preset, learning_rate, out_dir)
    rows: list[list[float]] = []

    class Scale(TrainerCallback):
        def on_step_end(self, args_, state, control, optimizer=None, **kwargs):
            inner = getattr(optimizer, "optimizer", optimizer)
            s = float(torch.sum(inner.state["_mechanic"]["s"]))
            factor = float(inner.param_groups[0]["lr"]) / learning_rate
            rows.append([state.global_step, s, factor, s * factor * learning_rate])
            if state.global_step >= steps:
                control.should_training_stop = True

    trainer = Trainer(model=model, args=args, train_dataset=datasets["train"], callbacks=[Scale()],
                      optimizer_cls_and_kwargs=(mechanize(torch.optim.AdamW),
                                                dict(lr=learning_rate, weight_decay=preset["weight_decay"])))
    trainer.train()
    return rows


if __name__ == "__main__":
    per_learning_rate("mechanic-scale", __doc__, mechanic_path, lambda row: f"{int(row[0])}:{row[3]:.2g}",
                      default_steps=60)
