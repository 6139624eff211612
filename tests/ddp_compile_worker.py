"""Run under `accelerate launch --num_processes 2`: `--torch_compile` (dynamo's `eager` backend) with readings, a
raise's verdict and jumps; each rank's weight hash, whether the trained model still runs through DDP, and dynamo's
recompile log."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tests.conftest import make_trainer, token_dataset  # noqa: E402
from tests.ddp_worker import weights_hash  # noqa: E402
from tests.test_lr_advice import OUTER  # noqa: E402


def main(out_dir: str) -> None:
    recompiles = []

    class Recompiles(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("Recompiling"):
                recompiles.append(record.getMessage())

    torch._logging.set_logs(recompiles=True)
    logging.getLogger("torch._dynamo").addHandler(Recompiles())
    trainer = make_trainer(out_dir, learning_rate=1e-3, torch_compile=True, torch_compile_backend="eager",
                           use_cpu=True, **{**OUTER, "max_steps": 40})
    trainer.train()
    in_training = list(recompiles)
    with torch.no_grad():  # the log's control: a forward that differs from a training step's is logged as a recompile
        trainer.model_wrapped(input_ids=torch.tensor(token_dataset(8)[:]["input_ids"]))
    wrapped = getattr(trainer.model_wrapped, "_orig_mod", trainer.model_wrapped)
    result = {"final": weights_hash(trainer.model), "stats": trainer.hybrid_stats(), "recompiles": in_training,
              "control_logged": len(recompiles) > len(in_training),
              "through_ddp": isinstance(wrapped, torch.nn.parallel.DistributedDataParallel)}
    Path(out_dir, f"rank{trainer.args.process_index}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
