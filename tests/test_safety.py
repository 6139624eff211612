"""Safety: a harmful prediction is rolled back bit-exactly; a NaN never reaches the weights."""

from __future__ import annotations

import re
import sys

import pytest
import torch
from transformers import TrainerCallback

from hf_hybrid import Phase
from hf_hybrid.jumps.engine import StepRecord
from hf_hybrid.jumps.predictors import VelocityPredictor
from hf_hybrid.loop.forward_checks import probe_loss

from .conftest import flat_params, make_trainer, reject_every_jump, tiny_gpt2, token_dataset
from .test_predict import StepRecorder, train_recorded


def sabotage_fifth_predicted_step(monkeypatch) -> None:
    """The 5th predicted step (inside the second Predict phase) also shifts every weight by 3."""
    original = VelocityPredictor.apply_
    calls = {"n": 0}

    def sabotaged(self, lr):
        original(self, lr)
        calls["n"] += 1
        if calls["n"] == 5:
            with torch.no_grad():
                for p in self.params:
                    p.add_(3.0)

    monkeypatch.setattr(VelocityPredictor, "apply_", sabotaged)


def assert_restored(rows: list[dict], i: int) -> None:
    """Rolled-back step `i` is a Predict step whose weights are back, to the bit, at those the last real step before
    its phase produced."""
    assert rows[i]["rollback"] and rows[i]["phase"] is Phase.PREDICT
    start = i
    while rows[start - 1]["phase"] is Phase.PREDICT:
        start -= 1
    assert torch.equal(rows[i]["params"], rows[start - 1]["params"])


def rolled_back(rows: list[dict]) -> list[int]:
    return [i for i, r in enumerate(rows) if r["rollback"]]


def test_harmful_prediction_is_rolled_back_bit_exactly(tmp_out, monkeypatch):
    sabotage_fifth_predicted_step(monkeypatch)
    trainer, rows = train_recorded(tmp_out, hybrid_loss_band=3.0)
    assert rolled_back(rows), "the sabotaged prediction must be rolled back"
    i = rolled_back(rows)[0]
    assert_restored(rows, i)
    assert rows[i + 1]["phase"] is Phase.FULL
    stats = trainer.hybrid_stats()
    assert stats["rollbacks"] >= 1 and stats["divergences"] >= 1
    assert all(torch.isfinite(r["params"]).all() for r in rows)


class NaNInjectingGPT2(type(tiny_gpt2())):
    """Returns a NaN loss on chosen training forwards (counted separately with and without grad)."""

    nan_at_grad: set = set()
    nan_at_no_grad: set = set()

    def forward(self, input_ids=None, labels=None, **kwargs):
        out = super().forward(input_ids=input_ids, labels=labels, **kwargs)
        if self.training:
            grad = torch.is_grad_enabled()
            key = "_grad_calls" if grad else "_nograd_calls"
            n = getattr(self, key, 0) + 1
            setattr(self, key, n)
            if n in (self.nan_at_grad if grad else self.nan_at_no_grad):
                out.loss = out.loss * float("nan")
        return out


def nan_model(at_grad=(), at_no_grad=()):
    model = NaNInjectingGPT2(tiny_gpt2().config)
    model.load_state_dict(tiny_gpt2().state_dict())
    model.nan_at_grad, model.nan_at_no_grad = set(at_grad), set(at_no_grad)
    return model


def test_nan_on_real_steps_is_skipped_and_counted(tmp_out):
    model = nan_model(at_grad=(3, 9, 17))  # warmup, full and later real steps
    trainer = make_trainer(tmp_out, model=model)
    trainer.train()
    stats = trainer.hybrid_stats()
    assert stats["skipped_steps"] == 3 and stats["non_finite"] == 3
    assert all(torch.isfinite(p).all() for p in model.parameters())
    adam_steps = {float(s["step"]) for s in trainer.optimizer.optimizer.state.values()}
    assert adam_steps == {stats["backward_steps"] - 3}
    # Skipped steps do not count toward max_steps: the run makes them up (with a jump's, when one was open).
    assert trainer.state.global_step == 40 + trainer._hybrid.made_up_steps
    assert trainer._hybrid.made_up_steps >= 3


