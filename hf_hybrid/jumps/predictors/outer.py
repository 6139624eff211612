"""Outer momentum: every `period` real steps, an outer SGD step with Nesterov momentum on the pseudo-gradient.

This is DiLoCo with one worker, or SNOO. The pseudo-gradient g is the weights at the last anchor minus the weights
now; the outer step moves the weights to anchor - outer_lr * (g + momentum * buf), with buf = momentum * buf + g, and
that point becomes the next anchor. Over many cycles it lengthens a consistent direction by about
outer_lr / (1 - momentum): it pays where the inner learning rate is too small and overshoots where it is tuned,
which is why every jump is judged on the probe batch like any other (jumps/payoff.py) and rolled back when it lands
worse.

The schedule is the period, not the loss forecast's confidence: one Predict step every `period` real steps, with no
Correct steps (there is no per-step residual to learn). The Predict step runs no backward; its batch is the probe.

Memory: two parameter-sized buffers (the anchor, the momentum), element-wise on local shards, where the run's rollback
copies go (memory/placement.py: on the device where they fit its budget, else in pinned host memory). The momentum
exists only while it is not zero, from the first kept jump until a guard rollback clears it: a run's first cycle (the
warmup's) and a run whose jumps never pay hold the anchor alone. Where no snapshot stands on the anchor at the first
kept jump, the momentum takes the anchor's buffers and the next cycle makes new ones. In host memory the buffers cost no
device memory, but host-device copies of the parameters' bytes: 2x in per jump (the anchor, into the weights for the
probe's loss at the cycle's start, where the step then reads it, and the momentum, tensor by tensor), 2x in and 1x out
more per kept jump (the momentum's update), and 1x out per cycle start. The anchor is left intact by the jump (its
pseudo-gradient is taken tensor by tensor, and again from the engine's undo copy when the jump is kept) and moves only
at the start of the next cycle's first accepted real step, before its update: there the weights are known to be good, so
the guard's snapshot takes the anchor as its copy of the weights (`held_weights`) instead of keeping one of its own, and
holds only the optimizer state beside it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from ...memory.host_buffers import HostCopies
from ...memory.placement import CopyPlacement
from ...memory.shards import load_tensors, local_shards, nbytes
from .base import Predictor


class OuterMomentumPredictor(Predictor):
    name = "outer"
    # Its schedule is the period (controller_settings), with no Correct step and a one-step jump that is always checked.
    flags = ("hybrid_outer_period", "hybrid_outer_lr", "hybrid_outer_momentum")
    uses_updates = False
    uses_forecast = False  # the period schedules its jumps and the probe judges them
    placed = True  # the anchor and the momentum

    def __init__(self, params: list[Tensor], optimizer: torch.optim.Optimizer, period: int, outer_lr: float,
                 momentum: float, placement: CopyPlacement | None = None) -> None:
        super().__init__(params, optimizer)
        self.placement = placement or CopyPlacement.host()
        self.period, self.outer_lr, self.momentum = period, outer_lr, momentum
        # Under DDP every rank holds the same weights, so rank 0 alone keeps the outer state and computes each jump,
        # which it broadcasts: 2x the parameters per job instead of per rank (FSDP2: each rank its shards).
        self.replicated = not self.shard_groups and dist.is_initialized() and dist.get_world_size() > 1
        self.holds_state = not self.replicated or dist.get_rank() == 0
        if self.holds_state:
            self.placement.expect(lambda: 2 * sum(nbytes(t) for t in local_shards(params)))
        self.anchor: list[Tensor] | None = None  # on the ranks that hold the state
        self.anchored = False  # on every rank
        # A new cycle starts at the next accepted real step: the jump was judged, or the weights were put back.
        self.anchor_due = False
        self.cycle_steps = 0  # real updates since the anchor: the displacement weights - anchor is theirs
        self.buf: list[Tensor] = []  # the momentum, on the ranks that hold the state; empty while it is zero
        self.copies = HostCopies()
        self.released = False

    def controller_settings(self) -> dict:
        """The phase controller's schedule for this predictor: a one-step jump every `period` real steps, judged by
        its probe alone (the loss-forecast confidence gate is not this predictor's evidence)."""
        return dict(full_steps=self.period, min_predict_steps=1, max_predict_steps=1, correct_steps=0,
                    confidence_threshold=0.0, max_consecutive_predicts=1)

    @property
    def ready(self) -> bool:
        return self.keeps_weights

    @torch.no_grad()
    def _observe(self, updates: list[Tensor], lr: float) -> None:
        if not self.anchored:  # the first real step after a start anchors the next cycle
            self.anchor_due = True
        elif not self.anchor_due:
            self.cycle_steps += 1

    @torch.no_grad()
    def move_anchor(self, make_room: Callable[[], None] | None = None) -> bool:
        if not self.anchor_due:
            return False
        if self.holds_state:
            shards = local_shards(self.params)
            if self.anchor is None:  # the first cycle, or the first kept jump's momentum took the last anchor's buffers
                if make_room is not None:
                    make_room()
                self.anchor = self.placement.buffers_like(shards)
            self.copies.copy(self.anchor, shards)
        self.anchored, self.anchor_due, self.cycle_steps = True, False, 0
        return True

    @property
    def keeps_weights(self) -> bool:
        return self.anchored and not self.anchor_due

    def held_weights(self) -> list[Tensor] | None:
        return self.anchor if self.keeps_weights else None

    def host_buffers(self) -> tuple[int, list[Tensor]]:
        # The anchor and the momentum, until the predictor is released for good (retired, or no prediction at all),
        # unless the placement put them on the device.
        if self.placement.on_device:
            return 0, []
        return (2 if self.holds_state and not self.released else 0), [*(self.anchor or []), *self.buf]

    @torch.no_grad()
    def load_anchor(self) -> None:
        """Put the anchor's weights into the parameters (every rank), for the probe's loss at the cycle's start."""
        if self.holds_state:
            self.copies.copy(local_shards(self.params), self.anchor)
        self._broadcast_weights()

    def _broadcast_weights(self) -> None:
        if self.replicated:
            for shard in local_shards(self.params):
                dist.broadcast(shard, src=0)

    def restart(self) -> None:
        """After a guard rollback: the next cycle starts at the restored weights, with no momentum. The jumps kept
        since the guard's snapshot are undone with the weights, and their pseudo-gradients may hold the damage the
        guard caught, so the momentum they built is not kept (nor copied into every snapshot: 2x the parameters)."""
        super().restart()
        self.anchor_due = True
        self.copies.wait()
        self.buf = []

    def release(self) -> None:
        self.anchor, self.anchored, self.buf, self.released = None, False, [], True

    @torch.no_grad()
    def apply_(self, lr: float, start: list[Tensor] | None = None) -> None:
        """`start`: where the jump begins (the engine's undo copy) when the parameters hold the anchor, put there for
        the probe's loss at the cycle's start (`load_anchor`): the anchor is then read from them, not fetched again."""
        m, a = self.momentum, self.outer_lr
        # anchor - a * (g + m * (m * buf + g)) = weights + (1 - a - a * m) * g - a * m^2 * buf, with the
        # pseudo-gradient g = anchor - weights one tensor at a time: the anchor stays the guard's copy of the weights.
        fetch = self.copies.fetch
        for i, (shard, anchor) in enumerate(zip(local_shards(self.params), self.anchor or [])):
            if start is None:
                g = fetch(anchor, shard.device) - shard
            else:
                weights = fetch(start[i], shard.device)
                g = shard - weights
                shard.copy_(weights)
            shard.add_(g, alpha=1 - a - a * m)
            if self.buf:
                shard.add_(fetch(self.buf[i], shard.device), alpha=-a * m * m)
        self.copies.mark()
        self._broadcast_weights()

    @torch.no_grad()
    def jump_kept(self, before: list[Tensor], anchor_free: bool = False) -> None:
        # The first kept jump since the start, or since a rollback, starts the momentum at its pseudo-gradient. Where no
        # snapshot stands on the anchor, nothing reads the anchor again before the next cycle replaces it, so the
        # momentum takes its buffers: a guard holding a copy of its own (a long first cycle) then adds no 5th copy.
        first = self.holds_state and not self.buf
        take_anchor = first and anchor_free
        if first and not take_anchor:
            self.buf = [b.zero_() for b in self.placement.buffers_like(local_shards(self.params))]
        fetch = self.copies.fetch
        for i, (anchor, start, shard) in enumerate(zip(self.anchor or [], before, local_shards(self.params))):
            buf = anchor if take_anchor else self.buf[i]
            step = fetch(anchor, shard.device) - fetch(start, shard.device)
            # + 0.0, as `0 * m + step` from a zero momentum: a -0.0 pseudo-gradient becomes +0.0, bit for bit.
            new = step.add_(0.0) if take_anchor else fetch(buf, shard.device).mul_(self.momentum).add_(step)
            if new is not buf:  # on the CPU `fetch` gives the buffer itself
                buf.copy_(new, non_blocking=True)
        self.copies.mark()
        if take_anchor:
            self.buf, self.anchor = self.anchor, None
        self.anchor_due = True

    def jump_undone(self) -> None:
        """The weights are back where the jump began: the next cycle starts there, with the momentum as it was."""
        self.anchor_due = True

    def turn_passed(self) -> None:
        """No jump this cycle: the next one starts at the next accepted step, where the guard's snapshot stands on
        its anchor again (a cycle held on would need copies of the weights of its own)."""
        self.anchor_due = True

    def state_dict(self) -> dict:
        # In host memory handed over, not cloned: the checkpoint is written at once, and a copy would add 2x the
        # parameters. On the device they are copied to the host for the save: 2x the parameters while it lasts.
        self.copies.wait()
        return {**super().state_dict(), "anchor": [t.detach().cpu() for t in self.anchor or []],
                "buf": [t.detach().cpu() for t in self.buf], "cycle_steps": self.cycle_steps,
                "anchor_due": self.anchor_due, "anchored": self.anchored}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.copies.wait()
        self.anchored = state["anchored"]
        self.anchor = None
        if self.holds_state and self.anchored and state["anchor"]:  # none after a first kept jump took its buffers
            self.anchor = self.placement.buffers_like(local_shards(self.params))
            load_tensors(self.anchor, state["anchor"], "outer anchor")
        self.buf = []
        if self.holds_state and state["buf"]:
            self.buf = self.placement.buffers_like(local_shards(self.params))
            load_tensors(self.buf, state["buf"], "outer momentum")
        self.cycle_steps = state["cycle_steps"]
        self.anchor_due = state["anchor_due"]
