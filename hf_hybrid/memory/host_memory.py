"""Host memory for the rollback state: the most that the guard's snapshot and the outer predictor's state will hold on
this rank, against what the machine has available, said in one line where it may not fit.

That state sits in host memory (pinned on an accelerator, unless memory/placement.py keeps it on the device). Its
largest total comes at moments that can be hours into a run: the guard's own copy of the weights is taken after a save,
through a learning-rate trial and in a cycle longer than `--hybrid_guard_snapshot_steps`, and the outer momentum exists
from the first kept jump. So the check runs once, at the guard's first snapshot, when the optimizer's state exists and
the bytes are exact, rather than leave the user to find out from a process killed for memory. The jump's undo copy
counts only where `--hybrid_offload_snapshot` keeps it in pinned memory: elsewhere it lives on the device, or on the CPU
in the place of the gradients it is taken without.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from .shards import GB, nbytes
from .snapshot import TrainingSnapshot

if TYPE_CHECKING:
    from ..jumps.engine import HybridEngine

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
    """The least, over this process's memory cgroup and its ancestors (a limit may be set on a job above its tasks),
    of the limit minus the usage, with the inactive page cache (which the kernel reclaims before it kills anything)
    counted as free; v2 or v1. None where no limit is set or none can be read."""
    try:
        lines = _OWN_CGROUPS.read_text().splitlines()
    except OSError:
        return None
    headrooms = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        if fields[1] == "":  # v2
            names, root = ("memory.max", "memory.current", "inactive_file"), _CGROUP_ROOT
        elif "memory" in fields[1].split(","):  # v1
            names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
            root = _CGROUP_ROOT / "memory"
        else:
            continue
        # Inside a container the path is often the host's, with the container's own cgroup mounted at the root.
        folder = root / fields[2].lstrip("/")
        for level in [folder, *folder.parents]:
            if level == root or root in level.parents:
                headroom = _level_headroom(level, names)
                if headroom is not None:
                    headrooms.append(headroom)
    return min(headrooms) if headrooms else None


def _level_headroom(folder: Path, names: tuple[str, str, str]) -> int | None:
    try:
        limit_text = (folder / names[0]).read_text().strip()
        if limit_text == "max" or int(limit_text) >= 1 << 60:  # no limit at this level
            return None
        usage = int((folder / names[1]).read_text())
        stats = dict(row.split() for row in (folder / "memory.stat").read_text().splitlines())
        return int(limit_text) - usage + int(stats.get(names[2], 0))
    except (OSError, ValueError):
        return None


class RollbackStateBytes(NamedTuple):
    at_most: int  # the most it will hold on this rank
    held: int  # what it holds now
    guard: int  # the guard's part of `at_most`
    params: int  # the parameters' bytes on this rank, the unit
    every_rank: int = 0  # the part of `at_most` that every rank holds alike, even where rank 0 keeps the rest for all


def rollback_state_bytes(engine: HybridEngine, snapshot: TrainingSnapshot) -> RollbackStateBytes:
    """On this rank: the predictor's host copies (none once it is released), the guard's copies of the optimizer's
    state (exact once it has taken them), the guard's own copy of the weights, and on an accelerator with
    `--hybrid_offload_snapshot` the jump's undo copy; none of the guard's and the predictor's where the placement put
    them on the device (memory/placement.py)."""
    shards = engine.shards()
    param_bytes = sum(nbytes(t) for t in shards)
    copies, buffers = engine.predictor.host_buffers()
    held, guard = sum(nbytes(t) for t in buffers), 0
    if snapshot.holds_copy and not snapshot.placement.on_device:
        state = snapshot.optimizer_state.tensors or []
        guard = param_bytes + sum(nbytes(t) for t in state)
        own = [] if snapshot.weights.adopted else snapshot.weights.tensors or []
        held += sum(nbytes(t) for t in [*state, *own])
    undo = param_bytes if engine.snapshot.on_host and shards and shards[0].device.type != "cpu" else 0
    held += undo if engine.snapshot.tensors is not None else 0
    return RollbackStateBytes(copies * param_bytes + guard + undo, held, guard, param_bytes, undo)


def host_memory_warning(size: RollbackStateBytes, available: int | None, ranks_on_machine: int = 1,
                        replicated: bool = False) -> str | None:
    """One line when the rest of the rollback state of this machine's ranks may not fit in the host memory available;
    None when it fits or cannot be told. `replicated`: rank 0 keeps the state for all (DDP), so the machine's other
    ranks hold only their `every_rank` part."""
    holders = 1 if replicated else ranks_on_machine
    more = (size.at_most - size.held) * holders + size.every_rank * (ranks_on_machine - holders)
    if available is None or more <= available:
        return None
    machine = f"this machine's {ranks_on_machine} ranks need" if ranks_on_machine > 1 else "that is"
    return (f"hf_hybrid: the rollback state (the guard's snapshot, the outer predictor's anchor and momentum) can take "
            f"up to {size.at_most / GB:.1f} GB of host memory on this rank ({size.at_most / size.params:.1f}x the "
            f"parameters' {size.params / GB:.2f} GB); {machine} {more / GB:.1f} GB more than now, after a save, "
            f"through a learning-rate trial or in a cycle longer than --hybrid_guard_snapshot_steps, and this machine "
            f"has {available / GB:.1f} GB available, so the run may be killed for memory then. Free host memory, or "
            f"pass --hybrid_guard_snapshot_steps 0: the guard then keeps no snapshot ({size.guard / GB:.1f} GB less "
            f"a rank) and only skips steps.")


def local_ranks() -> int:
    """The ranks on this machine, as torchrun (and so `accelerate launch`) sets them."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
