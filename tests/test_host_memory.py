"""The rollback state's host memory: the bound the library states holds and is reached, a run that may not fit is told
once, in one line with a remedy, and the machine's available memory is read the way the kernel and a container's
cgroup limit it."""

from __future__ import annotations

import logging
import sys

import pytest
from transformers import TrainerCallback

from hf_hybrid import host_memory
from hf_hybrid.host_memory import available_host_bytes, rollback_state_bytes

from .conftest import make_trainer


def keep_every_jump(monkeypatch) -> None:
    from hf_hybrid.payoff import PayoffMeter

    original_verdict = PayoffMeter.verdict
    monkeypatch.setattr(PayoffMeter, "verdict", lambda self, gain, noise: original_verdict(self, 1e9, 0.0))


class HostBytes(TrainerCallback):
    def __init__(self) -> None:
        self.trainer, self.rows = None, []

    def on_step_end(self, args, state, control, **kwargs):
        engine, guard = self.trainer._hybrid, self.trainer._guard_loop
        self.rows.append(rollback_state_bytes(engine.predictor, guard.snapshot, engine.params))


def long_cycles(tmp_path, **overrides):
    """Outer cycles of 8 real steps with a guard snapshot due every 3 and a save at step 20: the guard takes copies
    of the weights of its own while the momentum of kept jumps exists."""
    return make_trainer(tmp_path, hybrid_predictor="outer", hybrid_outer_period=8, hybrid_guard_snapshot_steps=3,
                        hybrid_guard_window=16, hybrid_payoff_check=True, max_steps=40, save_strategy="steps",
                        save_steps=20, **overrides)


def test_the_rollback_state_never_holds_more_than_its_bound_and_reaches_it(tmp_path, monkeypatch):
    keep_every_jump(monkeypatch)
    trainer = long_cycles(tmp_path)
    recorder = HostBytes()
    recorder.trainer = trainer
    trainer.add_callback(recorder)
    trainer.train()
    assert trainer.hybrid_stats()["predict_steps"] >= 2
    final = recorder.rows[-1]
    # AdamW: the anchor and the momentum, both moments, and the guard's own copy of the weights.
    assert final.at_most == 5 * final.params and final.guard == 3 * final.params
    held = [row.held for row in recorder.rows]
    assert max(held) == final.at_most, held
    assert min(held) == 0 and sorted(set(held))[1:] == [k * final.params for k in (3, 4, 5)], sorted(set(held))


def test_a_run_whose_rollback_state_may_not_fit_is_told_once(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr("hf_hybrid.guard_loop.available_host_bytes", lambda: 1)
    with caplog.at_level(logging.WARNING, logger="hf_hybrid"):
        long_cycles(tmp_path / "short").train()
    lines = [r.getMessage() for r in caplog.records if "killed for memory" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "up to 0.0 GB of host memory (5.0x the parameters'" in lines[0]
    assert "this machine has 0.0 GB available" in lines[0] and "--hybrid_guard_snapshot_steps 0" in lines[0]
    caplog.clear()
    monkeypatch.setattr("hf_hybrid.guard_loop.available_host_bytes", lambda: 10**15)
    with caplog.at_level(logging.WARNING, logger="hf_hybrid"):
        long_cycles(tmp_path / "ample").train()
    assert not [r for r in caplog.records if "killed for memory" in r.getMessage()]


def test_every_rank_of_a_machine_counts_under_fsdp2_and_one_under_ddp(monkeypatch):
    size = host_memory.RollbackStateBytes(at_most=5_000_000_000, held=3_000_000_000, guard=3_000_000_000,
                                          params=1_000_000_000)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    sharded = host_memory.ranks_on_this_machine(replicated=False)
    assert host_memory.host_memory_warning(size, 16 * 10**9, sharded) is None
    line = host_memory.host_memory_warning(size, 15 * 10**9, sharded)
    assert "on each of this machine's 8 ranks" in line and "16.0 GB more than now" in line
    assert host_memory.host_memory_warning(size, 2 * 10**9, host_memory.ranks_on_this_machine(replicated=True)) is None
    assert host_memory.host_memory_warning(size, None, sharded) is None  # cannot be told: say nothing


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_available_host_memory_is_this_machines():
    total = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemTotal:"))
    assert 0 < available_host_bytes() <= total


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_containers_memory_limit_caps_the_available_memory(tmp_path, monkeypatch, version):
    """A container sees the host's /proc/meminfo; its cgroup's limit, less what it uses but for the inactive page
    cache, is what it can still take."""
    gib = 2**30
    (tmp_path / "meminfo").write_text(f"MemTotal: {64 * gib // 1024} kB\nMemAvailable: {60 * gib // 1024} kB\n")
    if version == "v2":
        (tmp_path / "cgroup").write_text("0::/job\n")
        folder, names = tmp_path / "fs" / "job", ("memory.max", "memory.current", "inactive_file")
    else:
        (tmp_path / "cgroup").write_text("4:memory:/job\n3:cpuset:/\n")
        folder, names = tmp_path / "fs" / "memory" / "job", ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                                              "total_inactive_file")
    folder.mkdir(parents=True)
    (folder / names[0]).write_text(f"{16 * gib}\n")
    (folder / names[1]).write_text(f"{10 * gib}\n")
    (folder / "memory.stat").write_text(f"anon {8 * gib}\n{names[2]} {2 * gib}\n")
    monkeypatch.setattr(host_memory, "_MEMINFO", tmp_path / "meminfo")
    monkeypatch.setattr(host_memory, "_OWN_CGROUPS", tmp_path / "cgroup")
    monkeypatch.setattr(host_memory, "_CGROUP_ROOT", tmp_path / "fs")
    assert available_host_bytes() == 8 * gib
    (folder / names[0]).write_text("max\n" if version == "v2" else f"{2**63 - 4096}\n")  # no limit
    assert available_host_bytes() == 60 * gib
