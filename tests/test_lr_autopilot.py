"""The learning-rate autopilot: a judged, reversible multiplier on the user's schedule (autopilot/scale.py,
autopilot/runner.py)."""

from __future__ import annotations

import logging
import math
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import TrainerCallback

from hf_hybrid import HybridHFTrainer
from hf_hybrid.autopilot.line import SPACING, _move_along_next_step, _step_groups, next_step_line
from hf_hybrid.autopilot.scale import LrScale, reach_of_line
from hf_hybrid.autopilot.verdict import raise_gain
from hf_hybrid.jumps.engine import HybridEngine
from hf_hybrid.loop.forward_checks import probe_loss
from hf_hybrid.memory.snapshot import WeightSnapshot

from .conftest import hybrid_args, make_trainer, reject_every_jump, tiny_gpt2, token_dataset
from .test_equivalence_resume import assert_bit_identical, state
from .test_lr_advice import OUTER


def read(s: LrScale, loss: float, bottom: float, steps: int = 10, schedule_factor: float = 1.0,
         frozen: bool = False, paid: bool = False) -> str | None:
    """A reading whose probe loss at the weights is `loss` and whose line along the next step bottoms out `bottom`
    steps out; `paid`: the verdict on a raise under trial."""
    u = bottom / SPACING  # the bottom in units of the line's spacing
    f0, f1, f2 = (loss + 0.01 * ((x - u) ** 2 - u**2) for x in (0.0, 1.0, 2.0))
    return s.reading(f0, f1, f2, spacing=SPACING, steps=steps, schedule_factor=schedule_factor, frozen=frozen,
                     trial_paid=paid)


def test_the_reach_is_where_the_line_bottoms_out():
    assert reach_of_line(9.0, 4.0, 1.0) == pytest.approx(3.0)
    assert reach_of_line(0.64, 0.04, 1.44) == pytest.approx(0.8)
    assert reach_of_line(3.0, 2.0, 1.0) == math.inf  # still falling, no curvature
    assert reach_of_line(1.0, 1.5, 3.0) == 0.0  # rose from the start
    assert reach_of_line(1.0, float("nan"), 0.5) == 0.0


def test_a_raise_needs_a_long_line_twice_and_progress_and_is_kept_when_its_steps_pay():
    s = LrScale()
    assert read(s, 5.0, bottom=12.0) is None  # the first reading has no progress to compare
    for loss in (4.9, 4.85):
        assert read(s, loss, bottom=0.0) is None  # the loss rose along the line: the steps are long enough
    # One long reading is not enough: from scratch at a third of the swept LR the first one after the first descent
    # read 10.8 steps and the next 2.2, and a raise on the first made the run end worse than the Trainer.
    assert read(s, 4.8, bottom=12.0) is None
    for loss, bottom in ((4.75, 0.5), (4.72, 0.6), (4.7, 6.0)):
        assert read(s, loss, bottom=bottom) is None
    assert read(s, 4.65, bottom=5.0) == "raise"  # twice in a row: aimed at the shorter's bottom 2 steps out, capped
    assert s.scale == pytest.approx(2.0) and s.on_trial and s.trial_raise == pytest.approx(2.0)
    # Kept on the verdict alone, however the progress per step compares with the window before (here 0.1x of it).
    # The reading before the raise counts at the new scale: 5 steps then are 2.5 now, under the gate.
    assert read(s, 4.645, bottom=9.0, paid=True) == "keep"
    assert s.scale == pytest.approx(2.0) and not s.on_trial and s.raises_kept == 1
    assert read(s, 4.6, bottom=40.0) == "raise" and s.scale == pytest.approx(4.0)  # 9 and 40: 2x at most


def test_from_scratch_near_the_swept_lr_a_first_descent_reading_raises_no_further_than_the_best_lr():
    """The lines read by survey-scratch-2x128-docs-constant (seed 0, docs/benchmarks-history.md, session 33) with no
    raise made, one reading every 10 steps from the first one a raise may start at. Its Trainer ends at 4.901 at 1e-3,
    4.780 at 2e-3, 4.807 at 3e-3 and 5.139 at 4e-3: a 4x raise on the first reading at 1e-3 led at step 40 and ended
    0.054 above the Trainer. Now 1e-3 doubles once, at the third reading, on the steady median, and 2e-3 never
    raises."""
    def decisions(reaches: list[float]) -> list[str | None]:
        s = LrScale()
        read(s, 6.0, bottom=30.0, frozen=True)  # the reading as the first descent ends: a rate, no evidence
        return [read(s, 5.9 - i / 100, bottom=b, paid=True) for i, b in enumerate(reaches)]

    assert decisions([10.8, 2.2, 1.7, 1.4, 0.0, 0.0]) == [None, None, "raise", "keep", None, None]  # 1e-3 -> 2e-3
    assert decisions([4.1, 0.0, 0.0, 0.0, 0.0, 0.7]) == [None] * 6  # 2e-3
    assert decisions([16.1, 44.1]) == [None, "raise"]  # 3e-4, a tenth: the line reads long twice


