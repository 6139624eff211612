"""Memory across many Predict phases: no growth."""

from __future__ import annotations

import gc

import torch
from transformers import TrainerCallback

from hf_hybrid import Phase

from .conftest import make_trainer


def live_tensor_bytes() -> int:
    gc.collect()
    total = 0
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and not obj.is_meta:
                total += obj.untyped_storage().nbytes()
        except Exception:  # objects that refuse inspection (weakly referenced, half-built) hold no tensors of ours
            continue
    return total


class CycleMemory(TrainerCallback):
    """Memory in use, as `measure` reads it, each time a Predict/Correct cycle has just ended."""

    def __init__(self, measure=live_tensor_bytes) -> None:
        self.trainer = None
        self.measure = measure
        self.samples = []

    def on_step_end(self, args, state, control, **kwargs):
        engine = self.trainer._hybrid
        if engine.last_record.phase is Phase.CORRECT and engine.controller.phase is not Phase.CORRECT:
            self.samples.append(self.measure())


def test_memory_does_not_grow_over_many_predict_phases(tmp_out):
    recorder = CycleMemory()
    # Without the guard, whose first snapshot would land mid-run (its buffers' reuse is tested in test_guard.py).
    trainer = make_trainer(tmp_out, max_steps=90, logging_steps=1000, hybrid_guard=False)
    trainer.add_callback(recorder)
    recorder.trainer = trainer
    trainer.train()
    assert trainer.hybrid_stats()["predict_steps"] >= 30
    samples = recorder.samples
    assert len(samples) >= 8
    # Buffers (anchor, velocity, dynamics) are allocated in the first cycles, then only reused; the undo copy exists
    # only while a jump is open, so a cycle followed by another Predict phase holds it and one followed by Full does
    # not. Nothing grows: the later cycles hold no more than the earlier ones.
    settled = samples[2:]
    half = len(settled) // 2
    assert max(settled[half:]) <= max(settled[:half]) + 64 * 1024, settled
