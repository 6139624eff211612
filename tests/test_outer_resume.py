"""Checkpoints of the outer-momentum predictor: resume is bit-exact wherever it stops, made-up steps write only the
Trainer's checkpoints, and a checkpoint for other parameters is refused with a remedy."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import TrainerCallback

from hf_hybrid import HybridHFTrainer
from hf_hybrid.jumps.payoff import PayoffMeter
from hf_hybrid.jumps.predictors.outer import OuterMomentumPredictor

from .conftest import hybrid_args, make_trainer, reject_every_jump, tiny_gpt2, token_dataset
from .test_equivalence_resume import assert_bit_identical, state
from .test_outer import OUTER, run


def test_resume_with_the_outer_predictor_is_bit_identical(tmp_path):
    settings = dict(OUTER, max_steps=30, save_strategy="steps", save_steps=1, hybrid_payoff_check=False)
    full_run = make_trainer(tmp_path / "full", **settings)
    full_run.train()
    trace = [json.loads(line) for line in (tmp_path / "full" / "hybrid_trace.jsonl").read_text().splitlines()]
    first_jump = next(r["step"] for r in trace if r["phase"] == "predict")
    # Mid-cycle after a kept jump: the anchor and the momentum must come from the checkpoint.
    resumes_where_it_ended(tmp_path, settings, full_run, first_jump + 2)


def resumes_where_it_ended(tmp_path, settings: dict, full_run, step: int) -> None:
    """A run resumed from the full run's checkpoint at `step` ends with its weights and momentum, bit for bit."""
    resumed_model = tiny_gpt2(seed=123)
    resumed = HybridHFTrainer(model=resumed_model, args=hybrid_args(tmp_path / "resumed", **settings),
                              train_dataset=token_dataset())
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / f"checkpoint-{step}"))
    assert_bit_identical(state(full_run.model), state(resumed_model))
    full_buf, resumed_buf = full_run._hybrid.predictor.buf, resumed._hybrid.predictor.buf
    assert len(full_buf) == len(resumed_buf) > 0 and all(torch.equal(a, b) for a, b in zip(full_buf, resumed_buf))


def test_resume_where_the_first_kept_jump_took_the_anchors_buffers_is_bit_identical(tmp_path, monkeypatch):
    """A first cycle longer than the guard's snapshot interval ends in a kept jump: its momentum takes the anchor's
    buffers (the guard holds its own copy), so the checkpoint of that step has no anchor, and the next cycle's comes
    from the weights at the next accepted step, in the resumed run as in the uninterrupted one."""
    resume_where_the_first_kept_jump_took_the_anchor(tmp_path, monkeypatch)


def resume_where_the_first_kept_jump_took_the_anchor(tmp_path, monkeypatch, **extra) -> None:
    monkeypatch.setattr(PayoffMeter, "verdict", lambda self, gain, noise: True)
    settings = dict(OUTER, hybrid_warmup_steps=12, hybrid_guard_snapshot_steps=6, hybrid_payoff_check=True,
                    hybrid_lr_autopilot=False, max_steps=30, save_strategy="steps", save_steps=1, **extra)
    full_run = make_trainer(tmp_path / "full", **settings)
    anchor_at_step_end = {}

    class Anchor(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            anchor_at_step_end[state.global_step] = full_run._hybrid.predictor.anchor is not None

    full_run.add_callback(Anchor())
    full_run.train()
    trace = [json.loads(line) for line in (tmp_path / "full" / "hybrid_trace.jsonl").read_text().splitlines()]
    first_jump = next(r["step"] for r in trace if r["phase"] == "predict")
    assert not anchor_at_step_end[first_jump] and anchor_at_step_end[first_jump + 1]
    resumes_where_it_ended(tmp_path, settings, full_run, first_jump)


def test_the_first_momentum_in_the_anchors_buffers_is_the_one_in_new_ones_bit_for_bit(tmp_path, monkeypatch):
    """The first kept jump's momentum, written into the anchor's buffers (the guard on a copy of its own), is the one
    a new zeroed buffer would hold, to the sign of each zero, and so is everything trained after it."""
    monkeypatch.setattr(PayoffMeter, "verdict", lambda self, gain, noise: True)
    settings = dict(OUTER, hybrid_warmup_steps=12, hybrid_guard_snapshot_steps=6, hybrid_payoff_check=True,
                    hybrid_lr_autopilot=False, max_steps=30)

    def trained(folder: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        trainer = make_trainer(tmp_path / folder, **settings)
        first_bufs = []

        class FirstMomentum(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                outer = trainer._hybrid.predictor
                if outer.buf and not first_bufs:
                    first_bufs.extend(b.clone() for b in outer.buf)
                    first_bufs.append(torch.tensor(outer.anchor is None))

        trainer.add_callback(FirstMomentum())
        trainer.train()
        return first_bufs, [p.detach().clone() for p in trainer.model.parameters()]

    taken, taken_weights = trained("taken")
    monkeypatch.setattr("hf_hybrid.guard.runner.GuardAtLoop.stands_on_anchor", property(lambda self: True))
    new, new_weights = trained("new")
    assert taken[-1].item() and not new[-1].item()  # the anchor's buffers were taken in the first run only
    bits = [t.view(torch.int32) for t in (*taken[:-1], *taken_weights)], [
        t.view(torch.int32) for t in (*new[:-1], *new_weights)]
    assert len(bits[0]) == len(bits[1]) and all(torch.equal(a, b) for a, b in zip(*bits))


def test_made_up_steps_write_the_trainers_checkpoints_and_no_extra_one(tmp_path, monkeypatch):
    reject_every_jump(monkeypatch)  # every jump is made up: the run ends later than max_steps
    trainer, rows = run(tmp_path, max_steps=20, save_strategy="steps", save_steps=10, hybrid_payoff_check=True,
                        hybrid_max_rejections=0)
    made_up = trainer._hybrid.made_up_steps
    assert made_up >= 1 and trainer.state.global_step == 20 + made_up
    saved = sorted(int(p.name.split("-")[1]) for p in tmp_path.glob("checkpoint-*"))
    counted_tenth = next(i + 1 for i in range(len(rows)) if i + 1 - sum(r["rollback"] for r in rows[:i + 1]) == 10)
    assert saved == [counted_tenth, trainer.state.global_step]


def test_a_checkpoint_written_for_other_parameters_is_refused_with_a_remedy():
    saved_params = [torch.zeros(4, requires_grad=True), torch.zeros(2, 2, requires_grad=True)]
    saved = OuterMomentumPredictor(saved_params, torch.optim.AdamW(saved_params), period=30, outer_lr=0.6,
                                   momentum=0.9)
    saved.buf = [torch.zeros_like(p) for p in saved_params]  # a kept jump's momentum, without its anchor
    params = [torch.zeros(3, requires_grad=True), torch.zeros(2, 2, requires_grad=True)]
    predictor = OuterMomentumPredictor(params, torch.optim.AdamW(params), period=30, outer_lr=0.6, momentum=0.9)
    with pytest.raises(ValueError, match="outer momentum .* delete the checkpoint's hybrid_\\*.pt files"):
        predictor.load_state_dict(saved.state_dict())
