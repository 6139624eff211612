"""The outer-momentum predictor: its jump is the Nesterov step on the pseudo-gradient, a rejected jump leaves the
outer state untouched, and a jump is charged the forwards it runs (its checkpoints: test_outer_resume.py; with the
guard: test_outer_guard.py)."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import TrainerCallback

from hf_hybrid import Phase
from hf_hybrid.jumps.lifecycle import JumpLifecycle
from hf_hybrid.jumps.payoff import PayoffMeter
from hf_hybrid.jumps.predictors.outer import OuterMomentumPredictor
from hf_hybrid.memory.host_buffers import HostCopies, host_like

from .conftest import flat_params, make_trainer, tiny_gpt2

OUTER = dict(hybrid_predictor="outer", hybrid_outer_period=5, hybrid_outer_lr=0.7, hybrid_outer_momentum=0.5)


class OuterRecorder(TrainerCallback):
    """Per optimizer step: phase, rollback, the weights and the outer momentum buffer."""

    def __init__(self) -> None:
        self.trainer, self.rows = None, []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        engine = self.trainer._hybrid
        buf = engine.predictor.buf
        self.rows.append({"phase": engine.last_record.phase, "rollback": engine.last_record.rollback,
                          "params": flat_params(model),
                          "buf": torch.cat([b.reshape(-1) for b in buf]).clone() if buf else None})


def run(tmp_out, **overrides):
    recorder = OuterRecorder()
    trainer = make_trainer(tmp_out, **{**OUTER, "max_steps": 30, **overrides})
    recorder.trainer = trainer
    trainer.add_callback(recorder)
    trainer.train()
    return trainer, recorder.rows


@pytest.mark.parametrize("judged", [False, True])
def test_the_jump_is_an_outer_nesterov_step_on_the_pseudo_gradient(tmp_out, monkeypatch, judged):
    """Unjudged, the jump starts from the weights; judged, from the anchor, which the weights hold for the probe's
    loss at the cycle's start: the same step either way."""
    if judged:
        monkeypatch.setattr(PayoffMeter, "verdict", lambda self, gain, noise: True)
    trainer, rows = run(tmp_out, hybrid_payoff_check=judged)
    a, m = 0.7, 0.5
    jumps = [i for i, r in enumerate(rows) if r["phase"] is Phase.PREDICT]
    # Warmup 5, then a jump after every 5 real steps; the first real step anchors the first cycle.
    assert jumps[:3] == [10, 16, 22]
    assert all(not rows[i]["rollback"] for i in jumps)
    assert all(r["buf"] is None for r in rows[:10])  # no momentum buffer until a jump is kept
    w = [r["params"] for r in rows]
    g1 = w[0] - w[9]
    torch.testing.assert_close(w[10], w[0] - a * (g1 + m * g1))
    torch.testing.assert_close(rows[10]["buf"], g1)
    g2 = w[10] - w[15]  # the jump's landing point is the next anchor
    buf2 = m * g1 + g2
    torch.testing.assert_close(w[16], w[10] - a * (g2 + m * buf2))
    torch.testing.assert_close(rows[16]["buf"], buf2)
    assert trainer.hybrid_stats()["backward_steps"] == 30 - len(jumps)
    assert trainer._hybrid.dynamics.steps == 0  # the period and the probe decide: no loss forecast is paid for


def jumps_from_the_weights_and_from_the_anchor(device: str, momentum: bool) -> tuple[list, list, list]:
    """One outer jump twice, from the same state: from the weights, then with the weights at the anchor (as the probe
    leaves them) and the start given. The outer state sits where the predictor keeps it (pinned memory on a GPU)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, device=device)) for shape in [(7, 5), (5,), (3, 4, 2)]]
    predictor = OuterMomentumPredictor(params, torch.optim.AdamW(params), period=30, outer_lr=0.7, momentum=0.5)
    weights = [p.detach().clone() for p in params]
    predictor.anchor = host_like(weights)
    predictor.buf = host_like(weights) if momentum else []
    for anchor, buf, w in itertools.zip_longest(predictor.anchor, predictor.buf, weights):
        anchor.copy_(w + 0.1 * torch.randn_like(w))
        if buf is not None:
            buf.copy_(torch.randn_like(w))
    predictor.apply_(1e-3)
    from_weights = [p.detach().clone() for p in params]
    predictor.load_anchor()
    predictor.apply_(1e-3, start=weights)
    return weights, from_weights, [p.detach().clone() for p in params]


@pytest.mark.parametrize("momentum", [False, True])
def test_a_jump_from_the_anchor_lands_bit_for_bit_where_one_from_the_weights_does(momentum):
    weights, from_weights, from_anchor = jumps_from_the_weights_and_from_the_anchor("cpu", momentum)
    assert all(torch.equal(a, w) for a, w in zip(from_anchor, from_weights))
    assert not any(torch.equal(a, w) for a, w in zip(from_anchor, weights))


def test_a_judged_jump_brings_the_anchor_from_host_memory_once_and_a_kept_one_twice(tmp_out, monkeypatch):
    """Judged, the anchor is brought into the weights for the probe's loss at the cycle's start, and the step reads it
    there; a kept jump reads it once more for the momentum's update. On a GPU each read is a host-to-device copy of
    the parameters' bytes."""
    reads = []
    for name in ("copy", "fetch"):
        original = getattr(HostCopies, name)

        def counted(self, *args, _original=original, _name=name):
            sources = args[1] if _name == "copy" else [args[0]]
            anchor = trainer._hybrid.predictor.anchor or []
            reads.append(sum(any(s is a for a in anchor) for s in sources))
            return _original(self, *args)

        monkeypatch.setattr(HostCopies, name, counted)
    verdicts = itertools.cycle([True, False])
    monkeypatch.setattr(PayoffMeter, "verdict", lambda self, gain, noise: next(verdicts))

    class PerStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            rows.append((trainer._hybrid.last_record.phase, trainer._hybrid.last_record.rollback, sum(reads)))
            reads.clear()

    rows = []
    trainer = make_trainer(tmp_out, **{**OUTER, "max_steps": 30, "hybrid_payoff_check": True,
                                       "hybrid_max_rejections": 0})
    trainer.add_callback(PerStep())
    trainer.train()
    tensors = len(trainer._hybrid.params)
    jumps = [(rollback, n) for phase, rollback, n in rows if phase is Phase.PREDICT]
    assert {rollback for rollback, _ in jumps} == {False, True}, jumps
    assert all(n == (1 if rollback else 2) * tensors for rollback, n in jumps), (tensors, jumps)


