"""The rollback state's host memory: the bound the library states holds and is reached, a run that may not fit is told
once, in one line with a remedy, and the machine's available memory is read the way the kernel and a container's
cgroup limit it."""

from __future__ import annotations

import logging
import sys

import pytest
import torch
from transformers import TrainerCallback

from hf_hybrid.checkpoint import HYBRID_TENSORS_NAME, load_hybrid_state
from hf_hybrid.jumps.predictors import outer
from hf_hybrid.memory import host_memory
from hf_hybrid.memory.host_memory import available_host_bytes, rollback_state_bytes
from hf_hybrid.memory.placement import CopyPlacement

from .conftest import make_trainer


def keep_every_jump(monkeypatch) -> None:
    from hf_hybrid.jumps.payoff import PayoffMeter

    original_verdict = PayoffMeter.verdict
    monkeypatch.setattr(PayoffMeter, "verdict", lambda self, gain, noise: original_verdict(self, 1e9, 0.0))


class HostBytes(TrainerCallback):
    def __init__(self) -> None:
        self.trainer, self.rows = None, []

    def on_step_end(self, args, state, control, **kwargs):
        engine, guard = self.trainer._hybrid, self.trainer._guard_loop
        self.rows.append(rollback_state_bytes(engine, guard.snapshot))


def long_cycles(tmp_path, **overrides):
    """Outer cycles of 8 real steps with a guard snapshot due every 3 and a save at step 20: the guard takes copies
    of the weights of its own while the momentum of kept jumps exists."""
    values = dict(hybrid_predictor="outer", hybrid_outer_period=8, hybrid_guard_snapshot_steps=3,
                  hybrid_guard_window=16, hybrid_payoff_check=True, max_steps=40, save_strategy="steps", save_steps=20)
    return make_trainer(tmp_path, **{**values, **overrides})


def test_the_rollback_state_never_holds_more_than_its_bound_and_reaches_it(tmp_path, monkeypatch):
    keep_every_jump(monkeypatch)
    # Without the autopilot: its readings, 5 steps apart while a raise is under way, pass the turns of jumps whose
    # steps read long enough, and this test needs kept jumps.
    trainer = long_cycles(tmp_path, hybrid_lr_autopilot=False)
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


def tensors_in(state) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    items = state.values() if isinstance(state, dict) else state if isinstance(state, list | tuple) else ()
    return [tensor for item in items for tensor in tensors_in(item)]


@pytest.mark.parametrize("autopilot", [True, False])
def test_a_checkpoint_adds_at_most_twice_the_parameters(tmp_path, monkeypatch, autopilot):
    """Saved at every step, a checkpoint's parameter-sized state is the outer anchor, and its momentum once a jump is
    kept, or with the autopilot the start weights in a checkpoint of steps 1-9, before any jump: never more than 2P,
    the bound docs/how-it-works.md states; a rank's own file holds none of it (under DDP it would be N copies)."""
    keep_every_jump(monkeypatch)
    trainer = long_cycles(tmp_path, hybrid_lr_autopilot=autopilot, save_steps=1, max_steps=24)
    shapes = {tuple(p.shape) for p in trainer.model.parameters()}
    params = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    trainer.train()
    added = {}
    for folder in tmp_path.glob("checkpoint-*"):
        own = tensors_in(load_hybrid_state(str(folder / "hybrid_state_rank0.pt")))
        assert not [t.shape for t in own if tuple(t.shape) in shapes and t.is_floating_point()], folder.name
        tensors = tensors_in(load_hybrid_state(str(folder / HYBRID_TENSORS_NAME)))
        held = sum(t.numel() * t.element_size() for t in tensors)
        added[int(folder.name.split("-")[1])] = held / params
    added = dict(sorted(added.items()))
    assert len(added) >= 24 and max(added.values()) == 2 and set(added.values()) <= {0, 1, 2}, added
    if autopilot:  # the start weights from step 1, the anchor from step 2 (the first cycle's start), until step 10
        assert [added[step] for step in range(1, 11)] == [1] + [2] * 8 + [1], added
    else:
        assert trainer.hybrid_stats()["predictions_kept"] >= 1, added
        assert max(multiple for step, multiple in added.items() if step < 8) == 1, added  # no momentum before a jump


