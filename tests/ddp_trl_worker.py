"""Run under `accelerate launch --num_processes 2`: one of TRL's trainers and its hybrid, then each rank's weight hashes
and TRL's logged token counts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.ddp_worker import weights_hash  # noqa: E402
from tests.test_trl import _trl_run  # noqa: E402


def main(out_dir: str, kind: str) -> None:
    result = {}
    for hybrid in (False, True):
        trainer = _trl_run(Path(out_dir), kind, hybrid=hybrid, learning_rate=1e-4)
        trainer.train()
        result[str(hybrid)] = {
            "world_size": trainer.args.world_size,
            "tokens": [h["num_tokens"] for h in trainer.state.log_history if "num_tokens" in h],
            "final": weights_hash(trainer.model),
            "stats": trainer.hybrid_stats() if hybrid else None,
        }
    Path(out_dir, f"rank{trainer.args.process_index}.json").write_text(json.dumps(result))
    # Tear the gloo group down before exit; otherwise a rank can abort at interpreter shutdown.
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main(*sys.argv[1:])
