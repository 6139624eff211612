"""The learning-rate autopilot in a run: a judged, reversible multiplier on the user's schedule (autopilot/runner.py),
what it logs and names, and when it is off; the verdict's counterfactual (autopilot/verdict.py)."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from accelerate.optimizer import AcceleratedOptimizer
from transformers import TrainerCallback

from hf_hybrid import HybridHFTrainer
from hf_hybrid.autopilot.line import SPACING
from hf_hybrid.autopilot.scale import RaiseVerdict
from hf_hybrid.autopilot.verdict import raise_gain
from hf_hybrid.loop.adam_state import unreadable_optimizer
from hf_hybrid.loop.forward_checks import probe_loss, probe_loss_by_sequence
from hf_hybrid.memory.snapshot import WeightSnapshot

from .conftest import hybrid_args, make_trainer, tiny_gpt2, token_dataset
from .test_equivalence_resume import assert_bit_identical, state
from .test_lr_advice import OUTER


def learning_rates(trainer) -> list[float]:
    return [entry["learning_rate"] for entry in trainer.state.log_history if "learning_rate" in entry]


def test_a_too_small_lr_is_raised_logged_and_named(tmp_out, caplog):
    trainer = make_trainer(tmp_out, learning_rate=1e-4, **{**OUTER, "logging_steps": 1})
    with caplog.at_level(logging.WARNING):
        trainer.train()
    scale = trainer._lr_autopilot.scale
    assert scale.scale > 2.0 and scale.raises_kept >= 1
    logged = [entry["hybrid/lr_scale"] for entry in trainer.state.log_history if "hybrid/lr_scale" in entry]
    assert logged[0] == 1.0 and logged[-1] == scale.scale
    # The schedule carries the scale: its base LR is the user's times the scale, and the LRs in effect went above
    # the user's peak while keeping the schedule's shape (linear decay here: the run ends near 0).
    assert trainer.lr_scheduler.base_lrs == [pytest.approx(1e-4 * scale.scale)] * 2
    lrs = learning_rates(trainer)
    assert max(lrs) > 2e-4 and lrs[-1] < 1e-4 * scale.scale / 10
    raised = trainer._lr_autopilot.learning_rate
    assert f"raised the learning rate {scale.scale:.1f}x: 0.0001 -> {raised:.2g}" in caplog.text
    assert f"pass --learning_rate {raised:.2g} next time" in caplog.text
    assert "looks too small" not in caplog.text  # the autopilot's line says it
    assert trainer.hybrid_stats()["lr_raises_kept_even"] == 0


def test_raises_kept_on_even_verdicts_are_counted_and_the_end_line_asks_for_a_comparison(tmp_out, caplog, monkeypatch):
    """Every verdict reads the raise behind the user's LR, within the noise: each raise is kept, counted as even, and
    the end line does not advise the raised LR alone."""
    monkeypatch.setattr("hf_hybrid.autopilot.runner.raise_gain", lambda *args: (-0.01, 0.02))
    trainer = make_trainer(tmp_out, learning_rate=1e-4, **OUTER)
    with caplog.at_level(logging.WARNING):
        trainer.train()
    stats, raised = trainer.hybrid_stats(), trainer._lr_autopilot.learning_rate
    assert stats["lr_raises_kept"] >= 1 and stats["lr_raises_kept_even"] == stats["lr_raises_kept"], stats
    assert f"compare --learning_rate 0.0001 and {raised:.2g} before passing the higher one" in caplog.text
    assert "next time" not in caplog.text


def test_the_flag_off_keeps_the_users_lr_exactly(tmp_out, caplog):
    trainer = make_trainer(tmp_out, learning_rate=1e-4, hybrid_lr_autopilot=False, **{**OUTER, "logging_steps": 1})
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert trainer._lr_autopilot is None
    assert max(learning_rates(trainer)) == 1e-4
    assert "--hybrid_lr_autopilot true" in caplog.text  # the too-small line names the flag


def test_without_the_guard_it_is_off_and_says_why(tmp_out, caplog):
    with caplog.at_level(logging.WARNING):
        trainer = make_trainer(tmp_out, learning_rate=1e-4, hybrid_guard=False, **{**OUTER, "max_steps": 30})
        trainer.train()
    assert trainer._lr_autopilot is None
    assert "the learning-rate autopilot is off for this run: it needs the guard's snapshots" in caplog.text


@pytest.mark.parametrize("kind", ["OneCycleLR", "MultiplicativeLR"])
def test_under_a_scheduler_it_cannot_scale_it_is_off_and_names_that_scheduler(tmp_out, caplog, kind):
    """MultiplicativeLR has `lr_lambdas` too, but each is a step's factor, not the schedule's."""
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scheduler = (torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-4, total_steps=30) if kind == "OneCycleLR"
                 else torch.optim.lr_scheduler.MultiplicativeLR(optimizer, lambda step: 0.99))
    trainer = HybridHFTrainer(model=model, args=hybrid_args(tmp_out, learning_rate=1e-4, **{**OUTER, "max_steps": 30}),
                              train_dataset=token_dataset(), optimizers=(optimizer, scheduler))
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert trainer._lr_autopilot is None and trainer.hybrid_stats()["lr_readings"] == 0
    assert "the learning-rate autopilot is off for this run: it needs a schedule that scales" in caplog.text
    assert f"this run's is a {kind}" in caplog.text


def test_a_raise_is_judged_against_where_the_users_lr_would_have_gone_and_the_weights_come_back(tmp_out):
    """The verdict's counterfactual: the probe at W0 + (W - W0) / raise, with W0 the guard's snapshot (the trial's
    undo point), against the probe at W; paired by sequence."""
    trainer = make_trainer(tmp_out, learning_rate=1e-3, lr_scheduler_type="constant", **{**OUTER, "max_steps": 12})
    trainer.train()
    model, engine, snapshot = trainer.model, trainer._hybrid, trainer._guard_loop.snapshot
    probe = trainer._lr_autopilot.probe
    start = [t.clone() for t in snapshot.weight_copies()]
    before = state(model)
    assert any(not torch.equal(p, w0) for p, w0 in zip(engine.params, start))
    scratch = WeightSnapshot()
    at_raised_weights = probe_loss_by_sequence(trainer, model, probe)  # as the reading's first forward reads them
    gain, noise = raise_gain(trainer, model, engine.shards(), scratch, probe, snapshot, 3.0, at_raised_weights)
    assert_bit_identical(state(model), before)
    assert not scratch.valid and not engine.jump_open
    raised = float(probe_loss(trainer, model, probe))
    with torch.no_grad():
        for p, w0 in zip(engine.params, start):
            p.copy_(w0 + (p - w0) / 3.0)
    assert gain == pytest.approx(float(probe_loss(trainer, model, probe)) - raised, abs=1e-5)
    assert gain != 0.0 and noise > 0.0


def test_a_verdict_cut_off_at_its_forward_puts_the_weights_back(tmp_out, monkeypatch):
    """Ctrl-C, or an out-of-memory error, while the probe reads the weights moved toward the undo point."""
    trainer = make_trainer(tmp_out, learning_rate=1e-3, lr_scheduler_type="constant", **{**OUTER, "max_steps": 12})
    trainer.train()
    model, engine, snapshot = trainer.model, trainer._hybrid, trainer._guard_loop.snapshot
    probe, before = trainer._lr_autopilot.probe, state(model)
    at_raised_weights = probe_loss_by_sequence(trainer, model, probe)

    def cut_off(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("hf_hybrid.autopilot.verdict.probe_loss_by_sequence", cut_off)
    scratch = WeightSnapshot()
    with pytest.raises(KeyboardInterrupt):
        raise_gain(trainer, model, engine.shards(), scratch, probe, snapshot, 3.0, at_raised_weights)
    assert_bit_identical(state(model), before)
    assert not scratch.valid


@pytest.mark.parametrize(("gain", "noise", "verdict"), [
    (0.01, 0.0, RaiseVerdict.SHOWN), (0.05, 0.02, RaiseVerdict.SHOWN), (0.03, 0.02, RaiseVerdict.EVEN),
    (-0.03, 0.02, RaiseVerdict.EVEN), (-0.05, 0.02, RaiseVerdict.WORSE), (-1e-6, 0.0, RaiseVerdict.WORSE)])
def test_a_raise_is_undone_only_when_it_did_worse_by_more_than_the_noise(tmp_out, monkeypatch, gain, noise, verdict):
    trainer = make_trainer(tmp_out, learning_rate=1e-3, lr_scheduler_type="constant", **{**OUTER, "max_steps": 12})
    trainer.train()
    autopilot = trainer._lr_autopilot
    autopilot.scale.trial_from = autopilot.scale.scale / 2
    asked = []

    def scripted(trainer, model, shards, scratch, probe, undo_point, raise_, raised):
        asked.append(raise_)
        return gain, noise

    monkeypatch.setattr("hf_hybrid.autopilot.runner.raise_gain", scripted)
    raised = (torch.tensor(4.0), None)
    assert autopilot._raise_verdict(raised) is verdict  # the default margin: 2 standard errors
    assert asked == [pytest.approx(2.0)] and autopilot.last_verdict == (gain, noise)
    trainer._guard_loop.snapshot.invalidate()  # no undo point: nothing to judge against
    assert autopilot._raise_verdict(raised) is RaiseVerdict.WORSE and len(asked) == 1


def other_optimizer(kind: str, model) -> torch.optim.Optimizer:
    """Optimizers that keep Adam's hyperparameters (betas, eps) but do not step by Adam's formula alone."""
    if kind == "prodigy":
        from prodigyopt import Prodigy
        return Prodigy(model.parameters(), lr=1.0)
    if kind == "mechanic":
        from mechanic_pytorch import mechanize
        return mechanize(torch.optim.AdamW)(model.parameters(), lr=1e-4)
    return torch.optim.AdamW(model.parameters(), lr=1e-4, amsgrad=True)


@pytest.mark.parametrize("kind, name", [("sgd", "SGD"), ("schedule_free_adamw", "AdamWScheduleFree"),
                                        ("prodigy", "Prodigy"), ("mechanic", "MechanizedAdamW"), ("amsgrad", "AdamW")])
def test_with_an_optimizer_it_cannot_read_it_is_off_names_it_and_trains(tmp_out, caplog, kind, name):
    """Schedule-free AdamW and Prodigy keep no Adam step count (the readings failed on them); Mechanic's multiplier
    and amsgrad's maximum make another step than the one a reading would move along."""
    settings = {**OUTER, "max_steps": 12, "learning_rate": 1e-4}
    model, optimizers = tiny_gpt2(), (None, None)
    if kind in ("sgd", "schedule_free_adamw"):
        settings.update(optim=kind, lr_scheduler_type="constant")
    else:
        optimizers = (other_optimizer(kind, model), None)
    with caplog.at_level(logging.WARNING):
        trainer = HybridHFTrainer(model=model, args=hybrid_args(tmp_out, **settings), train_dataset=token_dataset(),
                                  optimizers=optimizers)
        trainer.train()
    assert trainer._lr_autopilot is None and trainer.state.global_step >= 12
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert ("the learning-rate autopilot is off for this run: it needs torch's Adam or AdamW without amsgrad (every "
            f"--optim adamw_torch*), whose next step it reads (this run's optimizer: {name})") in caplog.text