def test_a_steady_line_raises_where_one_long_reading_among_short_ones_does_not():
    """Readings under the single-reading gate: three in a row whose median is a line a step or more long raise, sized
    to bring the median to half a step; at a tuned LR most lines read 0, and a lone longer one is noise."""
    tuned = LrScale()
    for i, bottom in enumerate((0.0, 1.9, 0.0, 0.0, 3.5, 0.0)):
        assert read(tuned, 5.0 - i / 10, bottom=bottom) is None
    assert tuned.scale == 1.0
    small = LrScale()
    assert [read(small, 5.0 - i / 10, bottom=b) for i, b in enumerate((1.2, 1.6, 1.4))] == [None, None, "raise"]
    assert small.trial_raise == pytest.approx(2.0)  # a median of 1.4 asks for 2.8x, capped at MAX_RAISE
    # Kept: the readings before the trial were at the old scale, so the next steady reach starts from the verdict's.
    assert read(small, 4.6, bottom=1.5, paid=True) == "keep" and small.recent == pytest.approx((1.5,), rel=1e-4)
    assert read(small, 4.5, bottom=1.5) is None
    assert read(small, 4.4, bottom=1.5) == "raise"
    assert small.scale == pytest.approx(4.0)  # 1.5 asks for 3x, capped
    frozen = LrScale()  # readings in the schedule's warmup or final decay are not evidence about its peak
    for i in range(3):
        assert read(frozen, 5.0 - i / 10, bottom=1.5, frozen=True) is None
    assert read(frozen, 4.6, bottom=1.5) is None and frozen.recent == pytest.approx((1.5,), rel=1e-4)
    resumed = LrScale()
    resumed.load_state_dict(frozen.state_dict())
    assert resumed == frozen  # the steady window resumes where it was


def test_a_raise_whose_steps_do_not_pay_is_undone_and_the_next_waits():
    s = LrScale()
    read(s, 5.0, bottom=12.0)
    assert read(s, 4.9, bottom=12.0) == "raise"
    assert read(s, 4.5, bottom=12.0, paid=False) == "undo"  # 4x the progress per step, but the verdict says no
    assert s.scale == 1.0 and s.trials_undone == 1 and s.wait == 2
    assert s.last_loss == pytest.approx(4.9)  # the probe is back where the undo point is
    assert read(s, 4.8, bottom=12.0) is None  # backing off
    assert read(s, 4.7, bottom=12.0) == "raise"


def test_the_scale_is_bounded_and_frozen_in_the_decay_and_the_warmup_does_not_count():
    s = LrScale()
    read(s, 5.0, bottom=100.0)
    for i, scale in enumerate((2.0, 4.0, 8.0, 16.0, 32.0)):  # a doubling at a time, up to MAX_SCALE
        s.trial_from = None
        assert read(s, 4.9 - i / 10, bottom=100.0) == "raise" and s.scale == scale
    s.trial_from = None
    assert read(s, 4.0, bottom=100.0) is None and not s.wants_readings  # at the bound: no trial of 1x
    fresh = LrScale()
    read(fresh, 5.0, bottom=12.0)
    assert read(fresh, 4.9, bottom=12.0, frozen=True) is None
    assert read(fresh, 4.8, bottom=12.0, schedule_factor=0.25) is None  # early in the warmup: 3 steps at the peak
    assert fresh.scale == 1.0


def test_a_guard_rollback_ends_a_trial_and_never_goes_below_the_users_lr():
    s = LrScale()
    read(s, 5.0, bottom=12.0)
    read(s, 4.9, bottom=12.0)
    s.guard_flagged(weights_damaged=True)
    assert s.scale == 1.0 and not s.on_trial and s.trials_undone == 1 and s.last_loss is None
    s.guard_flagged(weights_damaged=True)
    assert s.scale == 1.0


