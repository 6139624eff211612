"""Buffers kept in pinned host memory beside accelerator tensors, and the copies between the two.

Copies are queued on the current stream without blocking the host (`non_blocking`), so a device kernel queued after
them sees them done. The host is another matter: before it reads or writes such a buffer itself (saving it to a
checkpoint, loading into it, zeroing it), the copies still in flight must be waited for (`HostCopies.wait`).
On the CPU every buffer is an ordinary tensor beside its source and every copy is synchronous.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .shards import nbytes


def host_like(tensors: list[Tensor]) -> list[Tensor]:
    """Uninitialized buffers shaped like `tensors`: in pinned host memory for the accelerator's tensors, else beside
    each. The pinned ones are views into a few allocations packed by `pinned_layout`, because PyTorch's pinned-memory
    allocator rounds each allocation up to a power of two: one buffer per tensor would pin 1.1-1.7x their bytes
    at GPT-2's shapes (124M to 1.5B), the packed layout at most 1.03x."""
    pinned = iter(packed_like([t for t in tensors if t.is_cuda], pin_memory=True))
    return [next(pinned) if t.is_cuda else torch.empty_like(t) for t in tensors]


def release_cached_pinned_memory() -> None:
    """Give the pinned blocks PyTorch keeps cached for reuse back to the system. `torch.accelerator.empty_host_cache`
    is recent (not in PyTorch 2.11); from 2.5 the CUDA allocator's own private call does this, and before that the
    blocks stay cached, which costs memory, not correctness."""
    accelerator = getattr(torch, "accelerator", None)  # from PyTorch 2.6 on
    release = getattr(accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
    if release is not None:
        release()


# Each view starts on this many bytes, a multiple of every dtype's size (and of a cache line).
_ALIGN = 64


def pinned_layout(sizes: list[int]) -> list[tuple[int, list[tuple[int, int]]]]:
    """Allocations whose capacities are powers of two, holding buffers of `sizes` bytes: (capacity, [(buffer index,
    byte offset)]). First-fit decreasing into allocations as large as the largest buffer's power of two; an allocation
    whose buffers fit into smaller ones for fewer bytes is split, recursively."""
    padded = [-(-size // _ALIGN) * _ALIGN for size in sizes]

    def pack(indices: list[int], capacity: int) -> list[tuple[int, list[int]]]:
        bins: list[list[int]] = []  # the buffers' indices in each allocation
        for i in sorted(indices, key=lambda i: -padded[i]):
            target = next((b for b in bins if sum(padded[j] for j in b) + padded[i] <= capacity), None)
            if target is None:
                target = []
                bins.append(target)
            target.append(i)
        out = []
        for members in bins:
            if capacity > _ALIGN and max(padded[i] for i in members) <= capacity // 2:
                smaller = pack(members, capacity // 2)
                if sum(c for c, _ in smaller) < capacity:
                    out += smaller
                    continue
            out.append((capacity, members))
        return out

    if not sizes:
        return []
    largest = max(max(padded), _ALIGN)
    layout = []
    for capacity, members in pack(list(range(len(sizes))), 1 << (largest - 1).bit_length()):
        offsets, offset = [], 0
        for i in members:
            offsets.append((i, offset))
            offset += padded[i]
        layout.append((capacity, offsets))
    return layout


def packed_like(tensors: list[Tensor], pin_memory: bool) -> list[Tensor]:
    """Uninitialized host buffers shaped like `tensors`, as views into the allocations of `pinned_layout`."""
    buffers: list[Tensor | None] = [None] * len(tensors)
    for capacity, members in pinned_layout([nbytes(t) for t in tensors]):
        block = torch.empty(capacity, dtype=torch.uint8, pin_memory=pin_memory)
        for i, offset in members:
            t = tensors[i]
            buffers[i] = block[offset:offset + nbytes(t)].view(t.dtype).view(t.shape)
    return buffers


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
