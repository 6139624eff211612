"""Two gloo processes on the CPU: ranks stay bit-identical after every Predict step, and through guard events that
only one rank's data caused."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from .two_ranks import free_port, run_two_ranks

HERE = Path(__file__).parent


def launch_two_ranks(worker: str, out_dir: Path, *worker_args: str) -> list[dict]:
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--main_process_port", str(free_port()), "--mixed_precision", "no",
           "--dynamo_backend", "no", str(HERE / worker), str(out_dir), *worker_args]
    return run_two_ranks(cmd, out_dir, env)


def test_two_process_ddp_ranks_identical_after_predict(tmp_path):
    ranks = launch_two_ranks("ddp_worker.py", tmp_path)
    assert ranks[0]["world_size"] == 2
    assert ranks[0]["stats"]["predict_steps"] > 0
    assert len(ranks[0]["after_predict"]) == ranks[0]["stats"]["predict_steps"]
    assert ranks[0]["after_predict"] == ranks[1]["after_predict"]
    assert ranks[0]["final"] == ranks[1]["final"]
    assert ranks[0]["stats"] == ranks[1]["stats"]


def test_under_torch_compile_ddp_stays_in_the_loop_and_the_side_forwards_compile_nothing_again(tmp_path):
    # The by-sequence probe once asked accelerate to unwrap the compiled model, which swapped DDP out of it for the
    # rest of the run; the side forwards now run the training graph under `no_sync`, with the probe's item count.
    ranks = launch_two_ranks("ddp_compile_worker.py", tmp_path)
    stats = ranks[0]["stats"]
    assert stats["lr_readings"] >= 2 and stats["lr_raises_kept"] >= 1 and stats["predict_steps"] >= 1, stats
    assert all(rank["through_ddp"] for rank in ranks)
    assert ranks[0]["final"] == ranks[1]["final"] and ranks[0]["stats"] == ranks[1]["stats"]
    assert ranks[0]["recompiles"] == ranks[1]["recompiles"] == []
    assert all(rank["control_logged"] for rank in ranks)  # the log caught the no-grad forward after training


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_trls_trainers_under_ddp_keep_ranks_identical_and_count_only_training_tokens(tmp_path, kind):
    # TRL gathers its token count and metrics across ranks inside compute_loss, a collective the hybrid's readings
    # also reach on every rank: the ranks must stay in step, and the logged count be the plain TRL trainer's.
    pytest.importorskip("trl")
    ranks = launch_two_ranks("ddp_trl_worker.py", tmp_path, kind)
    plain, hybrid = ranks[0]["False"], ranks[0]["True"]
    assert hybrid["world_size"] == 2 and hybrid["stats"]["lr_readings"] >= 1
    assert hybrid["tokens"] == plain["tokens"] and len(plain["tokens"]) == 6
    assert ranks[0] == ranks[1]  # every rank: the same weights, statistics and counts, plain and hybrid


def test_two_process_ddp_ranks_take_the_same_guard_decisions(tmp_path):
    ranks = launch_two_ranks("ddp_guard_worker.py", tmp_path)
    assert ranks[0]["world_size"] == 2
    stats = ranks[0]["stats"]
    # The spike rolls back on both ranks; rank 1's NaN is skipped on both.
    assert stats["guard_rollbacks"] == 1 and stats["non_finite"] == 1 and stats["skipped_steps"] == 2
    assert ranks[0]["stats"] == ranks[1]["stats"]
    assert ranks[0]["hashes"] == ranks[1]["hashes"]


def test_the_defaults_on_two_ranks_keep_them_identical_and_resume_exactly(tmp_path):
    """The outer predictor, the learning-rate autopilot and the guard: a raise tried, jumps kept and rolled back, a
    guard skip (rank 1's NaN) and a guard rollback (a spike on both), ranks identical after every step; the guard's
    outer state (anchor and momentum) and the guard's snapshot, which stands on the anchor, held by rank 0 alone and
    broadcast at a jump and a rollback; one copy of the parameter-sized state per checkpoint; a
    two-rank resume from a checkpoint between the guard's rollback and its
    skip ends bit for bit where the uninterrupted run ends."""
    full = launch_two_ranks("ddp_defaults_worker.py", tmp_path / "full")
    assert full[0]["stats"] == full[1]["stats"] and full[0]["hashes"] == full[1]["hashes"]
    stats, events = full[0]["stats"], full[0]["events"]
    assert stats["predictions_kept"] >= 1 and stats["predictions_judged"] > stats["predictions_kept"]
    assert stats["guard_rollbacks"] == 1 and stats["non_finite"] == 1, events
    # Rank 0 alone holds the outer anchor and momentum and the guard's moments (2x the parameters each); at a cycle's
    # start the guard's snapshot stands on the anchor, and a raise's undo point (a copy of its own) adds 1x.
    param_bytes = full[0]["param_bytes"]
    rank0, rank1 = full[0]["placement"], full[1]["placement"]
    assert len(rank0) == len(rank1) > 0
    assert all(r["guard_bytes"] == r["outer_bytes"] == 0 for r in rank1)
    assert all(r["outer_bytes"] <= 2 * param_bytes for r in rank0) and rank0[-1]["outer_bytes"] == 2 * param_bytes
    on_anchor = [a["on_anchor"] and b["on_anchor"] and a["is_the_anchor"] for a, b in zip(rank0, rank1)]
    assert any(on_anchor) and not all(on_anchor), on_anchor
    assert all(r["guard_bytes"] == (2 if shared else 3) * param_bytes for r, shared in zip(rank0, on_anchor))
    autopilot = full[0]["lr_autopilot"]
    assert autopilot == full[1]["lr_autopilot"] and autopilot["user_base_lrs"][0] == 2e-3
    assert autopilot["scale"]["raises_kept"] + autopilot["scale"]["trials_undone"] >= 1, autopilot
    checkpoints = sorted((tmp_path / "full").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    for checkpoint in checkpoints:
        names = {p.name for p in checkpoint.iterdir()}
        assert {"hybrid_tensors.pt", "hybrid_state_rank0.pt", "hybrid_state_rank1.pt"} <= names
        assert not any(n.startswith("hybrid_tensors_rank") for n in names)
    guard_rollback = next(step for step, _, _, guard in events if guard == "rollback")
    nan_skip = next(step for step, _, _, guard in events if guard == "skip" and step > guard_rollback)
    resume_at = next(c for c in checkpoints if guard_rollback < int(c.name.split("-")[1]) < nan_skip)
    resumed = launch_two_ranks("ddp_defaults_worker.py", tmp_path / "resumed", str(resume_at))
    assert resumed[0]["hashes"][-1] == resumed[1]["hashes"][-1] == full[0]["hashes"][-1]
    assert resumed[0]["stats"] == full[0]["stats"]
