"""Where the rollback copies go on a GPU (memory/placement.py): the choice against the share of the room at the peak,
and the bytes each owner says it may hold. On a GPU, tests/test_cuda_memory.py checks the copies' place and that the run
is the same bit for bit either way."""

from __future__ import annotations

import logging

import pytest
import torch

from hf_hybrid.memory import placement as placement_module
from hf_hybrid.memory.placement import CopyPlacement

from .conftest import make_trainer

GB = 10**9


@pytest.mark.parametrize("room, share, on_device, says", [
    (60 * GB, 0.1, True, "kept on the GPU: they fit in 10% of the 60.0 GB"),
    (40 * GB, 0.1, False, "kept in pinned host memory: they would take more than 10% of the 40.0 GB"),
    (600 * GB, 0.0, False, "kept in pinned host memory (--hybrid_device_copies_share 0)"),
])
def test_the_copies_go_on_the_device_only_within_the_share_of_the_room_at_the_peak(monkeypatch, caplog, room, share,
                                                                                   on_device, says):
    monkeypatch.setattr(placement_module, "room_at_peak", lambda device: room)
    placement = CopyPlacement(share)
    placement.expect(lambda: 3 * GB)
    placement.expect(lambda: 2 * GB)
    with caplog.at_level(logging.WARNING):
        placement.choose(torch.device("cuda", 0))
    assert placement.on_device is on_device
    assert says in caplog.text and caplog.text.count("hf_hybrid:") == 1


def test_a_share_of_0_keeps_the_copies_on_the_host_however_few_bytes_they_take(monkeypatch):
    monkeypatch.setattr(placement_module, "room_at_peak", lambda device: 600 * GB)
    placement = CopyPlacement(0.0, announce=False)
    placement.choose(torch.device("cuda", 0))
    assert placement.on_device is False


def test_on_the_cpu_nothing_is_chosen_and_the_buffers_lie_beside_the_tensors():
    placement = CopyPlacement(1.0)
    tensors = [torch.randn(3, 2), torch.randn(4)]
    buffers = placement.buffers_like(tensors)
    assert placement.on_device is None
    assert [(b.shape, b.device, b.is_pinned()) for b in buffers] == [(t.shape, t.device, False) for t in tensors]


@pytest.mark.parametrize("predictor, guard_snapshots, copies", [("outer", 50, 5), ("outer", 0, 2), ("velocity", 50, 3)])
def test_the_budget_counts_the_guards_snapshot_and_the_outer_anchor_and_momentum(tmp_out, predictor, guard_snapshots,
                                                                                  copies):
    """AdamW's snapshot is the weights and two moments (3x the parameters), the outer predictor's anchor and momentum
    2x more; a velocity predictor keeps its buffer beside the weights, out of this budget."""
    trainer = make_trainer(tmp_out, hybrid_predictor=predictor, hybrid_guard_snapshot_steps=guard_snapshots,
                           max_steps=3)
    trainer.train()
    params = sum(p.numel() * p.element_size() for p in trainer.model.parameters() if p.requires_grad)
    assert trainer.hybrid_engine.placement.expected_bytes() == copies * params
