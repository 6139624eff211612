"""Evidence about the learning rate inside a run's warmup (issue 49): does the path the weights take tell a too-small
LR from a good one before any raise may start? Tuning-half settings only.

    python scripts/warmup_evidence.py --setting scratch-2x128-docs-constant --learning_rates 3e-4,1e-3,3e-3,1e-2 \
        --steps 40 --out docs/reports/issue49-warmup-evidence-scratch-2x128-docs-constant.json

The plain Trainer at each LR; after every optimizer step, from the weights and the gradient (no extra forward):
- straightness: the distance from the start over the path's length, |x_t - x_0| / sum |x_i - x_i-1|. Adam's steps
  have about the same size per coordinate at any LR, so a path that keeps its direction (1) is one whose steps are too
  short for the curvature they meet, and one that turns back (towards 0) has met it. The quantity Prodigy and
  Mechanic grow their scale on is of this kind: the gradient's alignment with the displacement since the start.
- turn: the cosine between the step just taken and the one before it.
- alignment: the cosine between the gradient the step was taken on and the displacement since the start, negated:
  positive while the gradient still points on along the way already come (the sign Mechanic grows its scale on),
  negative once it points back.
"""

from __future__ import annotations

import torch
from model_and_data import build_model_and_data, plain_training_args
from tuning_half import per_learning_rate


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters() if p.requires_grad])


def warmup_path(preset: dict, learning_rate: float, steps: int, out_dir: str) -> list[list[float]]:
    """[step, straightness, turn, alignment] after each of the first `steps` optimizer steps."""
    from transformers import Trainer, TrainerCallback

    model, datasets, _ = build_model_and_data(preset, 0)
    args = plain_training_args(preset, learning_rate, out_dir)
    rows: list[list[float]] = []

    class Path_(TrainerCallback):
        start: torch.Tensor | None = None
        last: torch.Tensor | None = None
        last_step: torch.Tensor | None = None
        length = 0.0
        alignment = 0.0

        def on_train_begin(self, args_, state, control, model=None, **kwargs):
            self.start = self.last = flat(model)

        @torch.no_grad()
        def on_pre_optimizer_step(self, args_, state, control, model=None, **kwargs):
            grad = torch.cat([p.grad.reshape(-1).float() for p in model.parameters() if p.requires_grad])
            away = flat(model) - self.start
            self.alignment = -float(torch.nn.functional.cosine_similarity(grad, away, dim=0)) if away.any() else 0.0

        @torch.no_grad()
        def on_step_end(self, args_, state, control, model=None, **kwargs):
            now = flat(model)
            step = now - self.last
            self.length += float(step.norm())
            turn = float(torch.nn.functional.cosine_similarity(step, self.last_step, dim=0)) \
                if self.last_step is not None else 1.0
            rows.append([state.global_step, float((now - self.start).norm()) / max(self.length, 1e-30), turn,
                         self.alignment])
            self.last, self.last_step = now, step
            if state.global_step >= steps:
                control.should_training_stop = True

    trainer = Trainer(model=model, args=args, train_dataset=datasets["train"], callbacks=[Path_()])
    trainer.train()
    return rows


if __name__ == "__main__":
    per_learning_rate("warmup-evidence", __doc__, warmup_path,
                      lambda row: f"{int(row[0])}:{row[1]:.2f}/{row[2]:.2f}/{row[3]:.2f}", default_steps=40)
