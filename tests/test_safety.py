"""Safety: a harmful prediction is rolled back bit-exactly; a NaN never reaches the weights."""

from __future__ import annotations

import sys

import pytest
import torch
from transformers import TrainerCallback

from hf_hybrid import Phase
from hf_hybrid.jumps.predictors import VelocityPredictor
from hf_hybrid.loop.forward_checks import probe_loss

from .conftest import flat_params, make_trainer, tiny_gpt2
from .test_predict import train_recorded


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


@pytest.mark.parametrize("guard", [True, False])
def test_nan_on_real_steps_is_skipped_and_counted(tmp_out, guard, caplog):
    model = nan_model(at_grad=(3, 9, 17))  # warmup, full and later real steps
    trainer = make_trainer(tmp_out, model=model, hybrid_guard=guard)
    with caplog.at_level("WARNING"):
        trainer.train()
    # One line a skipped step: the guard's where it is on, the veto's own where it is off.
    said = "non-finite loss nan: skipped the step" if guard else "its loss is not finite: skipped the step"
    assert caplog.text.count(said) == 3
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


class RaiseAt(TrainerCallback):
    """Raises `error` once, at the end of optimizer step `step`; records the weights each training loop starts from."""

    def __init__(self, step: int, error: BaseException) -> None:
        self.step, self.error, self.starts = step, error, []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.starts.append(flat_params(model))

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step and self.error is not None:
            error, self.error = self.error, None
            raise error


@pytest.mark.parametrize("cut_off", ["ctrl-c", "out of memory"])
def test_a_run_cut_off_mid_jump_undoes_the_unjudged_delta(tmp_path, cut_off):
    """Ctrl-C leaves the weights the last real step made; so does an out-of-memory error, from which
    `auto_find_batch_size` starts the Trainer's loop again with a smaller batch."""
    settings = dict(hybrid_payoff_check=True, max_steps=40)
    _, rows = train_recorded(tmp_path / "ref", **settings)
    starts = [i for i, r in enumerate(rows) if r["phase"] is Phase.PREDICT and rows[i - 1]["phase"] != r["phase"]]
    start = next(i for i in starts if i + 1 < len(rows) and rows[i + 1]["phase"] is Phase.PREDICT)
    model = tiny_gpt2()
    out_of_memory = cut_off == "out of memory"
    error = (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes.")
             if out_of_memory else KeyboardInterrupt())
    trainer = make_trainer(tmp_path / "cut", model=model, auto_find_batch_size=out_of_memory, **settings)
    raise_at = RaiseAt(start + 1, error)
    trainer.add_callback(raise_at)
    if out_of_memory:
        trainer.train()
        assert len(raise_at.starts) == 2 and torch.equal(raise_at.starts[1], rows[start - 1]["params"])
    else:
        with pytest.raises(KeyboardInterrupt):
            trainer.train()
        assert torch.equal(flat_params(model), rows[start - 1]["params"])
    assert not trainer._hybrid.jump_open
