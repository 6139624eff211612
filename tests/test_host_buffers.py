"""Host buffers for accelerator tensors: packed into few pinned allocations, because PyTorch's pinned allocator rounds
each one up to a power of two."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from hf_hybrid.memory.host_buffers import packed_like, pinned_layout

GPT2_SIZES = {"124M": (12, 768, 12), "355M": (24, 1024, 16), "774M": (36, 1280, 20), "1.5B": (48, 1600, 25)}


def parameter_bytes(n_layer: int, n_embd: int, n_head: int) -> list[int]:
    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head))
    return [p.numel() * p.element_size() for p in model.parameters()]


def power_of_two_ceil(n: int) -> int:
    return 1 << (n - 1).bit_length()


@pytest.mark.parametrize("size", GPT2_SIZES)
def test_gpt2_parameters_pin_within_three_percent_of_their_bytes(size):
    sizes = parameter_bytes(*GPT2_SIZES[size])
    layout = pinned_layout(sizes)
    # One allocation per tensor would pin 1.1-1.7x the bytes (the embedding alone rounds 154 MB up to 256 MiB at 124M).
    assert sum(power_of_two_ceil(s) for s in sizes) > 1.1 * sum(sizes)
    assert sum(capacity for capacity, _ in layout) <= 1.03 * sum(sizes)
    placed = sorted(i for _, members in layout for i, _ in members)
    assert placed == list(range(len(sizes)))
    for capacity, members in layout:
        assert capacity == power_of_two_ceil(capacity)  # so the allocator adds nothing on top
        spans = sorted((offset, offset + sizes[i]) for i, offset in members)
        assert all(offset % 64 == 0 for offset, _ in spans)
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])) and spans[-1][1] <= capacity


def test_packed_buffers_hold_each_tensor_apart_whatever_its_shape_and_dtype():
    torch.manual_seed(0)
    tensors = [torch.randn(300, 70), torch.randn(5).to(torch.bfloat16), torch.tensor(7, dtype=torch.int64),
               torch.empty(0), torch.randn(3, 4, 5).double(), torch.randn(1000)]
    buffers = packed_like(tensors, pin_memory=False)
    assert [(b.shape, b.dtype) for b in buffers] == [(t.shape, t.dtype) for t in tensors]
    assert len({b.untyped_storage().data_ptr() for b in buffers}) < len(tensors)  # they share allocations
    for buffer, t in zip(buffers, tensors):
        buffer.copy_(t)
    assert all(torch.equal(b, t) for b, t in zip(buffers, tensors))  # no buffer overwrote another
