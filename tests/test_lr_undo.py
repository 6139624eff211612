"""An undone raise in a run: the weights, the batches and a resumed trial come back as the Trainer's
(autopilot/runner.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import TrainerCallback

from hf_hybrid import HybridHFTrainer
from hf_hybrid.autopilot.scale import LrScale, RaiseVerdict
from hf_hybrid.jumps.engine import HybridEngine

from .conftest import hybrid_args, make_trainer, reject_every_jump, tiny_gpt2, token_dataset
from .test_equivalence_resume import assert_bit_identical, state
from .test_lr_advice import OUTER


class WeightsAtEachStep(TrainerCallback):
    def __init__(self, model) -> None:
        self.model, self.weights = model, {}

    def on_step_begin(self, args, state, control, **kwargs):
        self.weights[state.global_step] = [p.detach().clone() for p in self.model.parameters()]


def test_an_undone_raise_puts_back_the_weights_before_its_first_update(tmp_out, monkeypatch):
    """Every raise fails its trial: right after the undo, the weights are bit for bit those before the first update
    at the raised scale, and the LR in effect is the user's schedule again. The trial outlasts an outer cycle, whose
    start moves the anchor the guard's snapshot otherwise stands on: the undo point is not moved with it."""
    original = LrScale.reading
    undone_at, raised_at, cycles_in_trial, undo_points = [], [], [], set()

    def fail_every_trial(self, f0, f1, f2, **kwargs):  # the verdict's forwards still run
        return original(self, f0, f1, f2, **{**kwargs, "trial_verdict": RaiseVerdict.WORSE})

    monkeypatch.setattr(LrScale, "reading", fail_every_trial)
    model = tiny_gpt2()
    trainer = HybridHFTrainer(model=model, args=hybrid_args(tmp_out, learning_rate=1e-4, **OUTER),
                              train_dataset=token_dataset())
    weights = WeightsAtEachStep(model)
    trainer.add_callback(weights)

    start_cycle = HybridEngine.start_cycle

    def counted_start_cycle(engine, make_room=None):
        started = start_cycle(engine, make_room)
        if started and trainer._lr_autopilot.scale.on_trial:
            cycles_in_trial.append(trainer.state.global_step)
        return started

    monkeypatch.setattr(HybridEngine, "start_cycle", counted_start_cycle)

    class CheckUndo(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            autopilot = trainer._lr_autopilot
            snapshot_step = trainer._guard_loop.snapshot.step
            if autopilot.scale.scale > 1.0 and len(raised_at) == len(undone_at):
                raised_at.append(state.global_step)
                undo_points.clear()
            if raised_at and snapshot_step is not None and snapshot_step >= raised_at[-1]:
                undo_points.add(snapshot_step)
            if autopilot.scale.trials_undone > len(undone_at):
                undone_at.append(snapshot_step)
                assert undo_points == {snapshot_step}, "the undo point moved during the trial"
                for p, before in zip(model.parameters(), weights.weights[snapshot_step]):
                    assert torch.equal(p, before)
                assert autopilot.scale.scale == 1.0
                scheduler = trainer.lr_scheduler
                assert scheduler.base_lrs[0] == 1e-4
                expected = 1e-4 * scheduler.lr_lambdas[0](scheduler.last_epoch)
                assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(expected, rel=1e-9)

    trainer.add_callback(CheckUndo())
    trainer.train()
    assert undone_at, "no raise was tried"
    assert cycles_in_trial, "no outer cycle started during a trial"
    assert trainer._hybrid.made_up_steps >= 5 * len(undone_at)  # a cycle's updates were undone each time


def fail_every_trial_and_jump(monkeypatch) -> None:
    original = LrScale.reading

    def fail_every_trial(self, f0, f1, f2, **kwargs):  # the verdict's forwards still run
        return original(self, f0, f1, f2, **{**kwargs, "trial_verdict": RaiseVerdict.WORSE})

    monkeypatch.setattr(LrScale, "reading", fail_every_trial)
    reject_every_jump(monkeypatch)


# One epoch of the larger dataset: room to make up the undone updates.
UNDONE = dict(OUTER, learning_rate=1e-4, max_steps=100, include_num_input_tokens_seen=True)


@pytest.mark.parametrize("setting", ["default", "dataloader_workers", "bf16_weights"])
def test_an_undone_raise_gives_its_batches_back_so_the_run_stays_on_the_trainers_path(tmp_path, monkeypatch, setting):
    """Every raise fails its trial and every jump is rejected: the undone updates are made up on their own batches, in
    their order, so the run ends at the plain Trainer's weights bit for bit. With dropout and evaluations, whose
    DataLoader seed draws come after as many of the Trainer's updates as the Trainer's, again after an undo. A batch
    trained again after an undo counts its tokens once, as the Trainer's did. Also with two settings users often run:
    worker processes, which load batches ahead of the loop that gives an undone trial's batches back, and a model held
    in bf16 without autocast (`torch_dtype=torch.bfloat16`), whose undo copies and moves along Adam's step are bf16."""
    fail_every_trial_and_jump(monkeypatch)
    settings = dict(UNDONE, eval_strategy="steps", eval_steps=7,
                    **(dict(dataloader_num_workers=2) if setting == "dataloader_workers" else {}))
    dtype = torch.bfloat16 if setting == "bf16_weights" else torch.float32
    held_out = token_dataset(16, seed=1)
    hybrid = make_trainer(tmp_path / "hybrid", model=tiny_gpt2(dropout=0.1).to(dtype), dataset=token_dataset(2048),
                          eval_dataset=held_out, **settings)
    hybrid.train()
    assert hybrid._lr_autopilot.scale.trials_undone >= 1 and hybrid.hybrid_stats()["predictions_kept"] == 0
    assert next(hybrid.model.parameters()).dtype == dtype
    plain = make_trainer(tmp_path / "plain", model=tiny_gpt2(dropout=0.1).to(dtype), dataset=token_dataset(2048),
                         eval_dataset=held_out, hybrid=False, **settings)
    plain.train()
    assert hybrid.state.global_step > plain.state.global_step == 100
    assert_bit_identical(state(plain.model), state(hybrid.model))
    assert hybrid.state.num_input_tokens_seen == plain.state.num_input_tokens_seen == 100 * 8 * 16
    # Logged against the updates that count, the evaluations are the Trainer's, step for step; one taken inside a trial
    # that was then undone is taken again at the same count, and that later one stands.
    evals = [[h for h in run.state.log_history if "eval_loss" in h] for run in (plain, hybrid)]
    assert len(evals[1]) > len(evals[0]) == 15 and any(h["step"] != h["hybrid/updates"] for h in evals[1])
    by_updates = {h["hybrid/updates"]: h["eval_loss"] for h in evals[1]}
    assert by_updates == {float(h["step"]): h["eval_loss"] for h in evals[0]}


def test_a_run_resumed_during_a_trial_that_is_then_undone_replays_the_same_batches(tmp_path, monkeypatch):
    """The save asks for a new undo point at the next accepted step, where both runs start recording the trial's
    batches afresh: the record itself is not checkpointed."""
    fail_every_trial_and_jump(monkeypatch)
    settings = dict(UNDONE, save_strategy="steps", save_steps=4)
    full_run = make_trainer(tmp_path / "full", model=tiny_gpt2(dropout=0.1), dataset=token_dataset(2048), **settings)
    trials = {}

    class TrialSteps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            scale = full_run._lr_autopilot.scale
            trials[state.global_step] = (scale.on_trial, scale.trials_undone)

    full_run.add_callback(TrialSteps())
    full_run.train()
    undone = full_run._lr_autopilot.scale.trials_undone
    saved = {int(path.name.split("-")[1]) for path in (tmp_path / "full").glob("checkpoint-*")}
    mid = next(step for step, (on, before) in trials.items() if on and before < undone and step in saved)
    resumed_model = tiny_gpt2(seed=123, dropout=0.1)
    resumed = HybridHFTrainer(model=resumed_model, args=hybrid_args(tmp_path / "resumed", **settings),
                              train_dataset=token_dataset(2048))
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / f"checkpoint-{mid}"))
    assert resumed._lr_autopilot.scale.trials_undone == full_run._lr_autopilot.scale.trials_undone >= 1
    assert_bit_identical(state(full_run.model), state(resumed_model))
    assert resumed.state.num_input_tokens_seen == full_run.state.num_input_tokens_seen == 100 * 8 * 16


