"""Run under `accelerate launch --config_file recipes/accelerate/fsdp2.yaml` on a GPU: `HybridHFTrainer` with FSDP2."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from tests.conftest import make_trainer  # noqa: E402
from tests.fsdp2_worker import CollectiveCounter  # noqa: E402


def full_params(model) -> torch.Tensor:
    return torch.cat([(p.full_tensor() if isinstance(p, DTensor) else p).detach().reshape(-1).float().cpu()
                      for p in model.parameters()])


class PredictWatch(TrainerCallback):
    """Whether each kept Predict step moved the weights, and the collectives run while applying its delta."""

    def __init__(self) -> None:
        self.trainer = None
        self.before = None
        self.moved = 0
        self.kept = 0
        self.collectives = 0
        self.applied = 0

    def on_train_begin(self, args, state, control, **kwargs):
        engine = self.trainer._hybrid
        apply = engine.apply_prediction

        def counted(*args, **kwargs):
            counter = CollectiveCounter()
            with counter:
                apply(*args, **kwargs)
            self.collectives += counter.count
            self.applied += 1

        engine.apply_prediction = counted

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.before = full_params(model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        record = self.trainer._hybrid.last_record
        if record.phase.value == "predict" and not record.rollback:
            self.kept += 1
            self.moved += not torch.equal(self.before, full_params(model))


def main(out_dir: str, predictor: str) -> None:
    watch = PredictWatch()
    trainer = make_trainer(out_dir, max_steps=40, use_cpu=False, bf16=True, hybrid_predictor=predictor)
    trainer.add_callback(watch)
    watch.trainer = trainer
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    params = list(trainer.model_wrapped.parameters())
    plugin = trainer.accelerator.state.fsdp_plugin
    result = {
        "distributed_type": str(trainer.accelerator.distributed_type),
        "is_fsdp_enabled": trainer.is_fsdp_enabled,
        "world_size": trainer.args.world_size,
        "fsdp_version": plugin.fsdp_version if plugin is not None else None,
        "param_types": sorted({type(p).__name__ for p in params}),
        "engine_param_types": sorted({type(p).__name__ for p in trainer._hybrid.params}),
        "predict_steps": trainer.hybrid_stats()["predict_steps"],
        "predict_steps_kept": watch.kept,
        "moved_on_predict": watch.moved,
        "apply_collectives": watch.collectives,
        "apply_calls": watch.applied,
        "finite": bool(all(torch.isfinite(full_params(trainer.model_wrapped)))),
        "first_loss": losses[0],
        "last_loss": losses[-1],
    }
    Path(out_dir, f"rank{trainer.args.process_index}.json").write_text(json.dumps(result))
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