def test_a_run_whose_rollback_state_may_not_fit_is_told_once(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr("hf_hybrid.guard.runner.available_host_bytes", lambda: 1)
    with caplog.at_level(logging.WARNING, logger="hf_hybrid"):
        long_cycles(tmp_path / "short").train()
    lines = [r.getMessage() for r in caplog.records if "killed for memory" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "up to 0.0 GB of host memory on this rank (5.0x the parameters'" in lines[0]
    assert "this machine has 0.0 GB available" in lines[0] and "--hybrid_guard_snapshot_steps 0" in lines[0]
    caplog.clear()
    monkeypatch.setattr("hf_hybrid.guard.runner.available_host_bytes", lambda: 10**15)
    with caplog.at_level(logging.WARNING, logger="hf_hybrid"):
        long_cycles(tmp_path / "ample").train()
    assert not [r for r in caplog.records if "killed for memory" in r.getMessage()]


def test_the_guard_alone_holds_no_outer_state(tmp_path):
    """With no prediction the outer predictor is released at the start: the bound is the guard's alone (3P)."""
    trainer = long_cycles(tmp_path, hybrid_predict=False)
    trainer.train()
    size = rollback_state_bytes(trainer._hybrid, trainer._guard_loop.snapshot)
    assert size.at_most == size.guard == 3 * size.params and size.held <= size.at_most


def test_every_rank_of_a_machine_counts_under_fsdp2_and_one_under_ddp():
    gb = 10**9
    size = host_memory.RollbackStateBytes(at_most=5 * gb, held=3 * gb, guard=3 * gb, params=gb)
    assert host_memory.host_memory_warning(size, 16 * gb, ranks_on_machine=8) is None
    line = host_memory.host_memory_warning(size, 15 * gb, ranks_on_machine=8)
    assert "this machine's 8 ranks need 16.0 GB more than now" in line and "has 15.0 GB available" in line
    assert host_memory.host_memory_warning(size, 2 * gb, ranks_on_machine=8, replicated=True) is None
    assert host_memory.host_memory_warning(size, None, ranks_on_machine=8) is None  # cannot be told: say nothing
    # An undo copy kept in host memory (--hybrid_offload_snapshot) is every rank's, even where rank 0 keeps the rest.
    offloaded = size._replace(at_most=6 * gb, every_rank=gb)
    assert host_memory.host_memory_warning(offloaded, 10 * gb, ranks_on_machine=8, replicated=True) is None
    assert "need 10.0 GB more" in host_memory.host_memory_warning(offloaded, 9 * gb, ranks_on_machine=8,
                                                                  replicated=True)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_available_host_memory_is_this_machines():
    total = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemTotal:"))
    assert 0 < available_host_bytes() <= total


def fake_machine(tmp_path, monkeypatch, version: str, limits: dict[str, str]) -> None:
    """/proc/meminfo with 60 GiB available, and this process in cgroup /job/task: at each level in `limits`, that
    limit, 10 GiB used of which 2 GiB inactive page cache."""
    gib = 2**30
    (tmp_path / "meminfo").write_text(f"MemTotal: {64 * gib // 1024} kB\nMemAvailable: {60 * gib // 1024} kB\n")
    if version == "v2":
        (tmp_path / "cgroup").write_text("0::/job/task\n")
        root, names = tmp_path / "fs", ("memory.max", "memory.current", "inactive_file")
    else:
        (tmp_path / "cgroup").write_text("4:memory:/job/task\n3:cpuset:/\n")
        root = tmp_path / "fs" / "memory"
        names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    for level, limit in limits.items():
        folder = root / level
        folder.mkdir(parents=True, exist_ok=True)
        (folder / names[0]).write_text(f"{limit}\n")
        (folder / names[1]).write_text(f"{10 * gib}\n")
        (folder / "memory.stat").write_text(f"anon {8 * gib}\n{names[2]} {2 * gib}\n")
    monkeypatch.setattr(host_memory, "_MEMINFO", tmp_path / "meminfo")
    monkeypatch.setattr(host_memory, "_OWN_CGROUPS", tmp_path / "cgroup")
    monkeypatch.setattr(host_memory, "_CGROUP_ROOT", tmp_path / "fs")


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_containers_memory_limit_caps_the_available_memory(tmp_path, monkeypatch, version):
    """A container sees the host's /proc/meminfo; its cgroup's limit, less what it uses but for the inactive page
    cache, is what it can still take, and a limit set on the job above the task counts too."""
    gib, unlimited = 2**30, "max" if version == "v2" else str(2**63 - 4096)
    fake_machine(tmp_path, monkeypatch, version, {"job/task": str(16 * gib)})
    assert available_host_bytes() == 8 * gib
    fake_machine(tmp_path, monkeypatch, version, {"job/task": unlimited})
    assert available_host_bytes() == 60 * gib
    fake_machine(tmp_path, monkeypatch, version, {"job": str(14 * gib), "job/task": unlimited})
    assert available_host_bytes() == 6 * gib
    fake_machine(tmp_path, monkeypatch, version, {"job": "garbage", "job/task": str(20 * gib)})
    assert available_host_bytes() == 12 * gib  # a level that cannot be read is passed over


def test_the_first_kept_jump_after_a_long_first_cycle_stays_within_4p(tmp_path, monkeypatch):
    """The defaults' path: a first cycle (the warmup's) longer than the guard's snapshot interval, so the guard holds
    a copy of the weights of its own when the first jump is kept; later cycles are shorter. The momentum that jump
    starts takes the anchor's buffers (no snapshot stands on them), and the next cycle's anchor the guard's copy's."""
    first_kept_jump_after_a_long_first_cycle(tmp_path, monkeypatch)


class CountedPlacement:
    """A placement that reports each allocation through it to `counted`."""

    def __init__(self, inner: CopyPlacement, counted) -> None:
        self.inner, self.counted = inner, counted

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def buffers_like(self, tensors: list) -> list:
        buffers = self.inner.buffers_like(tensors)
        self.counted(buffers)
        return buffers


def first_kept_jump_after_a_long_first_cycle(tmp_path, monkeypatch, **extra) -> None:
    keep_every_jump(monkeypatch)
    trainer = make_trainer(tmp_path, hybrid_predictor="outer", hybrid_outer_period=4, hybrid_warmup_steps=12,
                           hybrid_guard_snapshot_steps=6, hybrid_guard_window=16, hybrid_payoff_check=True,
                           hybrid_lr_autopilot=False, max_steps=40, **extra)
    recorder = HostBytes()
    recorder.trainer = trainer
    trainer.add_callback(recorder)
    # What is held as each of the predictor's new buffers is allocated, with it: inside a step, where step-end counts
    # cannot see.
    at_allocation = []

    def counted(buffers):
        size = rollback_state_bytes(trainer._hybrid, trainer._guard_loop.snapshot)
        at_allocation.append((size.held + sum(b.numel() * b.element_size() for b in buffers)) // size.params)

    build = outer.OuterMomentumPredictor.__init__

    def build_counted(self, *args, **kwargs):
        build(self, *args, **kwargs)
        self.placement = CountedPlacement(self.placement, counted)

    monkeypatch.setattr(outer.OuterMomentumPredictor, "__init__", build_counted)
    trainer.train()
    assert trainer.hybrid_stats()["predictions_kept"] >= 2
    assert at_allocation and max(at_allocation) <= 4, at_allocation
    params = recorder.rows[-1].params
    held = [row.held // params for row in recorder.rows]
    assert max(held) == 4 and 3 in held, str(held)  # the first cycle's own copy (3P), then the anchor and momentum (4P)
