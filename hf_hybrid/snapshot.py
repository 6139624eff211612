"""Bit-exact copies of training state: the weights that undo a Predict phase (`WeightSnapshot`), and the last
known-good state that the guard rolls back to (`TrainingSnapshot`)."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch import Tensor

from .predictors.base import local_shard


class WeightSnapshot:
    """A copy of the parameters to undo a Predict phase, bit-exactly. Buffers are reused, never regrown.

    With `on_host`, accelerator parameters are copied into pinned host memory instead: one parameter-sized
    buffer less on the device, for a device-to-host copy at each Predict phase's start and a host-to-device
    copy at each rollback. Both are queued on the current stream, so the weights are not changed before the
    copy has read them and a later capture cannot overwrite a restore still in flight.
    """

    def __init__(self, on_host: bool = False) -> None:
        self.on_host = on_host
        self.tensors: list[Tensor] | None = None
        self.valid = False
        self._copied: torch.cuda.Event | None = None  # the last device-to-host copy, for host reads

    @torch.no_grad()
    def capture(self, params: list[Tensor]) -> None:
        to_host = self.on_host and params[0].is_cuda
        if self.tensors is None:
            if to_host:
                self.tensors = [torch.empty(p.shape, dtype=p.dtype, pin_memory=True) for p in params]
            else:
                self.tensors = [torch.empty_like(p) for p in params]
        if to_host:  # per tensor: the multi-tensor copy is for lists on one device
            for t, p in zip(self.tensors, params):
                t.copy_(p, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        else:
            torch._foreach_copy_(self.tensors, params)
        self.valid = True

    @torch.no_grad()
    def restore(self, params: list[Tensor]) -> None:
        assert self.valid and self.tensors is not None, "no snapshot to restore"
        if self._copied is not None:
            for p, t in zip(params, self.tensors):
                p.copy_(t, non_blocking=True)
        else:
            torch._foreach_copy_(params, self.tensors)

    def release(self) -> None:
        self.tensors, self.valid, self._copied = None, False, None

    def state_dict(self) -> dict:
        if self._copied is not None:
            self._copied.synchronize()  # the host copy may still be arriving
        tensors = [t.detach().cpu().clone() for t in self.tensors] if self.valid and self.tensors else None
        return {"valid": self.valid, "tensors": tensors}

    def load_state_dict(self, state: dict, params: list[Tensor]) -> None:
        self.valid = False
        if state["valid"]:
            self.capture(params)  # allocates the buffers where this run keeps them
            if self._copied is not None:
                self._copied.synchronize()  # or the copy could land after the saved values below
            with torch.no_grad():
                for s, saved in zip(self.tensors, state["tensors"]):
                    s.copy_(saved)



class TrainingSnapshot:
    """Everything a rollback restores: weights, optimizer state, the learning-rate schedule and the RNG, taken
    before the update of a step the guard accepted (so its weights are known to be good).

    Tensors are copied element-wise on local shards (no communication under FSDP2), into pinned host memory on an
    accelerator, where it costs no device memory: about 3x the parameters' bytes with AdamW (weights and two
    moments). The data stream is not rewound: a rollback drops the batches since the snapshot, the trouble
    included, as PaLM's restarts skipped theirs.
    """

    def __init__(self) -> None:
        self.weights = WeightSnapshot(on_host=True)
        self.optimizer_state = WeightSnapshot(on_host=True)
        self.predictor_state = WeightSnapshot(on_host=True)
        self.predictor_tensors = 0  # how many tensors of predictor state the snapshot holds
        self.keys: list[tuple[int, str]] = []  # (parameter index, state key) of each copied optimizer tensor
        self.scalars: list[tuple[int, str, object]] = []  # optimizer state entries that are not tensors
        self.schedule: dict | None = None
        self.rng: dict | None = None
        self.step: int | None = None  # the 0-based global step whose update the snapshot precedes
        self.made_up = 0  # optimizer steps already made up (added to max_steps) when it was taken

    @property
    def valid(self) -> bool:
        return self.step is not None

    def capture(self, step: int, made_up: int, params: list[Tensor], optimizer: torch.optim.Optimizer,
                schedule: dict, predictor_state: list[Tensor] = ()) -> None:
        keys, tensors, scalars = _optimizer_entries(params, optimizer)
        if keys != self.keys:  # the buffers are reused, so they are rebuilt only when the state's layout changes
            self.optimizer_state, self.keys = WeightSnapshot(on_host=True), keys
        self.weights.capture([local_shard(p) for p in params])
        if tensors:
            self.optimizer_state.capture(tensors)
        if len(predictor_state) != self.predictor_tensors:
            self.predictor_state, self.predictor_tensors = WeightSnapshot(on_host=True), len(predictor_state)
        if predictor_state:
            self.predictor_state.capture(list(predictor_state))
        self.scalars = scalars
        self.schedule, self.rng = schedule, _rng_state()
        self.step, self.made_up = step, made_up

    def restore(self, params: list[Tensor], optimizer: torch.optim.Optimizer,
                predictor_state: list[Tensor] = ()) -> dict:
        """Weights, optimizer state, the predictor's rollback state and the RNG back in place; returns the schedule
        for the trainer to load. A predictor that was released since keeps no state to restore."""
        keys, tensors, _ = _optimizer_entries(params, optimizer)
        if keys != self.keys:
            raise RuntimeError("the optimizer's state changed layout since the guard's snapshot; cannot roll back")
        self.weights.restore([local_shard(p) for p in params])
        if tensors:
            self.optimizer_state.restore(tensors)
        if predictor_state and len(predictor_state) == self.predictor_tensors:
            self.predictor_state.restore(list(predictor_state))
        for i, key, value in self.scalars:
            optimizer.state[params[i]][key] = value
        _set_rng_state(self.rng)
        return self.schedule

    def state_dict(self) -> dict:
        if not self.valid:
            return {"step": None}
        return {"step": self.step, "made_up": self.made_up, "weights": self.weights.state_dict(),
                "optimizer_state": self.optimizer_state.state_dict() if self.keys else None,
                "keys": [list(k) for k in self.keys], "scalars": [list(s) for s in self.scalars],
                "schedule": self.schedule, "rng": self.rng,
                "predictor_state": self.predictor_state.state_dict() if self.predictor_tensors else None}

    def load_state_dict(self, state: dict, params: list[Tensor], optimizer: torch.optim.Optimizer,
                        predictor_state: list[Tensor] = ()) -> None:
        if state["step"] is None:
            return
        keys, tensors, _ = _optimizer_entries(params, optimizer)
        if keys != [tuple(k) for k in state["keys"]]:
            raise ValueError("the checkpoint's guard snapshot does not match this optimizer's state")
        self.keys = keys
        self.weights.load_state_dict(state["weights"], [local_shard(p) for p in params])
        if keys:
            self.optimizer_state.load_state_dict(state["optimizer_state"], tensors)
        saved = state.get("predictor_state")  # absent from checkpoints written before the outer predictor
        if saved is not None and len(saved["tensors"] or []) == len(predictor_state):
            self.predictor_state.load_state_dict(saved, list(predictor_state))
            self.predictor_tensors = len(predictor_state)
        self.scalars = [tuple(s) for s in state["scalars"]]
        self.schedule, self.rng = state["schedule"], state["rng"]
        self.step, self.made_up = state["step"], state["made_up"]


def _optimizer_entries(params: list[Tensor], optimizer: torch.optim.Optimizer):
    keys, tensors, scalars = [], [], []
    for i, p in enumerate(params):
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, Tensor):
                keys.append((i, key))
                tensors.append(local_shard(value))
            else:
                scalars.append((i, key, value))
    return keys, tensors, scalars


def _rng_state() -> dict:
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
