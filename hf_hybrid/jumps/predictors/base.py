"""The predictor interface: a new predictor is one file with one subclass, of `Predictor` for a jump of its own
(outer) or of `StepwisePredictor` for one that extrapolates one optimizer step at a time (velocity, adam).

Every input a predictor sees is rank-identical: the parameters, the real update of the last optimizer
step (computed from all-reduced gradients), and the optimizer's state. Tensors are the local ones
(under FSDP2, each rank's shard, through `local_shard`), and every operation is element-wise, so
predicting needs no communication and ranks stay bit-identical. No predictor here needs a full tensor;
one that does must gather it itself, and say what that costs.

Residual correction is shared by the stepwise predictors: on a Correct step the real update is compared
with what the predictor would have applied, and a per-tensor gain is refitted by least squares
(projection of the real update on the predicted one, clamped and smoothed). The gain shrinks directions
that real steps do not follow; the relative residual is logged as `hybrid/prediction_error`. Under FSDP2
the fit's three sums per tensor are summed over the shards in one small all-reduce (3 float64 numbers
per tensor, Correct steps only), so every rank fits the same gains as an unsharded run would.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import Tensor

from ...memory.shards import local_shard

# The flags of the multi-step Predict/Correct schedule and its checks, read by the predictors that run it.
SCHEDULE_FLAGS = ("hybrid_full_steps", "hybrid_min_predict_steps", "hybrid_max_predict_steps", "hybrid_correct_steps",
                  "hybrid_confidence_threshold", "hybrid_max_consecutive_predicts", "hybrid_monitor_interval",
                  "hybrid_grad_explosion_factor")


class Predictor(ABC):
    name: ClassVar[str]
    flags: ClassVar[tuple[str, ...]] = SCHEDULE_FLAGS  # the predictor-specific flags it reads
    uses_updates: ClassVar[bool] = True  # whether `observe` needs the real update (costs a parameter copy)
    # Whether its jumps are gated and watched by the loss forecast (jumps/dynamics.py); one that is not never pays for
    # it.
    uses_forecast: ClassVar[bool] = True
    # How many real updates right before a prediction the predictor needs (None: all of them). Outside that window
    # the engine does not measure updates at all, so a run whose jumps keep being rejected (long back-off) or a long
    # warmup does not pay for them; the predictor is restarted when its window opens.
    history_steps: int | None = None
    # Whether it keeps copies of the weights between steps that only a jump reads, and so takes the run's rollback
    # copies' placement (memory/placement.py) for them. A stepwise predictor's buffer is read and written at every
    # real step, so it stays beside the parameters.
    placed: ClassVar[bool] = False
    # Real updates since the outer cycle's anchor; None for a predictor that has no cycles (a stepwise one), whose
    # jumps start from the weights in place and which has no anchor to load.
    cycle_steps: int | None = None

    def __init__(self, params: list[Tensor], optimizer: torch.optim.Optimizer) -> None:
        self.params = params
        self.optimizer = optimizer
        self.observed = 0
        self.last_residual: float | None = None  # a stepwise predictor's last Correct-step residual
        self.shard_groups = _shard_groups(params)

    @property
    def ready(self) -> bool:
        """Whether enough real updates were seen to predict."""
        return self.observed >= 2

    def observe(self, updates: list[Tensor], lr: float) -> None:
        """Learn from the real update (parameters after the step minus before, local shards) of one optimizer step."""
        self.observed += 1
        self._observe(updates, lr)

    def _observe(self, updates: list[Tensor], lr: float) -> None:  # noqa: B027 - optional hook
        pass

    def restart(self) -> None:
        """Forget the updates seen so far: the next ones follow a gap (a guard rollback put older weights back), so
        an average across it would be stale."""
        self.observed = 0

    def release(self) -> None:  # noqa: B027 - optional hook
        """Give back the predictor's own parameter-sized buffers: no prediction will follow."""

    def controller_settings(self) -> dict:
        """`ControllerConfig` fields this predictor sets itself (its own schedule); none by default."""
        return {}

    def jump_kept(self, before: list[Tensor], anchor_free: bool = False) -> None:  # noqa: B027 - optional hook
        """The jump just made passed its verdict and stays; `before` holds the weights where it began (the engine's
        undo copy, local shards). `anchor_free`: no snapshot stands on `held_weights` any more."""

    def jump_undone(self) -> None:  # noqa: B027 - optional hook
        """The jump was rolled back: the weights are back where it began."""

    def turn_passed(self) -> None:  # noqa: B027 - optional hook
        """A turn to predict passed without a jump (the steps were long enough already)."""

    def move_anchor(self, make_room: Callable[[], None] | None = None) -> bool:
        """At a real step that passed its checks, before its update: start a new cycle here if one is due. Returns
        whether it did (the guard then takes its snapshot, see `held_weights`). `make_room` is called before new
        buffers are allocated for it (the guard then drops a copy of its own that the new one replaces)."""
        return False

    def held_weights(self) -> list[Tensor] | None:
        """A copy of the weights at the last `move_anchor` that the predictor keeps anyway, unchanged until the next
        one, on the ranks that hold it (under DDP, rank 0); None elsewhere. The guard's snapshot taken where a cycle
        starts uses it instead of a copy of its own."""
        return None

    def host_buffers(self) -> tuple[int, list[Tensor]]:
        """The state it keeps in host memory (pinned on an accelerator) on this rank: how many copies of the
        parameters it may hold at most, and the buffers it holds now. A stepwise predictor keeps its state beside the
        parameters."""
        return 0, []

    def load_anchor(self) -> None:
        """Put the cycle's anchor into the parameters (a predictor with cycles: `cycle_steps` is not None)."""
        raise TypeError(f"the {self.name} predictor has no cycle anchor to load")

    @abstractmethod
    def apply_(self, lr: float, start: list[Tensor] | None = None) -> None:
        """Apply one predicted step to the parameters' local shards, in place. `start`: where the jump begins when
        the parameters hold the cycle's anchor instead (`load_anchor`)."""

    def state_dict(self) -> dict:
        return {"observed": self.observed, "last_residual": self.last_residual}

    def load_state_dict(self, state: dict) -> None:
        self.observed = state["observed"]
        self.last_residual = state["last_residual"]


