"""Two gloo processes on the CPU: ranks stay bit-identical after every Predict step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("ddp_worker.py")


def test_two_process_ddp_ranks_identical_after_predict(tmp_path):
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(WORKER), str(tmp_path)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["world_size"] == 2
    assert ranks[0]["stats"]["predict_steps"] > 0
    assert len(ranks[0]["after_predict"]) == ranks[0]["stats"]["predict_steps"]
    assert ranks[0]["after_predict"] == ranks[1]["after_predict"]
    assert ranks[0]["final"] == ranks[1]["final"]
    assert ranks[0]["stats"] == ranks[1]["stats"]
