"""Where the rollback copies go on a GPU (memory/placement.py): the choice against the share of the room at the peak,
and the bytes each owner says it may hold, the autopilot's start weights apart. On a GPU, tests/test_cuda_memory.py
checks the copies' place and that the run is the same bit for bit either way."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import TrainerCallback

from hf_hybrid.autopilot.alignment import LAST_STEP
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


@pytest.mark.parametrize("room, on_device, brief_on_device, says", [
    (60 * GB, True, True, "; so are the first steps' copy (1.00 GB)."),
    (55 * GB, True, False, "; the first steps' copy (1.00 GB) stay in pinned host memory: they would not fit too."),
    (40 * GB, False, False, "would take more than 10% of the 40.0 GB"),
])
def test_the_copy_held_through_the_first_steps_goes_on_the_device_only_where_it_fits_beside_the_lasting_ones(
        monkeypatch, caplog, room, on_device, brief_on_device, says):
    """It never sends the lasting copies to the host: at 55 GB they fit 10% without it, not with it."""
    monkeypatch.setattr(placement_module, "room_at_peak", lambda device: room)
    placement = CopyPlacement(0.1)
    placement.expect(lambda: 5 * GB)
    placement.expect_brief(lambda: 1 * GB, "the first steps' copy")
    with caplog.at_level(logging.WARNING):
        assert placement.brief_copy_on(torch.device("cuda", 0)) is brief_on_device
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


class BriefBytes(TrainerCallback):
    """The brief bytes before the first step (no copy yet) and at each step's end."""

    def __init__(self) -> None:
        self.trainer, self.seen = None, []

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 0:
            self.seen.append((0, self.trainer.hybrid_engine.placement.brief_bytes()))

    def on_step_end(self, args, state, control, **kwargs):
        self.seen.append((state.global_step, self.trainer.hybrid_engine.placement.brief_bytes()))


def test_the_autopilots_start_weights_are_counted_apart_until_its_window_closes(tmp_out):
    """One copy of the trainable weights while the first steps' alignment is read (autopilot/alignment.py), counted
    before the copy exists (a resumed run places its copies at the load, before this part's), and 0 from its last step
    on; the lasting copies' count leaves it out."""
    trainer = make_trainer(tmp_out, max_steps=LAST_STEP + 2, hybrid_predictor="outer", hybrid_warmup_steps=100)
    seen = BriefBytes()
    seen.trainer = trainer
    trainer.add_callback(seen)
    trainer.train()
    params = sum(p.numel() * p.element_size() for p in trainer.model.parameters() if p.requires_grad)
    assert seen.seen == [(step, params if step < LAST_STEP else 0) for step in range(LAST_STEP + 3)]
    assert trainer.hybrid_engine.placement.expected_bytes() == 5 * params


@pytest.mark.parametrize("resume_at, counted", [(5, True), (10, False)])
def test_a_run_resumed_inside_the_window_counts_the_start_weights_and_one_resumed_past_it_does_not(
        tmp_path, monkeypatch, resume_at, counted):
    """A resumed run places its copies where the outer anchor's buffers are made as the engine loads (on a GPU, the
    choice), before the autopilot's state says whether its window closed: the steps already made say it."""
    flags = dict(max_steps=LAST_STEP + 2, hybrid_predictor="outer", hybrid_warmup_steps=100, save_strategy="steps",
                 save_steps=5)
    make_trainer(tmp_path, **flags).train()
    at_first_buffers = []
    buffers_like = CopyPlacement.buffers_like

    def recorded(self, tensors):
        at_first_buffers.append(self.brief_bytes())
        return buffers_like(self, tensors)

    monkeypatch.setattr(CopyPlacement, "buffers_like", recorded)
    trainer = make_trainer(tmp_path, **flags)
    trainer.train(resume_from_checkpoint=str(tmp_path / f"checkpoint-{resume_at}"))
    params = sum(p.numel() * p.element_size() for p in trainer.model.parameters() if p.requires_grad)
    assert at_first_buffers[0] == (params if counted else 0)