class StepwisePredictor(Predictor):
    """A predictor of the next optimizer step's update, tensor by tensor (`direction`), scaled by a per-tensor gain
    that the Correct steps refit (the module docstring)."""

    gain_smoothing: ClassVar[float] = 0.3
    max_gain: ClassVar[float] = 2.0

    def __init__(self, params: list[Tensor], optimizer: torch.optim.Optimizer) -> None:
        super().__init__(params, optimizer)
        self.gains = torch.ones(len(params), dtype=torch.float64)

    @abstractmethod
    def direction(self, index: int, param: Tensor, lr: float) -> Tensor:
        """The un-gained predicted update of parameter `index` for one step at learning rate `lr`; `param` is its
        local shard, and so is the result."""

    @torch.no_grad()
    def apply_(self, lr: float, start: list[Tensor] | None = None) -> None:
        """Apply one predicted step to the parameters, in place (from where they are: no cycle, so no `start`)."""
        for i, p in enumerate(self.params):
            shard = local_shard(p)
            shard.add_(self.direction(i, shard, lr), alpha=float(self.gains[i]))

    @torch.no_grad()
    def measure_residual(self, updates: list[Tensor], predicted: list[Tensor]) -> None:
        """Compare a real update with the un-gained prediction made from the same state; refit the gains, and keep
        the relative residual ||real - gain * predicted|| / ||real|| over all parameters (`last_residual`)."""
        # Three sums per tensor, read back in one transfer: ||u - g d||^2 = uu - 2 g ud + g^2 dd.
        sums = torch.stack([
            torch.stack([(u * u).sum(dtype=torch.float64), (u * d).sum(dtype=torch.float64),
                         (d * d).sum(dtype=torch.float64)])
            for u, d in zip(updates, predicted)
        ])
        for group in self.shard_groups:
            dist.all_reduce(sums, group=group)
        sums = sums.tolist()
        num, den = 0.0, 0.0
        for i, (uu, ud, dd) in enumerate(sums):
            fitted = min(max(ud / dd, 0.0), self.max_gain) if dd > 0 else 0.0
            self.gains[i] = (1 - self.gain_smoothing) * self.gains[i] + self.gain_smoothing * fitted
            g = float(self.gains[i])
            num += max(uu - 2 * g * ud + g * g * dd, 0.0)
            den += uu
        self.last_residual = math.sqrt(num / max(den, 1e-30))

    def state_dict(self) -> dict:
        return {**super().state_dict(), "gains": self.gains.clone()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.gains = state["gains"].clone()


def _shard_groups(params: list[Tensor]) -> list:
    """The process groups across which the parameters are sharded (FSDP2's DTensors); none when unsharded."""
    for p in params:
        if hasattr(p, "device_mesh"):
            return [p.device_mesh.get_group(dim) for dim, placement in enumerate(p.placements) if placement.is_shard()]
    return []