def test_nan_while_predicting_rolls_back(tmp_out):
    model = nan_model(at_no_grad=(2,))
    trainer, rows = train_recorded(tmp_out, model=model)
    stats = trainer.hybrid_stats()
    assert stats["rollbacks"] >= 1 and stats["non_finite"] == 1
    assert_restored(rows, rolled_back(rows)[0])
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_probe_gate_rolls_back_a_jump_that_does_not_pay(tmp_out, monkeypatch):
    """A small harmful delta stays inside the loose loss band but fails the paired probe check."""
    original = VelocityPredictor.apply_

    def harmful(self, lr):
        original(self, lr)
        with torch.no_grad():
            for p in self.params:
                p.add_(torch.randn_like(p), alpha=0.02)

    monkeypatch.setattr(VelocityPredictor, "apply_", harmful)
    trainer, rows = train_recorded(tmp_out, hybrid_payoff_check=True)
    stats = trainer.hybrid_stats()
    assert stats["predictions_judged"] >= 2 and stats["predictions_kept"] == 0
    assert stats["rollbacks"] == stats["predictions_judged"]
    assert len(rolled_back(rows)) == stats["rollbacks"]
    for i in rolled_back(rows):
        assert_restored(rows, i)
    # Each rejected jump backs off: the Full phases between attempts grow.
    assert trainer._hybrid.controller.backoff >= 2


def test_probe_is_paired_under_dropout_and_leaves_training_rng_alone(tmp_out):
    model = tiny_gpt2()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.3
    trainer = make_trainer(tmp_out, model=model, max_steps=1)
    trainer.train()
    batch = trainer._prepare_inputs({k: torch.tensor(v[:4]) for k, v in trainer.train_dataset[:4].items()})
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    first = probe_loss(trainer, trainer.model, batch)
    second = probe_loss(trainer, trainer.model, batch)
    assert torch.equal(first, second)  # the same dropout masks: a paired comparison
    assert torch.equal(torch.rand(3), expected)


def test_the_hybrid_never_reseeds_a_cuda_generator(tmp_out, monkeypatch):
    """On a GPU, dropout draws from the device's generator, which a fork of the CPU's RNG does not restore: a seeding
    from the hybrid's own code there moves the Trainer's masks. The loss forecast's seeding once did (through
    `torch.manual_seed`), and a GPU run then differed from the Trainer's from its first step."""
    reseeded_by = []

    def spy(original):
        def seeding(*args, **kwargs):
            caller = sys._getframe(1)  # the first caller outside torch (`torch.manual_seed` calls this)
            while caller.f_globals["__name__"].startswith("torch"):
                caller = caller.f_back
            if caller.f_globals["__name__"].startswith("hf_hybrid"):
                reseeded_by.append(caller.f_globals["__name__"])
            return original(*args, **kwargs)
        return seeding

    monkeypatch.setattr(torch.cuda, "manual_seed_all", spy(torch.cuda.manual_seed_all))
    monkeypatch.setattr(torch.cuda, "manual_seed", spy(torch.cuda.manual_seed))
    trainer = make_trainer(tmp_out, model=tiny_gpt2(dropout=0.1), max_steps=60, hybrid_payoff_check=True)
    trainer.train()
    assert trainer.hybrid_stats()["predictions_judged"] >= 1  # the probe's paired forwards ran
    assert reseeded_by == []