def test_readings_across_a_guard_flag_are_no_steady_reach():
    """Run 232's readings at a swept LR: 1.55 and 0.43 steps, a NaN step the guard skipped, then 3.97. As one window
    their median raised the LR 3.1x, and the verdict kept it at a loss; the flag starts the window again, and the
    third reading after it is the first that may raise."""
    straddled, flagged = LrScale(), LrScale()
    for s in (straddled, flagged):
        read(s, 6.47, bottom=1.55)
        read(s, 6.45, bottom=0.43)
    flagged.guard_flagged(weights_damaged=False)
    assert read(straddled, 6.40, bottom=3.97) == "raise"
    assert read(flagged, 6.40, bottom=3.97) is None and flagged.last_loss == pytest.approx(6.40)  # the rate holds
    assert read(flagged, 6.39, bottom=4.5) is None  # over the single-reading gate, but the second after the flag
    assert read(flagged, 6.38, bottom=1.6) == "raise" and flagged.trial_raise == pytest.approx(2.0)  # the cap


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

    def fail_every_trial(self, f0, f1, f2, **kwargs):
        return original(self, f0, f1, f2, **{**kwargs, "trial_paid": False})  # the verdict's forwards still run

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

    def fail_every_trial(self, f0, f1, f2, **kwargs):
        return original(self, f0, f1, f2, **{**kwargs, "trial_paid": False})  # the verdict's forwards still run

    monkeypatch.setattr(LrScale, "reading", fail_every_trial)
    reject_every_jump(monkeypatch)


# One epoch of the larger dataset: room to make up the undone updates.
UNDONE = dict(OUTER, learning_rate=1e-4, max_steps=100)


def test_an_undone_raise_gives_its_batches_back_so_the_run_stays_on_the_trainers_path(tmp_path, monkeypatch):
    """Every raise fails its trial and every jump is rejected: the undone updates are made up on their own batches, in
    their order, so the run ends at the plain Trainer's weights bit for bit. With dropout and evaluations, whose
    DataLoader seed draws come after as many of the Trainer's updates as the Trainer's, again after an undo."""
    fail_every_trial_and_jump(monkeypatch)
    settings = dict(UNDONE, eval_strategy="steps", eval_steps=7)
    held_out = token_dataset(16, seed=1)
    hybrid = make_trainer(tmp_path / "hybrid", model=tiny_gpt2(dropout=0.1), dataset=token_dataset(2048),
                          eval_dataset=held_out, **settings)
    hybrid.train()
    assert hybrid._lr_autopilot.scale.trials_undone >= 1 and hybrid.hybrid_stats()["predictions_kept"] == 0
    plain = make_trainer(tmp_path / "plain", model=tiny_gpt2(dropout=0.1), dataset=token_dataset(2048),
                         eval_dataset=held_out, hybrid=False, **settings)
    plain.train()
    assert hybrid.state.global_step > plain.state.global_step == 100
    assert_bit_identical(state(plain.model), state(hybrid.model))


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


