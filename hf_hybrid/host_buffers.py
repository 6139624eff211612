"""Buffers kept in pinned host memory beside accelerator tensors, and the copies between the two.

Copies are queued on the current stream without blocking the host (`non_blocking`), so a device kernel queued after
them sees them done. The host is another matter: before it reads or writes such a buffer itself (saving it to a
checkpoint, loading into it, zeroing it), the copies still in flight must be waited for (`HostCopies.wait`).
On the CPU every buffer is an ordinary tensor beside its source and every copy is synchronous.
"""

from __future__ import annotations

import torch
from torch import Tensor


def host_like(t: Tensor) -> Tensor:
    """An uninitialized buffer shaped like `t`: in pinned host memory when `t` is on an accelerator, else beside it."""
    if t.is_cuda:
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return torch.empty_like(t)


class HostCopies:
    """Copies between tensors and their host buffers, with the last copy that crossed devices remembered, so that the
    host can wait for it before touching a host buffer."""

    def __init__(self) -> None:
        self._in_flight: torch.cuda.Event | None = None

    @torch.no_grad()
    def copy(self, dst: list[Tensor], src: list[Tensor]) -> None:
        """dst[i] = src[i], element-wise, whatever device each is on."""
        if all(d.device == s.device for d, s in zip(dst, src)):
            torch._foreach_copy_(dst, src)
            return
        for d, s in zip(dst, src):  # the multi-tensor copy is for one device
            d.copy_(s, non_blocking=True)
        self.mark()

    def fetch(self, t: Tensor, device: torch.device) -> Tensor:
        """`t` on `device` (itself if it is there already); `mark` once the fetches are queued."""
        return t.to(device, non_blocking=True)

    def mark(self) -> None:
        """Remember the copies queued so far on the accelerator's stream."""
        if torch.cuda.is_initialized():
            self._in_flight = torch.cuda.Event()
            self._in_flight.record()

    def wait(self) -> None:
        """Before the host itself reads or writes a host buffer: the copies to and from it have finished."""
        if self._in_flight is not None:
            self._in_flight.synchronize()
            self._in_flight = None
