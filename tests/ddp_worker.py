"""Run under `accelerate launch --num_processes 2`: hybrid training, then each rank's weight hashes."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import TrainerCallback  # noqa: E402

from tests.conftest import make_trainer  # noqa: E402


def weights_hash(model) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


class HashAfterPredict(TrainerCallback):
    def __init__(self) -> None:
        self.trainer = None
        self.hashes = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        record = self.trainer._hybrid.last_record
        if record.phase.value == "predict":
            self.hashes.append([state.global_step, weights_hash(model)])


def main(out_dir: str) -> None:
    recorder = HashAfterPredict()
    trainer = make_trainer(out_dir, max_steps=30, per_device_train_batch_size=4, use_cpu=True)
    trainer.add_callback(recorder)
    recorder.trainer = trainer
    trainer.train()
    rank = trainer.args.process_index
    result = {
        "world_size": trainer.args.world_size,
        "after_predict": recorder.hashes,
        "final": weights_hash(trainer.model),
        "stats": trainer.hybrid_stats(),
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    # Tear the gloo group down before exit; otherwise a rank can abort at interpreter shutdown.
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1])
