"""Host memory for the rollback state: the most that the guard's snapshot and the outer predictor's state will hold on
this rank, against what the machine has available, said in one line where it may not fit.

That state sits in host memory (pinned on an accelerator). Its largest total comes at moments that can be hours into a
run: the guard's own copy of the weights is taken after a save, through a learning-rate trial and in a cycle longer
than `--hybrid_guard_snapshot_steps`, and the outer momentum exists from the first kept jump. So the check runs once,
at the guard's first snapshot, when the optimizer's state exists and the bytes are exact, rather than leave the user to
find out from a process killed for memory. The jump's undo copy is left out: it lives on the device, or on the CPU in
the place of the gradients it is taken without.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

from .predictors.base import Predictor, local_shard
from .snapshot import TrainingSnapshot

_GB = 1e9
_MEMINFO, _OWN_CGROUPS, _CGROUP_ROOT = Path("/proc/meminfo"), Path("/proc/self/cgroup"), Path("/sys/fs/cgroup")


def available_host_bytes() -> int | None:
    """What the kernel says can still be allocated without swapping (`MemAvailable`), and no more than the headroom
    under this process's cgroup memory limit (a container's), where one is set; None where neither can be read (not
    Linux)."""
    available = None
    try:
        for line in _MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        return None
    headroom = _cgroup_headroom()
    if headroom is not None:
        available = headroom if available is None else min(available, headroom)
    return available


def _cgroup_headroom() -> int | None:
    """The cgroup's limit minus its usage, with the inactive page cache (which the kernel reclaims before it kills
    anything) counted as free; v2 or v1."""
    try:
        lines = _OWN_CGROUPS.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            names, root = ("memory.max", "memory.current", "inactive_file"), _CGROUP_ROOT
        elif "memory" in controllers.split(","):  # v1
            names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
            root = _CGROUP_ROOT / "memory"
        else:
            continue
        # Inside a container the path is often the host's, with the container's own cgroup mounted at the root.
        for folder in (root / path.lstrip("/"), root):
            try:
                limit_text = (folder / names[0]).read_text().strip()
                usage = int((folder / names[1]).read_text())
                stats = dict(row.split() for row in (folder / "memory.stat").read_text().splitlines())
            except (OSError, ValueError):
                continue
            if limit_text == "max" or int(limit_text) >= 1 << 60:  # no limit
                return None
            return int(limit_text) - usage + int(stats.get(names[2], 0))
    return None


class RollbackStateBytes(NamedTuple):
    at_most: int  # the most it will hold on this rank
    held: int  # what it holds now
    guard: int  # the guard's part of `at_most`
    params: int  # the parameters' bytes on this rank, the unit


def rollback_state_bytes(predictor: Predictor, snapshot: TrainingSnapshot, params: list[Tensor]) -> RollbackStateBytes:
    """On this rank: the predictor's host copies, the guard's copies of the optimizer's state (exact once it has taken
    them) and the guard's own copy of the weights."""
    param_bytes = sum(_nbytes(local_shard(p)) for p in params)
    copies, buffers = predictor.host_buffers()
    held, guard = sum(_nbytes(t) for t in buffers), 0
    if snapshot.holds_copy:
        state = snapshot.optimizer_state.tensors or []
        guard = param_bytes + sum(_nbytes(t) for t in state)
        own = [] if snapshot.weights.adopted else snapshot.weights.tensors or []
        held += sum(_nbytes(t) for t in [*state, *own])
    return RollbackStateBytes(copies * param_bytes + guard, held, guard, param_bytes)


def host_memory_warning(size: RollbackStateBytes, available: int | None, ranks_on_machine: int = 1) -> str | None:
    """One line when the rest of the rollback state, on every rank of this machine that holds it alike, may not fit
    in the host memory available; None when it fits or cannot be told."""
    more = (size.at_most - size.held) * ranks_on_machine
    if available is None or more <= available:
        return None
    ranks = f" on each of this machine's {ranks_on_machine} ranks" if ranks_on_machine > 1 else ""
    return (f"hf_hybrid: the guard's rollback snapshot and the outer predictor's state can take up to "
            f"{size.at_most / _GB:.1f} GB of host memory{ranks} ({size.at_most / size.params:.1f}x the parameters' "
            f"{size.params / _GB:.2f} GB), {more / _GB:.1f} GB more than now, after a save, through a learning-rate "
            f"trial or in a cycle longer than --hybrid_guard_snapshot_steps; this machine has {available / _GB:.1f} GB "
            f"available, so the run may be killed for memory then. Free host memory, or pass "
            f"--hybrid_guard_snapshot_steps 0: the guard then keeps no snapshot ({size.guard / _GB:.1f} GB less) and "
            f"only skips steps.")


def ranks_on_this_machine(replicated: bool) -> int:
    """How many ranks of this machine hold rollback state like this one: one where rank 0 keeps it for all (DDP),
    else every rank its own (FSDP2: its shards)."""
    return 1 if replicated else int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