def test_it_reads_every_form_of_torchs_adam_through_accelerates_wrapper():
    params = [torch.nn.Parameter(torch.ones(3))]
    for optimizer in (torch.optim.Adam(params), torch.optim.AdamW(params), torch.optim.AdamW(params, foreach=True),
                      torch.optim.AdamW(params, fused=True)):
        assert unreadable_optimizer(optimizer) is None
        assert unreadable_optimizer(AcceleratedOptimizer(optimizer, device_placement=False)) is None


def test_a_reading_that_judges_a_raise_reads_the_raised_weights_from_its_line(tmp_out, monkeypatch):
    """A reading runs three probe forwards; one that also judges a raise runs one more (the user's LR's point), not
    two: the raised point is the line's first. Every line reads 10 steps and the first steps read aligned, so the run
    raises at its reading at step 12 and judges the raise at the next, at step 22."""
    monkeypatch.setattr("hf_hybrid.autopilot.scale.reach_of_line", lambda f0, f1, f2: 10.0 / SPACING)
    monkeypatch.setattr("hf_hybrid.autopilot.alignment.ALIGNED", -math.inf)
    trainer = make_trainer(tmp_out, learning_rate=1e-4, warmup_steps=20, lr_scheduler_type="constant_with_warmup",
                           **{**OUTER, "max_steps": 34})
    forwards, verdicts = [0], {}
    compute_loss = trainer.compute_loss

    def counted(*args, **kwargs):
        forwards[0] += 1
        return compute_loss(*args, **kwargs)

    class PerStep(TrainerCallback):
        def __init__(self) -> None:
            self.at_end = {}

        def on_step_end(self, args, state, control, **kwargs):
            self.at_end[state.global_step] = forwards[0]
            verdicts[state.global_step] = trainer._lr_autopilot.last_verdict

    monkeypatch.setattr(trainer, "compute_loss", counted)
    trainer.add_callback(per_step := PerStep())
    trainer.train()
    added = {step: per_step.at_end[step] - per_step.at_end[step - 1] for step in (12, 13, 22)}
    assert verdicts[22] is not None and verdicts[12] is None  # the trial was judged at step 22
    # Step 13 trains and reads nothing (its one forward is the training step's).
    assert added[12] - added[13] == 3 and added[22] - added[13] == 4, added
