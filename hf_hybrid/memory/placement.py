"""Where the rollback copies live on an accelerator: the guard's snapshot (the optimizer's moments, and a copy of the
weights of its own where it keeps one) and the outer predictor's anchor and momentum.

In pinned host memory they cost no device memory, but every copy crosses the host link, a visible share of the step time
for the guard's snapshots and more than a real step for a judged jump (docs/benchmarks-history.md, "the steady hook
cost, the readings, and a jump's cost"). On the device each is a device-to-device copy. So they go on the device where
all of them fit in `--hybrid_device_copies_share` of the device memory the run leaves free at its peak so far, and in
pinned host memory otherwise: a rollback copy must never be what puts a run out of memory. The values are bit for bit
the same either way.

A copy held only through the run's first steps (the autopilot's start weights, autopilot/alignment.py) is counted
apart: it goes on the device only where it fits beside the lasting ones, so that it never sends them to the host for
the rest of the run.

The choice is made once, where the first copy is allocated. In a fresh run that is the second optimizer step, after the
first one has shown the peak (forward, backward and the optimizer's step, which creates AdamW's moments, so their bytes
count exactly); in a run resumed from a checkpoint it is the load, before any step, so the share is of what is free
without the activations. One line says which was chosen and why.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from transformers.utils import logging

from .host_buffers import host_like
from .shards import GB

logger = logging.get_logger(__name__)



def room_at_peak(device: torch.device) -> int:
    """The device memory this process could still take at its peak so far: what the device has free, plus what this
    process's allocator holds beyond its peak allocation."""
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.max_memory_allocated(device)
    return free + max(cached, 0)


class CopyPlacement:
    """The placement of one rank's rollback copies: each owner says, when it is built, how many bytes it may hold at
    most (`expect`), and allocates its buffers through `buffers_like`."""

    def __init__(self, share: float, announce: bool = True) -> None:
        self.share = share
        self.announce = announce  # whether this process says the choice (one per machine)
        self.on_device: bool | None = None  # None until the first copy is allocated
        self.brief_on_device: bool | None = None  # the same, for the copy held through the first steps
        self._sizes: list[Callable[[], int]] = []
        self._brief: tuple[Callable[[], int], str] | None = None

    @classmethod
    def host(cls) -> CopyPlacement:
        """Every copy in host memory (pinned on an accelerator): for a part built on its own, outside a run's
        placement."""
        return cls(share=0.0)

    def expect(self, nbytes: Callable[[], int]) -> None:
        """An owner's most bytes, read when the choice is made (the optimizer's state exists only from its first
        step)."""
        self._sizes.append(nbytes)

    def expect_brief(self, nbytes: Callable[[], int], what: str) -> None:
        """The one copy held only through the run's first steps: its bytes while held (0 once it is gone), and what it
        is, for the line that says where it went."""
        self._brief = (nbytes, what)

    def brief_copy_on(self, device: torch.device) -> bool:
        """Whether the copy held through the first steps goes on `device`, choosing now if no copy was placed yet."""
        if self.on_device is None:
            self.choose(device)
        return bool(self.brief_on_device)

    def buffers_like(self, tensors: list[Tensor]) -> list[Tensor]:
        """Uninitialized buffers shaped like `tensors`: beside them on the device, or in pinned host memory
        (`host_like`, which leaves CPU tensors' buffers on the CPU)."""
        if self.on_device is None and any(t.is_cuda for t in tensors):
            self.choose(next(t.device for t in tensors if t.is_cuda))
        if self.on_device:
            return [torch.empty_like(t) for t in tensors]
        return host_like(tensors)

    def expected_bytes(self) -> int:
        """The most the owners' copies hold together, as of now."""
        return sum(size() for size in self._sizes)

    def brief_bytes(self) -> int:
        """What the copy held through the first steps holds, as of now."""
        return self._brief[0]() if self._brief else 0

    def choose(self, device: torch.device) -> None:
        """Decide, once, and say it: on `device` where the copies fit the share of its room at the peak so far."""
        need, room = self.expected_bytes(), room_at_peak(device)
        brief = self.brief_bytes()
        self.on_device = bool(self.share) and need <= self.share * room  # a share of 0 keeps them off, however few
        self.brief_on_device = self.on_device and need + brief <= self.share * room
        if not self.announce:
            return
        if not self.share:
            logger.warning("hf_hybrid: the rollback copies are kept in pinned host memory "
                           "(--hybrid_device_copies_share 0).")
            return
        where = "on the GPU" if self.on_device else "in pinned host memory"
        why = "fit in" if self.on_device else "would take more than"
        brief_line = ""
        if brief and self.brief_on_device:
            brief_line = f"; so are {self._brief[1]} ({brief / GB:.2f} GB)"
        elif brief and self.on_device:
            brief_line = f"; {self._brief[1]} ({brief / GB:.2f} GB) stay in pinned host memory: they would not fit too"
        logger.warning(f"hf_hybrid: the rollback copies (the guard's snapshot, the outer anchor and momentum: "
                       f"{need / GB:.2f} GB at most) are kept {where}: they {why} {self.share:.0%} of the "
                       f"{room / GB:.1f} GB the GPU had free at the run's peak so far "
                       f"(--hybrid_device_copies_share){brief_line}.")