def test_the_line_runs_along_adams_next_step_and_puts_the_weights_back(tmp_out):
    trainer = make_trainer(tmp_out, learning_rate=1e-3, lr_scheduler_type="constant", **{**OUTER, "max_steps": 12})
    trainer.train()
    model, engine, optimizer = trainer.model, trainer._hybrid, trainer.optimizer.optimizer
    probe = trainer._lr_autopilot.probe
    before = state(model)
    scratch = WeightSnapshot()
    f0, f1, f2 = (float(loss) for loss in next_step_line(trainer, model, engine.shards(), scratch, probe))
    assert_bit_identical(state(model), before)
    assert not scratch.valid and not engine.jump_open
    assert f0 == float(probe_loss(trainer, model, probe))
    with torch.no_grad():  # 2 x SPACING of Adam's next step, weight decay aside, by its own formula
        for group in optimizer.param_groups:
            (beta1, beta2), lr = group["betas"], group["lr"]
            for p in group["params"]:
                s = optimizer.state[p]
                step = float(s["step"])
                m_hat, v_hat = s["exp_avg"] / (1 - beta1**step), s["exp_avg_sq"] / (1 - beta2**step)
                p -= 2 * SPACING * lr * m_hat / (v_hat.sqrt() + group["eps"])
    assert f2 == pytest.approx(float(probe_loss(trainer, model, probe)), abs=1e-5)
    assert f1 != f0 and f2 != f1


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _trained_adamw(layers: int, fused: bool) -> torch.optim.AdamW:
    """AdamW after three steps over `layers` linear layers in two parameter groups, one weight a step behind."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(layers)))
    weights, biases = [m.weight for m in model], [m.bias for m in model]
    optimizer = torch.optim.AdamW([{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0}],
                                  lr=1e-3, fused=fused)
    for _ in range(3):
        model(torch.randn(4, 16)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    optimizer.state[weights[0]]["step"] -= 1
    return optimizer


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("lists", [False, True])
def test_the_move_along_adams_next_step_is_the_per_parameter_formula_in_lists_whose_launches_do_not_grow(fused, lists):
    moved = {}
    for layers in (2, 20):
        optimizer = _trained_adamw(layers, fused)
        expected = []
        with torch.no_grad():  # Adam's next step, one parameter at a time, by its own formula
            for group in optimizer.param_groups:
                (beta1, beta2), lr = group["betas"], group["lr"]
                for p in group["params"]:
                    s = optimizer.state[p]
                    m_hat = s["exp_avg"] / (1 - beta1 ** s["step"])
                    denom = (s["exp_avg_sq"] / (1 - beta2 ** s["step"])).sqrt_().add_(group["eps"])
                    expected.append(p + m_hat.div_(denom).mul_(lr).mul_(-SPACING))
        step_groups = _step_groups(optimizer, lists)
        with _CountOps() as ops:
            _move_along_next_step(step_groups, SPACING)
        moved[layers] = ops.count
        params = [p for group in optimizer.param_groups for p in group["params"]]
        assert all(torch.equal(p, e) for p, e in zip(params, expected))
        # In lists (an accelerator's): the weights at two step counts, the biases at one; else one per parameter.
        assert len(step_groups) == (3 if lists else 2 * layers)
    assert (moved[20] == moved[2]) if lists else (moved[20] == 10 * moved[2])


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
    gain, noise = raise_gain(trainer, model, engine.shards(), scratch, probe, snapshot, 3.0)
    assert_bit_identical(state(model), before)
    assert not scratch.valid and not engine.jump_open
    raised = float(probe_loss(trainer, model, probe))
    with torch.no_grad():
        for p, w0 in zip(engine.params, start):
            p.copy_(w0 + (p - w0) / 3.0)
    assert gain == pytest.approx(float(probe_loss(trainer, model, probe)) - raised, abs=1e-5)
    assert gain != 0.0 and noise > 0.0


@pytest.mark.parametrize(("gain", "noise", "kept"), [(0.01, 0.0, True), (-0.03, 0.02, True), (-0.05, 0.02, False),
                                                    (-1e-6, 0.0, False)])
def test_a_raise_is_undone_only_when_it_did_worse_by_more_than_the_noise(tmp_out, monkeypatch, gain, noise, kept):
    trainer = make_trainer(tmp_out, learning_rate=1e-3, lr_scheduler_type="constant", **{**OUTER, "max_steps": 12})
    trainer.train()
    autopilot = trainer._lr_autopilot
    autopilot.scale.trial_from = autopilot.scale.scale / 2
    asked = []

    def scripted(trainer, model, shards, scratch, probe, undo_point, raise_):
        asked.append(raise_)
        return gain, noise

    monkeypatch.setattr("hf_hybrid.autopilot.runner.raise_gain", scripted)
    assert autopilot._raise_paid() is kept  # the default margin: 2 standard errors
    assert asked == [pytest.approx(2.0)] and autopilot.last_verdict == (gain, noise)
    trainer._guard_loop.snapshot.invalidate()  # no undo point: nothing to judge against
    assert autopilot._raise_paid() is False and len(asked) == 1


def test_with_an_optimizer_it_cannot_read_it_is_off_and_says_why(tmp_out, caplog):
    with caplog.at_level(logging.WARNING):
        trainer = make_trainer(tmp_out, learning_rate=1e-4, optim="sgd", **{**OUTER, "max_steps": 12})
        trainer.train()
    assert trainer._lr_autopilot is None
    assert "it needs an Adam-family optimizer" in caplog.text


def train_noting_readings(trainer: HybridHFTrainer) -> list[int]:
    """Train, and return the global steps at which the autopilot read its line."""
    read_at = []

    class Readings(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if trainer._lr_autopilot.last_line is not None:
                read_at.append(state.global_step)

    trainer.add_callback(Readings())
    trainer.train()
    return read_at


def test_readings_that_ask_for_nothing_come_less_often(tmp_out, monkeypatch):
    """Every reading sees a short line: after the first two (no progress to compare yet, then nothing asked), the gap
    between readings doubles without a bound, so a tuned LR pays for about log2(steps) of them. The run is long enough
    that the fifth gap ends before a constant schedule's last fifth, where no raise starts and nothing is read."""
    monkeypatch.setattr(LrScale, "reading", lambda self, f0, f1, f2, **kwargs: setattr(self, "last_loss", f0))
    trainer = make_trainer(tmp_out, learning_rate=1e-4, lr_scheduler_type="constant", **{**OUTER, "max_steps": 420})
    read_at = train_noting_readings(trainer)
    gaps = [b - a for a, b in zip(read_at, read_at[1:])]
    # A due reading waits for a real step with no jump open, so a gap can run a step over.
    assert gaps[:4] == [10, 20, 40, 80] and 160 <= gaps[4] <= 162 and len(gaps) == 5, read_at


