"""Bit-exact copies of training state: the weights that undo a Predict phase (`WeightSnapshot`), and the last
known-good state that the guard rolls back to (`TrainingSnapshot`)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from .host_buffers import HostCopies, host_like, release_cached_pinned_memory
from .placement import CopyPlacement
from .shards import load_tensors, local_shard, local_shards, nbytes


class WeightSnapshot:
    """A copy of a list of tensors (parameters, optimizer state) to undo a change bit-exactly. Buffers are reused
    between captures until `release`: the jump's undo copy is released as soon as the jump is judged, so that it
    exists only on steps without gradients (a Predict step, a reading after the optimizer step), whose memory it
    takes instead of adding to the peak of a real step; with `velocity` and `adam` it also lives through the Correct
    steps that judge the jump.

    With `on_host`, every accelerator tensor is copied into pinned host memory instead (`host_like`; an optimizer's
    state mixes device moments with a host `step` count): no device memory, for a device-to-host copy at
    each capture and a host-to-device copy at each restore. Both are queued on the current stream, so the tensors are
    not changed before the copy has read them and a later capture cannot overwrite a restore still in flight. With a
    `placement`, the run's choice for its rollback copies decides instead (memory/placement.py).
    """

    def __init__(self, on_host: bool = False, placement: CopyPlacement | None = None) -> None:
        self.on_host = on_host
        self.placement = placement
        self.tensors: list[Tensor] | None = None
        self.valid = False
        self.adopted = False  # the tensors are another owner's copy (`adopt`), never written here
        self._copies = HostCopies()

    def adopt(self, tensors: list[Tensor]) -> None:
        """Stand for a copy that another part already holds: `tensors` hold the values to keep, and their owner leaves
        them unchanged while this copy is valid. Costs no memory and no copy; a later `capture` takes buffers of its
        own."""
        self.tensors, self.valid, self.adopted = tensors, True, True

    @torch.no_grad()
    def capture(self, tensors: list[Tensor]) -> None:
        if self.adopted:
            self.release()
        if self.tensors is None:
            self.tensors = self._buffers_like(tensors)
        self._copies.copy(self.tensors, tensors)
        self.valid = True

    @torch.no_grad()
    def restore(self, tensors: list[Tensor]) -> None:
        assert self.valid and self.tensors is not None, "no snapshot to restore"
        self._copies.copy(tensors, self.tensors)

    def _buffers_like(self, tensors: list[Tensor]) -> list[Tensor]:
        if self.placement is not None:
            return self.placement.buffers_like(tensors)
        return host_like(tensors) if self.on_host else [torch.empty_like(t) for t in tensors]

    def release(self) -> None:
        self.tensors, self.valid, self.adopted = None, False, False

    @contextmanager
    def held(self, tensors: list[Tensor]) -> Iterator[None]:
        """Keep `tensors` while the body moves them, and put them back bit for bit after it, however it ends: a
        reading interrupted by Ctrl-C or an out-of-memory error (which `auto_find_batch_size` catches and trains on)
        leaves the weights the last step made, not the reading's points along a line."""
        self.capture(tensors)
        try:
            yield
        finally:
            self.restore(tensors)
            self.release()

    @torch.no_grad()
    def move_to(self, device: torch.device) -> None:
        """Keep the copy on `device` from now on: one copy across; pinned buffers then go back to the system, once the
        copy has read them (one device synchronization), rather than staying reserved for reuse."""
        old = self.settled()
        self.tensors = [t.to(device, non_blocking=True) for t in old]
        self.on_host, self.placement, self.adopted = False, None, False
        if old[0].is_pinned():
            torch.cuda.current_stream(device).synchronize()
            del old
            release_cached_pinned_memory()

    def settled(self) -> list[Tensor]:
        """The copy, to read: a device-to-host copy may still be arriving."""
        self._copies.wait()
        return self.tensors

    def state_dict(self) -> dict:
        """The copy as it stands, for a checkpoint that is written at once: host buffers are handed over, not cloned,
        so saving adds no memory (a copy on the accelerator is copied out)."""
        self._copies.wait()  # the host copy may still be arriving
        tensors = [t.detach().cpu() for t in self.tensors] if self.valid and self.tensors else None
        return {"valid": self.valid, "tensors": tensors}

    def load_state_dict(self, state: dict, tensors: list[Tensor]) -> None:
        self.valid = False
        if state["valid"]:
            self.capture(tensors)  # allocates the buffers where this run keeps them
            self._copies.wait()  # or the copy could land after the saved values below
            load_tensors(self.tensors, state["tensors"], "undo copy of the weights")