class StopAt(TrainerCallback):
    """Stops training at a given step, as early stopping or a time limit would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def test_training_stopped_mid_jump_undoes_the_unjudged_delta(tmp_path):
    settings = dict(hybrid_payoff_check=True, max_steps=40)
    reference, rows = train_recorded(tmp_path / "ref", **settings)
    # A Predict phase of 2+ steps; stop the run after its first step, before the probe verdict (rows[i] is step i+1).
    starts = [i for i, r in enumerate(rows) if r["phase"] is Phase.PREDICT and rows[i - 1]["phase"] != r["phase"]]
    start = next(i for i in starts if i + 1 < len(rows) and rows[i + 1]["phase"] is Phase.PREDICT)
    assert not torch.equal(rows[start]["params"], rows[start - 1]["params"])  # the delta did move the weights
    model = tiny_gpt2()
    trainer = make_trainer(tmp_path / "cut", model=model, **settings)
    trainer.add_callback(StopAt(start + 1))
    trainer.train()
    assert trainer.state.global_step == start + 1
    assert torch.equal(flat_params(model), rows[start - 1]["params"])


class WeightsPerStep(TrainerCallback):
    def __init__(self) -> None:
        self.params = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.params.append(flat_params(model))


def dropout_gpt2() -> torch.nn.Module:
    return tiny_gpt2(dropout=0.1)


@pytest.mark.parametrize("model, examples, evaluations",
                         [(dropout_gpt2, 1024, False), (tiny_gpt2, 512, False), (dropout_gpt2, 512, False),
                          (dropout_gpt2, 512, True)],
                         ids=["dropout", "two-epochs", "dropout-two-epochs", "dropout-two-epochs-evaluated"])
def test_after_rejected_jumps_training_is_the_trainers_bit_for_bit(tmp_path, monkeypatch, model, examples,
                                                                    evaluations):
    """With every jump rejected, the hybrid's n-th real step ends at the plain Trainer's n-th step's weights, bit
    for bit, under a decaying learning rate: nothing leaks past a rollback (weights, optimizer state, dropout RNG,
    schedule), the rolled-back jump's batches are trained on next, in the Trainer's order, and the steps it undid
    are added to max_steps, so the run ends at the Trainer's final weights.

    Two runs cross into a second epoch (64 batches each) with replayed batches still queued. The hybrid reaches the
    epoch's end at an earlier real step, and each epoch's DataLoader iterator draws its seed from the global RNG,
    which on CPU is also the dropout RNG: with dropout, the masks match only because that draw is deferred to the
    real step where the Trainer makes it (loop/epoch_seed.py). So is each evaluation's: the hybrid evaluates at global
    steps that its made-up steps brought earlier in real steps (eval_seed.py)."""
    plain = WeightsPerStep()
    settings = dict(max_steps=100, lr_scheduler_type="linear")  # room for 28 more steps in the last epoch
    if evaluations:
        settings.update(eval_strategy="steps", eval_steps=10)
    evaluation = token_dataset(16, seed=1) if evaluations else None
    reference = make_trainer(tmp_path / "plain", model=model(), dataset=token_dataset(examples),
                             eval_dataset=evaluation, hybrid=False, **settings)
    reference.add_callback(plain)
    reference.train()

    reject_every_jump(monkeypatch)
    recorder = StepRecorder()
    # The learning-rate autopilot off: a kept raise is meant to leave the Trainer's trajectory (test_lr_autopilot.py).
    trainer = make_trainer(tmp_path / "hybrid", model=model(), dataset=token_dataset(examples), eval_dataset=evaluation,
                           hybrid_payoff_check=True, hybrid_max_rejections=3, hybrid_lr_autopilot=False, **settings)
    trainer.add_callback(recorder)
    recorder.trainer = trainer
    trainer.train()
    stats = trainer.hybrid_stats()
    assert stats["predictions_judged"] == 3 and stats["predictions_kept"] == 0
    assert stats["undone_steps"] == stats["predict_steps"] > 0
    assert trainer.state.global_step == 100 + stats["undone_steps"]
    real = [r["params"] for r in recorder.rows if r["phase"] is not Phase.PREDICT]
    assert len(real) == stats["backward_steps"] == 100
    for n, params in enumerate(real):
        assert torch.equal(params, plain.params[n]), f"real step {n + 1} differs from the Trainer's"


def test_a_jump_open_at_the_last_step_is_judged_there_and_made_up(tmp_path, monkeypatch):
    """max_steps ends inside a Predict phase: the probe is judged at the last step rather than the jump undone
    after training, and its rejection makes the step up before the Trainer decides to stop, so the run still ends
    at the Trainer's final weights."""
    reject_every_jump(monkeypatch)
    settings = dict(lr_scheduler_type="constant", hybrid_payoff_check=True)  # max_steps changes nothing before it
    _, rows = train_recorded(tmp_path / "long", max_steps=60, **settings)
    first_predict = next(i for i, r in enumerate(rows) if r["phase"] is Phase.PREDICT)
    assert rows[first_predict + 1]["phase"] is Phase.PREDICT  # a jump of two steps or more
    last = first_predict + 1  # global step of the jump's first predicted step

    trainer = make_trainer(tmp_path / "short", max_steps=last, **settings)
    trainer.train()
    stats = trainer.hybrid_stats()
    assert stats["predictions_judged"] == 1 and stats["undone_steps"] == 1
    assert trainer.state.global_step == last + 1 and stats["backward_steps"] == last
    reference = make_trainer(tmp_path / "plain", hybrid=False, max_steps=last, **settings)
    reference.train()
    assert torch.equal(flat_params(trainer.model), flat_params(reference.model))