def test_a_rejected_jump_leaves_weights_and_momentum_as_they_were(tmp_out, monkeypatch):
    verdicts = iter([True, False, True, False, True, False])
    monkeypatch.setattr(PayoffMeter, "verdict", lambda self, gain, noise: next(verdicts))
    _, rows = run(tmp_out, hybrid_payoff_check=True, hybrid_max_rejections=0)
    jumps = [i for i, r in enumerate(rows) if r["phase"] is Phase.PREDICT]
    kept, rejected = jumps[0], jumps[1]
    assert not rows[kept]["rollback"] and rows[rejected]["rollback"]
    assert torch.equal(rows[rejected]["params"], rows[rejected - 1]["params"])
    assert torch.equal(rows[rejected]["buf"], rows[kept]["buf"])
    assert rows[kept]["buf"].abs().sum() > 0


class ForwardCounter(TrainerCallback):
    """Model forward passes per optimizer step, with the step's phase and what the payoff clock charged for it."""

    def __init__(self, model) -> None:
        self.trainer, self.calls, self.clock, self.rows = None, 0, 0.0, []
        model.register_forward_hook(lambda *_: setattr(self, "calls", self.calls + 1))

    def on_step_end(self, args, state, control, **kwargs):
        engine = self.trainer._hybrid
        self.rows.append((engine.last_record.phase, self.calls, engine.payoff.clock - self.clock))
        self.calls, self.clock = 0, engine.payoff.clock


@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_one_step_jump_is_charged_the_forwards_it_runs(tmp_out, accumulation):
    model = tiny_gpt2()
    counter = ForwardCounter(model)
    # The learning-rate autopilot's readings are not the jump's (test_lr_readings.py counts them).
    trainer = make_trainer(tmp_out, model=model, **{**OUTER, "max_steps": 30, "hybrid_payoff_check": True,
                                                    "hybrid_max_rejections": 0, "hybrid_warmup_steps": 5,
                                                    "hybrid_lr_autopilot": False,
                                                    "gradient_accumulation_steps": accumulation})
    counter.trainer = trainer
    trainer.add_callback(counter)
    trainer.train()
    jumps = [(calls, charged) for phase, calls, charged in counter.rows if phase is Phase.PREDICT]
    assert len(jumps) >= 2
    # One micro-batch: the probe before the jump and after it, which is also the step's loss check. With accumulation:
    # the probe twice and the step's micro-batches. Each micro-batch forward is charged its share of a step's. The
    # probe at the cycle's start (the rate a kept jump is worth against) is paid whatever the verdict, so it is not
    # charged to the jump.
    forwards = 2 if accumulation == 1 else accumulation + 2
    per_forward = trainer._hybrid.payoff.forward_cost / accumulation
    assert all(calls == forwards + 1 and abs(charged - forwards * per_forward) < 1e-9 for calls, charged in jumps)
    assert all(calls == accumulation and abs(charged - 1.0) < 1e-9
               for phase, calls, charged in counter.rows if phase is not Phase.PREDICT)
    assert trainer.hybrid_stats()["predictions_judged"] == len(jumps)


def test_without_the_verdict_a_kept_jump_ends_a_run_of_rejections(tmp_out, monkeypatch):
    """With no probe verdict, a jump that the loss check lets through is the sign that prediction pays: it resets the
    rejections in a row, so rejections spread over a run do not retire the predictor."""
    rejects = itertools.chain([True, False, True, False, True], itertools.repeat(False))
    check = JumpLifecycle.check_predict_step

    def scripted_check(self, loss):
        check(self, loss)
        if not self.record.rollback and next(rejects):
            self.rollback()

    monkeypatch.setattr(JumpLifecycle, "check_predict_step", scripted_check)
    # The autopilot off: its readings would pass turns to jump on this model (a short line), which this test scripts.
    trainer, rows = run(tmp_out, hybrid_payoff_check=False, hybrid_max_rejections=2, max_steps=100,
                        hybrid_lr_autopilot=False)
    outcomes = [r["rollback"] for r in rows if r["phase"] is Phase.PREDICT]
    assert outcomes[:5] == [True, False, True, False, True]
    assert not trainer._hybrid.controller.retired