class TrainingSnapshot:
    """Everything a guard rollback restores: weights, optimizer state, the learning-rate schedule and the RNG, taken
    before the update of a step the guard accepted (so its weights are known to be good).

    Tensors are copied element-wise on local shards (no communication under FSDP2), where `placement` puts the run's
    rollback copies (memory/placement.py): 3x the parameters' bytes with AdamW (weights and two moments). With
    `on_held_weights` (the outer predictor's anchor, taken at the same point) the weights are not copied again: the
    snapshot stands on that copy, and only the moments are its own (2x). With `replicated` (DDP, where every rank holds
    the same weights and optimizer state) only rank 0 keeps the copies (and the anchor), and a restore broadcasts them
    to the others: once per job instead of once per rank, for one broadcast per rollback. The optimizer's step counters
    (0-dimensional, some of them host tensors that NCCL cannot broadcast) are kept on every rank. The data stream is
    not rewound: a rollback drops the batches since the snapshot, the trouble included, as PaLM's restarts skipped
    theirs. The predictor's state is not kept: it restarts from the restored weights, as after any gap. Nor is the
    snapshot written to checkpoints: a save asks for the next one at the next accepted step, where the weights and
    optimizer state are the checkpoint's own, so a resumed run takes the same snapshot there.
    """

    def __init__(self, replicated: bool = False, placement: CopyPlacement | None = None) -> None:
        self.replicated = replicated
        self.holds_copy = not replicated or dist.get_rank() == 0  # whether this rank keeps the parameter-sized copy
        self.placement = placement or CopyPlacement.host()
        self.weights = WeightSnapshot(placement=self.placement)
        self.optimizer_state = WeightSnapshot(placement=self.placement)  # the parameter-sized entries (AdamW's moments)
        self.counters = WeightSnapshot(on_host=True)  # the 0-dimensional ones (AdamW's step), on every rank
        self.keys: list[tuple[int, str]] = []  # (parameter index, state key) of each copied optimizer tensor
        self.scalars: list[tuple[int, str, object]] = []  # optimizer state entries that are not tensors
        self.schedule: dict | None = None
        self.rng: dict | None = None
        self.step: int | None = None  # the 0-based global step whose update the snapshot precedes
        self.made_up = 0  # optimizer steps already made up (added to max_steps) when it was taken
        self._on_held_weights = False

    @property
    def valid(self) -> bool:
        return self.step is not None

    @property
    def on_held_weights(self) -> bool:
        """Whether the weights are the predictor's copy, which moves with its next cycle."""
        return self._on_held_weights

    def invalidate(self) -> None:
        self.step = None

    def weight_copies(self) -> list[Tensor] | None:
        """The snapshot's weights, one local shard per parameter; None on a rank that keeps no copy (DDP: all but
        rank 0)."""
        if not (self.valid and self.holds_copy and self.weights.valid):
            return None
        return self.weights.settled()

    def capture(self, step: int, made_up: int, params: list[Tensor], optimizer: torch.optim.Optimizer,
                schedule: dict, on_held_weights: bool = False, held_weights: list[Tensor] | None = None,
                rng: dict | None = None) -> None:
        """`on_held_weights`: stand on the predictor's copy of the weights, `held_weights` on the ranks that keep
        copies (every rank but under DDP, where rank 0 keeps the predictor's state too). `rng`: the RNG state to put
        back (`rng_state()` at the step's start, before its forward drew dropout masks), else the state now."""
        keys, tensors, scalars = _optimizer_entries(params, optimizer)
        if keys != self.keys:  # the buffers are reused, so they are rebuilt only when the state's layout changes
            self.optimizer_state, self.counters = WeightSnapshot(placement=self.placement), WeightSnapshot(on_host=True)
            self.keys = keys
        state, counters = _split_counters(tensors)
        if not self.holds_copy:
            self.weights.release()  # rank 0's copy, broadcast at a restore, stands for this rank's
        elif on_held_weights:
            assert held_weights is not None, "the predictor keeps no weights on this rank"
            pinned = bool(not self.weights.adopted and self.weights.tensors and self.weights.tensors[0].is_pinned())
            self.weights.adopt(held_weights)  # its own copy, if it had one, is dropped
            if pinned:
                # PyTorch keeps freed pinned memory reserved for reuse. The copy is taken again only in a long cycle or
                # a trial, so it goes back to the system, at one device synchronization, rather than staying pinned.
                release_cached_pinned_memory()
        else:
            self.weights.capture(local_shards(params))
        self._on_held_weights = on_held_weights
        if self.holds_copy and state:
            self.optimizer_state.capture(state)
        if counters:
            self.counters.capture(counters)
        self.scalars = scalars
        self.schedule, self.rng = schedule, rng if rng is not None else rng_state()
        self.step, self.made_up = step, made_up

    def restore(self, params: list[Tensor], optimizer: torch.optim.Optimizer) -> dict:
        """Weights, optimizer state and the RNG back in place; returns the schedule for the trainer to load."""
        keys, tensors, _ = _optimizer_entries(params, optimizer)
        if keys != self.keys:
            raise RuntimeError(
                "the optimizer's state changed layout since the guard's snapshot, so the guard cannot roll back. "
                "Keep the optimizer and its parameter groups fixed during training, or pass "
                "--hybrid_guard_snapshot_steps 0 to let the guard only skip steps."
            )
        weights = local_shards(params)
        state, counters = _split_counters(tensors)
        if self.holds_copy:
            self.weights.restore(weights)
            if state:
                self.optimizer_state.restore(state)
        if counters:
            self.counters.restore(counters)
        if self.replicated:
            for t in (*weights, *state):
                dist.broadcast(t, src=0)
        for i, key, value in self.scalars:
            optimizer.state[params[i]][key] = value
        _set_rng_state(self.rng)
        return self.schedule


def snapshot_bytes(params: list[Tensor], optimizer: torch.optim.Optimizer) -> int:
    """The most a `TrainingSnapshot` holds in parameter-sized copies on this rank: a copy of the weights of its own and
    the optimizer's state (AdamW: 3x the parameters)."""
    state, _ = _split_counters(_optimizer_entries(params, optimizer)[1])
    return sum(nbytes(t) for t in [*local_shards(params), *state])


def _split_counters(tensors: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
    return [t for t in tensors if t.dim()], [t for t in tensors if not t.dim()]


def _optimizer_entries(
    params: list[Tensor], optimizer: torch.optim.Optimizer
) -> tuple[list[tuple[int, str]], list[Tensor], list[tuple[int, str, object]]]:
    keys, tensors, scalars = [], [], []
    for i, p in enumerate(params):
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, Tensor):
                keys.append((i, key))
                tensors.append(local_shard(value))
            else:
                scalars.append((i, key, value))
    return keys, tensors, scalars


def rng_state() -> dict:
    # Plain types and tensors only, so that checkpoints load with weights_only=True.
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "numpy": [name, keys.tolist(), pos, has_gauss, cached],
             "cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