def test_readings_keep_coming_soon_only_while_a_steady_reach_could_complete():
    """A median of three at a step or more needs two readings there: the next reading is worth having soon only while
    one of the last two reached a step. Lines under a step, as tuned runs read, are no more evidence than none."""
    s = LrScale()
    building = []
    for i, bottom in enumerate((0.8, 0.5, 1.2, 0.3, 0.0, 0.9, 0.0)):
        read(s, 5.0 - i / 10, bottom=bottom)
        building.append(s.evidence_building)
    assert s.scale == 1.0 and building == [False, False, True, True, False, False, False]


def test_a_short_line_holds_the_jumps_back_and_a_longer_one_lets_them_through():
    s = LrScale()
    assert not s.steps_long_enough  # no reading yet: no evidence either way
    read(s, 5.0, bottom=1.5)
    assert s.steps_long_enough  # the steps reach the line's bottom already
    read(s, 4.9, bottom=3.0)  # under the raise gate, over the aim
    assert not s.steps_long_enough and s.scale == 1.0
    resumed = LrScale()
    resumed.load_state_dict(s.state_dict())
    assert not resumed.steps_long_enough and resumed == s


HELD = dict(OUTER, max_steps=80, hybrid_warmup_steps=12, lr_scheduler_type="constant")


def run_with_readings_of(tmp_path, monkeypatch, reach: float, name: str) -> tuple[HybridHFTrainer, list[int]]:
    """Every autopilot reading's line bottoms out `reach` of today's steps out. The first turn to jump comes after the
    first reading (step 11). Returns the trainer and the steps it read at."""
    monkeypatch.setattr("hf_hybrid.autopilot.scale.reach_of_line", lambda f0, f1, f2: reach / SPACING)
    trainer = make_trainer(tmp_path / name, learning_rate=1e-3, model=tiny_gpt2(dropout=0.1), **HELD)
    return trainer, train_noting_readings(trainer)


def test_where_the_steps_are_long_enough_no_jump_is_tried_and_the_run_is_the_trainers(tmp_path, monkeypatch, caplog):
    """A line under a step at every reading, as tuned runs read: no raise, no jump, the Trainer bit for bit; and
    since no steady reach can build from such lines, the readings come less often, as readings of 0 do. The end line
    says what the readings cost."""
    with caplog.at_level(logging.WARNING):
        held, read_at = run_with_readings_of(tmp_path, monkeypatch, reach=0.8, name="held")
    stats = held.hybrid_stats()
    assert stats["predictions_judged"] == 0 and stats["predict_steps"] == 0 and stats["turns_passed"] >= 10
    assert held._lr_autopilot.scale.scale == 1.0
    assert read_at == [11, 21, 41], read_at
    assert stats["lr_readings"] == len(read_at)
    assert f"was kept; the autopilot's {len(read_at)} readings (three forwards each) took" in caplog.text
    assert 0 < held._lr_autopilot.reading_seconds < time.perf_counter() - held._lr_autopilot.train_started
    plain = make_trainer(tmp_path / "plain", learning_rate=1e-3, model=tiny_gpt2(dropout=0.1), hybrid=False, **HELD)
    plain.train()
    assert_bit_identical(state(plain.model), state(held.model))
    monkeypatch.setattr("hf_hybrid.autopilot.scale.STEADY_REACH", math.inf)  # a longer line, but no raise
    tried, _ = run_with_readings_of(tmp_path, monkeypatch, reach=3.0, name="tried")
    assert tried.hybrid_stats()["predictions_judged"] > 0 and tried.hybrid_stats()["turns_passed"] == 0


