"""Run under `accelerate launch --num_processes 2`: the guard with a NaN that only rank 1 sees and a learning-rate
spike on both; then each rank's weight hashes after every step."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from faults import FaultPlan, LearningRateSpike, with_faults  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from hf_hybrid import HybridHFTrainer  # noqa: E402
from tests.conftest import hybrid_args, tiny_gpt2, token_dataset  # noqa: E402
from tests.ddp_worker import weights_hash  # noqa: E402
from tests.test_guard import GUARD, SPIKE  # noqa: E402


class HashEveryStep(TrainerCallback):
    def __init__(self) -> None:
        self.hashes = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.hashes.append([state.global_step, weights_hash(model)])


def main(out_dir: str) -> None:
    args = hybrid_args(out_dir, max_steps=40, per_device_train_batch_size=4, **{**GUARD, "hybrid_predict": False})
    rank = args.process_index
    plan = FaultPlan(nan_step=34 if rank == 1 else None)
    trainer = with_faults(HybridHFTrainer, plan)(model=tiny_gpt2(), args=args, train_dataset=token_dataset())
    trainer.add_callback(LearningRateSpike(20, SPIKE))
    recorder = HashEveryStep()
    trainer.add_callback(recorder)
    trainer.train()
    result = {"world_size": args.world_size, "hashes": recorder.hashes, "stats": trainer.hybrid_stats()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1])