def test_steps_that_cannot_be_made_up_are_reported(tmp_path, monkeypatch, caplog):
    """An epoch-based run has no room after its last epoch: max_steps stays where the loop ends (so the final
    save and eval still happen), and a warning names the steps that were not made up."""
    reject_every_jump(monkeypatch)
    trainer = make_trainer(tmp_path, hybrid_payoff_check=True, max_steps=-1, num_train_epochs=1)
    with caplog.at_level("WARNING", logger="hf_hybrid.trainer"):
        trainer.train()
    undone = trainer.hybrid_stats()["undone_steps"]
    assert undone > 0 and trainer.state.global_step == trainer.state.max_steps == 64
    assert trainer.hybrid_stats()["backward_steps"] == 64 - undone
    assert "fewer real updates than the Trainer would" in caplog.text
    assert sum(int(n) for n in re.findall(r"(\d+) optimizer steps undone", caplog.text)) == undone


def test_without_payoff_check_survived_jumps_undo_the_back_off(tmp_out, monkeypatch):
    sabotage_fifth_predicted_step(monkeypatch)
    trainer = make_trainer(tmp_out, hybrid_loss_band=3.0, max_steps=60)
    trainer.train()
    controller = trainer._hybrid.controller
    assert controller.rollbacks >= 1
    assert controller.backoff < controller.rollbacks  # each rollback doubled the wait; later survivors halved it


def test_repeated_rejections_retire_prediction_and_give_back_its_buffers(tmp_path, monkeypatch):
    """Three rejected jumps in a row: no Predict step after the third, no more loss-forecast work, the velocity
    and snapshot buffers freed, and a resumed engine stays retired."""
    reject_every_jump(monkeypatch)
    # The autopilot off: its readings would pass turns to jump on this model (a short line) instead of rejecting them.
    trainer, rows = train_recorded(tmp_path, hybrid_payoff_check=True, max_steps=120, hybrid_max_rejections=3,
                                   hybrid_lr_autopilot=False)
    rollbacks = [i for i, r in enumerate(rows) if r["rollback"]]
    assert len(rollbacks) == 3
    assert all(r["phase"] is not Phase.PREDICT for r in rows[rollbacks[-1] + 1:])
    assert len(rows) - rollbacks[-1] > 30  # a long stretch that would have held a fourth attempt
    engine = trainer._hybrid
    assert engine.controller.retired and engine.log_metrics()["hybrid/retired"] == 1.0
    assert engine.predictor.velocity == [] and engine.snapshot.tensors is None and engine._before_step is None
    real_steps = sum(1 for r in rows if r["phase"] is not Phase.PREDICT)
    assert engine.dynamics.steps < real_steps - 30  # it stopped observing at the retirement
    resumed = trainer._build_engine()
    resumed.load_state_dict(engine.state_dict())
    assert resumed.controller.retired and resumed.predictor.velocity == []
    # A first Correct step vetoed by a NaN under the fp16 GradScaler still calls the pre-step hook: it must not
    # reach for the freed buffers.
    engine.record = StepRecord(step=0, phase=Phase.CORRECT, rollback=True)
    engine.before_optimizer_step(1e-3)
    assert engine._before_step is None and engine._predicted is None

    trainer, rows = train_recorded(tmp_path / "never", hybrid_payoff_check=True, max_steps=120,
                                   hybrid_max_rejections=0, hybrid_lr_autopilot=False)
    assert sum(r["rollback"] for r in rows) >= 4
