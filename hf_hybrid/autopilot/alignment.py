"""Evidence from a run's first steps that its learning rate is far too small: the gradient's alignment with the
displacement since the start, the signal Mechanic and Prodigy grow their step on.

Over optimizer steps FIRST_STEP to LAST_STEP, before each update, the cosine between the gradient and the weights'
displacement since the first update, negated: positive while the gradient still points on along the way already
come, as it does when every step is too short to reach the bottom of what it descends. Its mean over the window says
whether the run is `aligned`. ALIGNED sits above what most runs from scratch read at any LR and below what full
fine-tunes read at a tenth of their swept LR or less; LoRA reads above it at every LR, since its adapters start at zero
and the displacement is all theirs (docs/benchmarks.md, "The weights' path inside the warmup" and "The first steps'
alignment"). From scratch it does not always tell a tenth of the swept LR from a third: a run at a third can read
aligned and raise far past its swept LR (docs/benchmarks.md, "A reading every 5 steps while a raise is under way").
The alignment does not ask for a raise: the line (autopilot/scale.py) still does, but in an aligned run one long
reading is enough, not two in a row, and the raise may be up to MAX_ALIGNED_RAISE, and it may come as soon as the window
closes, inside the schedule's warmup (a run that reads below the gate waits for the warmup's end + 10 steps, past its
first descent); the verdict judges it as any other (docs/benchmarks.md, "Raising inside the warmup"). So a LoRA run at
a good LR, aligned but reading a short line, is not raised. A run whose mean reads below OPPOSED starts no raise at all:
its steps already overshoot.

Costs one copy of the weights from the first update to LAST_STEP, then released. On an accelerator it is taken into
pinned host memory, since where the run's copies go is decided at the next step, once the optimizer's state exists;
from there it sits on the device where it fits beside the rollback copies in their share (memory/placement.py), and
stays pinned otherwise, coming in over the host link once per step inside the window. A checkpoint saved inside the
window carries it, so a resumed run reads the same mean. Three dot products per step inside the window and no forward;
each step's cosine is summed on the device, and the mean is read on the host once, at the first reading that asks for
it, so a real step makes no extra host read. Under DDP and FSDP2 each rank reads its own shards and the sums are added
across ranks (a common factor under DDP, which the cosine ignores).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..memory.placement import CopyPlacement
from ..memory.shards import local_shard, nbytes
from ..memory.snapshot import WeightSnapshot

FIRST_STEP, LAST_STEP = 3, 10  # 1-based optimizer steps: the first two have no displacement worth a direction
ALIGNED = 0.07
# Between what LoRA reads up to its swept LR and the most full fine-tunes and runs from scratch read, on the tuning
# half (docs/benchmarks.md, "A larger first raise where the first steps read strongly aligned"): above it, a run's
# raise may take the line's whole size (autopilot/scale.py).
STRONGLY_ALIGNED = 0.2
# Below this the gradient pointed back along the way already come, on average over the window: the steps overshoot
# what they descend, the opposite of steps too short, so no raise starts whatever the lines read later. Read only at
# and above a setting's swept LR (docs/benchmarks.md, "No raise where the first steps read opposed").
OPPOSED = 0.0


class StartAlignment:
    """The alignment's mean over the window, and the verdict it gives once the window has closed."""

    def __init__(self, params: list[torch.Tensor], placement: CopyPlacement, steps_done: int = 0) -> None:
        """`steps_done`: the optimizer steps the run has made, more than 0 where it resumes from a checkpoint."""
        self.start = WeightSnapshot(on_host=True)  # the weights before the first update
        self.placement = placement
        self.window: torch.Tensor | None = None  # on the weights' device: the cosines' sum and how many were read
        # A resumed run places its copies as it loads, before this part loads its own state: so whether the window
        # is still open is known from the steps made, and the copy's bytes from the weights.
        self.closed = steps_done >= LAST_STEP
        start_bytes = sum(nbytes(local_shard(p)) for p in params)
        placement.expect_brief(lambda: 0 if self.closed else start_bytes,
                               f"the autopilot's start weights through step {LAST_STEP}")
        self._read: tuple[float, float] | None = None  # the window's sums on the host, once read

    @torch.no_grad()
    def before_update(self, step: int, params: list[torch.Tensor]) -> None:
        """Before the update of optimizer step `step` (1-based), with the gradients in place."""
        if self.closed:
            return
        weights = [local_shard(p) for p in params]
        if not self.start.valid:
            self.start.capture(weights)
        elif self.start.tensors[0].is_pinned() and self.placement.brief_copy_on(weights[0].device):
            self.start.move_to(weights[0].device)
        if self.window is None:
            self.window = torch.zeros(2, dtype=torch.float64, device=weights[0].device)
        if FIRST_STEP <= step <= LAST_STEP:
            sums = torch.zeros(3, dtype=torch.float64, device=weights[0].device)
            for p, w, w0 in zip(params, weights, self.start.settled()):
                if p.grad is None:
                    continue
                grad = local_shard(p.grad).float()
                away = w.float() - w0.to(w.device, non_blocking=True).float()
                sums += torch.stack([(grad * away).sum(), (grad * grad).sum(), (away * away).sum()]).double()
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(sums)
            dot, gradient_sq, away_sq = sums
            read = (gradient_sq > 0) & (away_sq > 0) & dot.isfinite()
            cosine = torch.where(read, -dot / (gradient_sq * away_sq).sqrt(), 0.0)
            self.window += torch.stack([cosine, read.double()])
        if step >= LAST_STEP:
            self.closed = True
            self.start.release()

    def _sums(self) -> tuple[float, float]:
        """The cosines' sum and count on the host: read once when the window has closed, at each call before."""
        if self.window is None:
            return 0.0, 0.0
        if not self.closed:
            return tuple(self.window.tolist())
        if self._read is None:
            self._read = tuple(self.window.tolist())
        return self._read

    @property
    def count(self) -> int:
        """The steps of the window read so far."""
        return int(self._sums()[1])

    @property
    def mean(self) -> float:
        total, count = self._sums()
        return total / count if count else 0.0

    @property
    def aligned(self) -> bool | None:
        """None until the window has closed."""
        return self.count > 0 and self.mean >= ALIGNED if self.closed else None

    @property
    def strongly_aligned(self) -> bool | None:
        """None until the window has closed."""
        return self.count > 0 and self.mean >= STRONGLY_ALIGNED if self.closed else None

    @property
    def opposed(self) -> bool | None:
        """None until the window has closed."""
        return self.count > 0 and self.mean < OPPOSED if self.closed else None

    def state_dict(self) -> dict:
        return {"window": list(self._sums()), "closed": self.closed, "start": self.start.state_dict()}

    def load_state_dict(self, state: dict, params: list[torch.Tensor]) -> None:
        self.closed, self._read = state["closed"], None
        self.window = torch.tensor(state["window"], dtype=torch.float64, device=local_shard(params[0]).device)
        self.start.load_state_dict(state["start"], [local_shard(p) for p in params])
