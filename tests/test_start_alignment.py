"""The first steps' alignment (autopilot/alignment.py): what it measures, what it lets a raise do, and that a run
resumed inside its window reads the same."""

from __future__ import annotations

import pytest
import torch
from transformers import TrainerCallback

from hf_hybrid import HybridHFTrainer
from hf_hybrid.autopilot.alignment import FIRST_STEP, LAST_STEP
from hf_hybrid.autopilot.scale import MAX_ALIGNED_RAISE, MAX_RAISE, MAX_SCALE, MAX_STRONGLY_ALIGNED_RAISE, LrScale

from .conftest import hybrid_args, make_trainer, tiny_gpt2, token_dataset
from .test_equivalence_resume import assert_bit_identical, state
from .test_lr_advice import OUTER
from .test_lr_scale import read


class MechanicSignal(TrainerCallback):
    """The signal as scripts/warmup_evidence.py measures it, on whole flattened tensors: before each update, the
    cosine between the gradient and the displacement since the start, negated."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.by_step = model, {}

    def _flat(self, grads: bool) -> torch.Tensor:
        def value(p: torch.Tensor) -> torch.Tensor:
            return (torch.zeros_like(p) if p.grad is None else p.grad) if grads else p

        return torch.cat([value(p).detach().reshape(-1).double() for p in self.model.parameters() if p.requires_grad])

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = self._flat(grads=False)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        away = self._flat(grads=False) - self.start
        if away.any():
            cosine = torch.nn.functional.cosine_similarity(self._flat(grads=True), away, dim=0)
            self.by_step[state.global_step + 1] = -float(cosine)


def test_the_alignment_is_the_gradients_cosine_with_the_way_come_negated_over_its_window(tmp_out):
    model = tiny_gpt2()
    trainer = make_trainer(tmp_out, model=model, learning_rate=1e-4, **{**OUTER, "max_steps": 20})
    signal = MechanicSignal(model)
    trainer.add_callback(signal)
    trainer.train()
    window = [signal.by_step[step] for step in range(FIRST_STEP, LAST_STEP + 1)]
    alignment = trainer._lr_autopilot.alignment
    assert trainer.hybrid_stats()["lr_start_alignment"] == pytest.approx(sum(window) / len(window), abs=1e-5)
    assert alignment.count == len(window)
    # 30x below the LR the other tests train this model at, the gradient keeps pointing on along the way come (0.17).
    assert alignment.aligned and not alignment.opposed
    assert not alignment.start.valid and alignment.start.tensors is None  # the start's copy is gone after the window


def test_an_aligned_run_raises_on_one_long_reading_by_up_to_4x_a_strongly_aligned_one_by_all_the_line_asks():
    def aligned_read(s: LrScale, loss: float, bottom: float, strongly: bool = False) -> str | None:
        return s.reading(*line(loss, bottom), spacing=4.0, steps=10, schedule_factor=1.0, frozen=False, aligned=True,
                         strongly_aligned=strongly)

    plain, aligned, strongly = LrScale(), LrScale(), LrScale()
    # A line 12 steps long: 6x asked for. The plain scale needs it twice, with progress between; the aligned one
    # raises on the first reading, by MAX_ALIGNED_RAISE; the strongly aligned one by all of it.
    assert read(plain, 5.0, bottom=12.0) is None and read(plain, 4.9, bottom=12.0) == "raise"
    assert aligned_read(aligned, 5.0, bottom=12.0) == "raise"
    assert aligned_read(strongly, 5.0, bottom=12.0, strongly=True) == "raise"
    assert plain.scale == MAX_RAISE and aligned.scale == MAX_ALIGNED_RAISE == 4.0
    assert strongly.scale == pytest.approx(6.0)
    # A 100-step line asks for 50x: the cap bounds it.
    assert aligned_read(far := LrScale(), 5.0, bottom=100.0, strongly=True) == "raise"
    assert far.scale == MAX_STRONGLY_ALIGNED_RAISE == MAX_SCALE
    # A 5-step line asks for 2.5x: aligned, that is what it gets; a short line asks for nothing.
    assert aligned_read(five := LrScale(), 5.0, bottom=5.0) == "raise" and five.scale == pytest.approx(2.5)
    assert aligned_read(short := LrScale(), 5.0, bottom=2.0) is None and short.scale == 1.0
    # Where the probe loss rose since the last reading, no raise, aligned or not.
    rising = LrScale(last_loss=4.0)
    assert aligned_read(rising, 4.5, bottom=12.0) is None and rising.scale == 1.0
    # A steady reach (a median of 1.5 steps: 3x asked for) is the noisy evidence: 2x at most, aligned or not.
    steady = LrScale(last_loss=5.0, recent=(1.5, 1.5))
    assert aligned_read(steady, 4.9, bottom=1.5) == "raise" and steady.scale == MAX_RAISE


def test_a_run_whose_first_steps_read_opposed_never_raises_whatever_its_lines_read():
    """Two long lines in a row, or a steady reach, ask for a raise; a run whose gradient pointed back along the way it
    had come over its first steps (its steps overshoot) takes none, and its readings still hold the jumps back."""
    def opposed_read(s: LrScale, loss: float, bottom: float, opposed: bool) -> str | None:
        return s.reading(*line(loss, bottom), spacing=4.0, steps=10, schedule_factor=1.0, frozen=False,
                         opposed=opposed)

    for opposed in (False, True):
        twice, steady = LrScale(), LrScale(last_loss=5.0, recent=(1.5, 1.5))
        decisions = [opposed_read(twice, 5.0, bottom=12.0, opposed=opposed),
                     opposed_read(twice, 4.9, bottom=12.0, opposed=opposed),
                     opposed_read(steady, 4.9, bottom=1.5, opposed=opposed)]
        if opposed:
            assert decisions == [None, None, None] and twice.scale == steady.scale == 1.0
            assert not twice.on_trial and not steady.on_trial
        else:
            assert decisions == [None, "raise", "raise"] and twice.scale == MAX_RAISE == steady.scale
    quiet = LrScale()
    opposed_read(quiet, 5.0, bottom=1.0, opposed=True)
    assert quiet.steps_long_enough


def line(loss: float, bottom: float) -> tuple[float, float, float]:
    """The probe's losses along a line that bottoms out `bottom` steps out (test_lr_scale.read's)."""
    u = bottom / 4.0
    return tuple(loss + 0.01 * ((x - u) ** 2 - u**2) for x in (0.0, 1.0, 2.0))


def test_a_run_resumed_inside_the_window_reads_the_same_alignment_and_ends_bit_for_bit(tmp_path):
    settings = dict(OUTER, learning_rate=1e-4, max_steps=24, save_strategy="steps", save_steps=5)
    full_run = make_trainer(tmp_path / "full", **settings)
    full_run.train()
    resumed_model = tiny_gpt2(seed=123)
    resumed = HybridHFTrainer(model=resumed_model, args=hybrid_args(tmp_path / "resumed", **settings),
                              train_dataset=token_dataset())
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-5"))  # steps 3-5 read, 6-10 to come
    assert resumed.hybrid_stats() == full_run.hybrid_stats()
    assert full_run.hybrid_stats()["lr_start_alignment"] != 0.0
    assert_bit_identical(state(full_run.model), state(resumed_model))
