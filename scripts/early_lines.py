"""The LR autopilot's line at every one of a run's first steps (issue 49): where a first descent reads long at any LR,
and how the reach separates a too-small LR from a good one once it ends. Tuning-half settings only.

    python scripts/early_lines.py --setting scratch-2x128-docs-constant --learning_rates 3e-4,1e-3,3e-3,1e-2 \
        --steps 40 --out docs/reports/issue49-early-lines-scratch-2x128-docs-constant.json

The plain Trainer at each LR; after every optimizer step, the probe (the run's first batch) is read at W, W + 4 steps
and W + 8 steps along Adam's next step, as autopilot/line.py reads it, and the weights are put back bit for bit. The
reach is in today's steps at the schedule's peak (autopilot/scale.py's units).
"""

from __future__ import annotations

import torch
from model_and_data import build_model_and_data, plain_training_args
from tuning_half import per_learning_rate

from hf_hybrid.autopilot.line import SPACING, _move_along_next_step, _step_groups
from hf_hybrid.autopilot.scale import reach_of_line


def early_lines(preset: dict, learning_rate: float, steps: int, out_dir: str) -> list[list[float]]:
    """[step, probe loss, reach, schedule factor] after each of the first `steps` optimizer steps."""
    from transformers import Trainer, TrainerCallback

    model, datasets, _ = build_model_and_data(preset, 0)
    args = plain_training_args(preset, learning_rate, out_dir)
    rows: list[list[float]] = []

    class Read(TrainerCallback):
        probe: dict | None = None

        @torch.no_grad()
        def on_step_end(self, args_, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
            if self.probe is None:
                batch = next(iter(trainer.get_train_dataloader()))
                self.probe = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
            scheduler = getattr(lr_scheduler, "scheduler", lr_scheduler)
            factor = min(f(scheduler.last_epoch) for f in scheduler.lr_lambdas)
            model.eval()
            weights = [p.detach().clone() for p in model.parameters()]
            groups = _step_groups(getattr(optimizer, "optimizer", optimizer), lists=False)
            losses = [float(model(**self.probe).loss)]
            for _ in range(2):
                _move_along_next_step(groups, SPACING)
                losses.append(float(model(**self.probe).loss))
            for p, w in zip(model.parameters(), weights):
                p.copy_(w)
            model.train()
            rows.append([state.global_step, losses[0], SPACING * reach_of_line(*losses) * factor, factor])
            if state.global_step >= steps:
                control.should_training_stop = True

    trainer = Trainer(model=model, args=args, train_dataset=datasets["train"], callbacks=[Read()])
    trainer.train()
    return rows


if __name__ == "__main__":
    per_learning_rate("early-lines", __doc__, early_lines, lambda row: f"{int(row[0])}:{row[2]:.3g}", default_steps=60)