@pytest.mark.parametrize("nan_at", [None, 15])
def test_no_raise_starts_before_the_third_reading_after_a_guard_skip(tmp_path, monkeypatch, nan_at):
    """Every line reads 10 steps: the second reading raises. A NaN loss between the first two readings, which the
    guard skips, holds the raise until the third reading after it."""
    from .test_safety import nan_model

    monkeypatch.setattr("hf_hybrid.autopilot.scale.reach_of_line", lambda f0, f1, f2: 10.0 / SPACING)
    monkeypatch.setattr("hf_hybrid.autopilot.alignment.ALIGNED", math.inf)  # a raise needs the line twice
    model = nan_model(at_grad=() if nan_at is None else (nan_at,))
    trainer = make_trainer(tmp_path, model=model, learning_rate=1e-4, lr_scheduler_type="constant",
                           **{**OUTER, "max_steps": 70})
    scales, skipped = [], []

    class Scale(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            scales.append(trainer._lr_autopilot.scale.scale)
            skipped.append(trainer.hybrid_stats()["skipped_steps"])

    trainer.add_callback(Scale())
    read_at = train_noting_readings(trainer)
    raised_at = next(step for step, scale in enumerate(scales, start=1) if scale > 1.0)
    if nan_at is None:
        assert raised_at == read_at[1] and skipped[-1] == 0, (read_at, scales)
    else:
        skip_step = skipped.index(1) + 1
        assert read_at[0] < skip_step < read_at[1] and skipped[-1] == 1, (read_at, skip_step)
        assert raised_at == read_at[3], (read_at, scales)


def test_no_raise_starts_where_the_run_would_end_before_its_verdict(tmp_out, monkeypatch):
    """Every line reads 10 steps, on a constant schedule: the reading 8 steps before the end judges the open raise and
    keeps it, but starts no other, whose verdict would come after the end. Had one been open at the end, the end line
    would advise only the LR that was judged."""
    monkeypatch.setattr("hf_hybrid.autopilot.scale.reach_of_line", lambda f0, f1, f2: 10.0 / SPACING)
    monkeypatch.setattr("hf_hybrid.autopilot.alignment.ALIGNED", math.inf)  # raises of 2x, whatever the first steps
    trainer = make_trainer(tmp_out, learning_rate=1e-4, lr_scheduler_type="constant", **{**OUTER, "max_steps": 40})
    read_at = train_noting_readings(trainer)
    scale = trainer._lr_autopilot.scale
    assert read_at == [12, 22, 32] and trainer.state.global_step == 40, read_at
    assert scale.scale == 2.0 and scale.raises_kept == 1 and not scale.on_trial
    scale.trial_from, scale.scale = 4.0, 10.0
    assert trainer._lr_autopilot.summary() == (
        "hf_hybrid: training ended before a 2.5x raise of the learning rate (0.0004 -> 0.001) could be judged (1 "
        "raises kept, 0 undone); pass --learning_rate 0.0004 next time.")
    scale.trial_from, scale.scale = 1.0, 4.0
    assert trainer._lr_autopilot.summary().endswith("--learning_rate 0.0001 stands.")


@pytest.mark.parametrize("aligned", [False, True])
def test_no_raise_starts_in_the_first_descent_just_after_the_warmup(tmp_out, monkeypatch, aligned):
    """A run from scratch still falls steeply for a few steps after a short warmup, where its line reads long at any
    LR (cpu-small at its own LR: 8 steps at step 20, a raise there ended 0.28 above the Trainer). Every line reads
    10 steps here: the reading as a 20-step warmup ends only gives the next one its rate, and is no evidence; the
    first raise needs two long readings past the first descent, or one where the first steps were aligned."""
    monkeypatch.setattr("hf_hybrid.autopilot.scale.reach_of_line", lambda f0, f1, f2: 10.0 / SPACING)
    monkeypatch.setattr("hf_hybrid.autopilot.alignment.ALIGNED", -math.inf if aligned else math.inf)
    trainer = make_trainer(tmp_out, learning_rate=1e-4, warmup_steps=20, lr_scheduler_type="constant_with_warmup",
                           **{**OUTER, "max_steps": 70})
    scales = []

    class Scale(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            scales.append(trainer._lr_autopilot.scale.scale)

    trainer.add_callback(Scale())
    read_at = train_noting_readings(trainer)
    assert read_at[:3] == [20, 30, 40], read_at
    raised_at = 30 if aligned else 40
    assert scales[raised_at - 2] == 1.0 and scales[raised_at - 1] > 1.0, scales  # raised there, not before
