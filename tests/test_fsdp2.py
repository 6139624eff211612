"""FSDP2 on the CPU (2 gloo processes): predicted deltas (the outer jump, the default, included), snapshots and
rollbacks, the guard's among them, work on each rank's local shards, with no collective, and land every weight where
the unsharded computation puts it. The only communication is the
residual fit's one small all-reduce per Correct step."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from .two_ranks import free_port, run_two_ranks

WORKER = Path(__file__).with_name("fsdp2_worker.py")


@pytest.mark.parametrize("predictor", ["velocity", "adam", "outer"])
def test_engine_on_fsdp2_shards_needs_no_communication(tmp_path, predictor):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(WORKER), str(tmp_path), predictor]
    ranks = run_two_ranks(cmd, tmp_path, env)
    for rank in ranks:
        assert rank["world_size"] == 2 and rank["dtensor_params"]
        assert rank["local_fraction"] <= 0.6, "each rank should hold about half of the weights"
        assert rank["predict_steps"] >= 5 and rank["rolled_back"]
        assert rank["guard_skipped"] and rank["guard_restored"]
        assert rank["counter_sees_a_gather"] and rank["gathered_finite"]
        collectives = rank["engine_collectives"]
        assert collectives["predict"] == collectives["other"] == 0, "a DTensor op gathered or reduced"
        # The outer jump has no Correct step, so no residual fit.
        assert (rank["correct_steps"] > 0) is (predictor != "outer")
        assert collectives["residual"] == rank["correct_steps"]
        assert rank["max_abs_diff"] < 1e-6, "sharded weights left the unsharded reference"