def test_resume_during_a_trial_is_bit_identical(tmp_path):
    settings = dict(OUTER, learning_rate=1e-4, max_steps=60, save_strategy="steps", save_steps=1)
    full_run = make_trainer(tmp_path / "full", **settings)
    trials = {}

    class TrialSteps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            trials[state.global_step] = full_run._lr_autopilot.scale.on_trial

    full_run.add_callback(TrialSteps())
    full_run.train()
    mid = next(step for step, on in trials.items() if on and trials.get(step - 1))
    resumed_model = tiny_gpt2(seed=123)
    resumed = HybridHFTrainer(model=resumed_model, args=hybrid_args(tmp_path / "resumed", **settings),
                              train_dataset=token_dataset())
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / f"checkpoint-{mid}"))
    assert_bit_identical(state(full_run.model), state(resumed_model))
    resumed_state, full_state = resumed._lr_autopilot.state_dict(), full_run._lr_autopilot.state_dict()
    resumed_probe, full_probe = resumed_state.pop("probe"), full_state.pop("probe")
    assert resumed_state == full_state
    assert resumed_probe.keys() == full_probe.keys()
    assert all(torch.equal(resumed_probe[k], full_probe[k]) for k in full_probe)
    assert resumed.hybrid_stats() == full_run.hybrid_stats()
