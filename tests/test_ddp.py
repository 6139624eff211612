"""Two gloo processes on the CPU: ranks stay bit-identical after every Predict step, and through guard events that
only one rank's data caused."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .two_ranks import run_two_ranks

HERE = Path(__file__).parent


def launch_two_ranks(worker: str, out_dir: Path) -> list[dict]:
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(HERE / worker),
           str(out_dir)]
    return run_two_ranks(cmd, out_dir, env)


def test_two_process_ddp_ranks_identical_after_predict(tmp_path):
    ranks = launch_two_ranks("ddp_worker.py", tmp_path)
    assert ranks[0]["world_size"] == 2
    assert ranks[0]["stats"]["predict_steps"] > 0
    assert len(ranks[0]["after_predict"]) == ranks[0]["stats"]["predict_steps"]
    assert ranks[0]["after_predict"] == ranks[1]["after_predict"]
    assert ranks[0]["final"] == ranks[1]["final"]
    assert ranks[0]["stats"] == ranks[1]["stats"]


def test_two_process_ddp_ranks_take_the_same_guard_decisions(tmp_path):
    ranks = launch_two_ranks("ddp_guard_worker.py", tmp_path)
    assert ranks[0]["world_size"] == 2
    stats = ranks[0]["stats"]
    # The spike rolls back on both ranks; rank 1's NaN is skipped on both.
    assert stats["guard_rollbacks"] == 1 and stats["non_finite"] == 1 and stats["skipped_steps"] == 2
    assert ranks[0]["stats"] == ranks[1]["stats"]
    assert ranks[0]["hashes"] == ranks[1]["hashes"]
