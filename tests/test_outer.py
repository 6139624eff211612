"""The outer-momentum predictor: its jump is the Nesterov step on the pseudo-gradient, a rejected jump leaves the
outer state untouched, resume is bit-exact, and a guard rollback starts the outer cycle over."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from transformers import TrainerCallback

from hf_hybrid import HybridHFTrainer, Phase
from hf_hybrid.jumps.lifecycle import JumpLifecycle
from hf_hybrid.jumps.payoff import PayoffMeter
from hf_hybrid.jumps.predictors.outer import OuterMomentumPredictor
from hf_hybrid.memory.host_buffers import HostCopies, host_like

from .conftest import flat_params, hybrid_args, make_trainer, reject_every_jump, tiny_gpt2, token_dataset
from .test_equivalence_resume import assert_bit_identical, state
from .test_guard import FaultPlan, guarded_trainer
from .test_guard import trace as guard_trace

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


def test_the_guards_snapshot_stands_on_the_anchor_and_a_rollback_restarts_the_cycle_there(tmp_out):
    """The guard keeps no copy of the weights beside the outer anchor: its snapshot is taken where each cycle starts
    and stands on the anchor, with only the optimizer state its own; a rollback puts the anchor back, bit for bit, and
    the next cycle starts there with no momentum."""
    plan = FaultPlan(spike_step=27)
    # Snapshots due by count come later than every cycle start here (see the next test for a longer cycle).
    # The autopilot off: its readings would pass turns to jump on this model (a short line); kept jumps are needed.
    trainer = guarded_trainer(tmp_out, plan, hybrid_predict=True, **OUTER, hybrid_guard_snapshot_steps=50,
                              hybrid_lr_autopilot=False)
    rows, weights_before_update = [], {}

    class Outer(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            weights_before_update[state.global_step] = flat_params(model)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            outer, snapshot = trainer._hybrid.predictor, trainer._guard_loop.snapshot
            anchor = torch.cat([a.reshape(-1) for a in outer.anchor]) if outer.anchor is not None else None
            rows.append({"params": flat_params(model), "anchor": anchor, "snapshot_step": snapshot.step,
                         "on_anchor": snapshot.weights.tensors is outer.anchor,
                         "buf": torch.cat([b.reshape(-1) for b in outer.buf]).clone() if outer.buf else None})

    trainer.add_callback(Outer())
    trainer.train()
    trace = guard_trace(tmp_out)
    rolled = [i for i, r in enumerate(trace) if r["guard"] == "rollback"]
    assert len(rolled) == 1 and trainer.hybrid_stats()["predict_steps"] >= 2
    before, at = rows[rolled[0] - 1], rows[rolled[0]]
    assert before["on_anchor"] and before["buf"] is not None and before["buf"].abs().sum() > 0  # kept jumps built it
    # Taken before the update of the first real step after a jump's verdict (or the first step with optimizer state):
    # the trace counts steps from 1, the snapshot from 0.
    jumps = [r["step"] for r in trace if r["phase"] == "predict"]
    taken = sorted({r["snapshot_step"] for r in rows[:rolled[0]] if r["snapshot_step"] is not None})
    assert len(taken) >= 3 and taken == [1, *(step for step in jumps if step <= taken[-1])]
    assert torch.equal(at["params"], weights_before_update[before["snapshot_step"]])
    assert torch.equal(at["anchor"], at["params"]) and at["buf"] is None  # the momentum is cleared and freed
    assert trainer._guard_loop.snapshot.optimizer_state.tensors is not None


def train_recording_snapshots(trainer) -> dict[int, tuple[int | None, bool]]:
    """Train; after each step, the guard snapshot's step and whether its weights are the outer anchor."""
    rows = {}

    class Snapshots(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            outer, snapshot = trainer._hybrid.predictor, trainer._guard_loop.snapshot
            rows[state.global_step] = (snapshot.step, snapshot.weights.tensors is outer.anchor)

    trainer.add_callback(Snapshots())
    trainer.train()
    return rows


def test_after_a_save_the_guard_holds_a_copy_of_its_own_until_the_next_cycle_starts(tmp_out, monkeypatch):
    """A resumed run has the anchor from the checkpoint but not the optimizer state of the cycle's start, so both runs
    take a snapshot of their own at the step after a save (1x the parameters more), and stand on the anchor again
    where the next cycle starts."""
    # The tiny model reads aligned at 3e-3 (autopilot/alignment.py), where a raise would move the steps counted here.
    monkeypatch.setattr("hf_hybrid.autopilot.alignment.ALIGNED", float("inf"))
    trainer = make_trainer(tmp_out, **OUTER, max_steps=30, save_strategy="steps", save_steps=13,
                           hybrid_payoff_check=False)
    rows = train_recording_snapshots(trainer)
    jumps = [r["step"] for r in guard_trace(tmp_out) if r["phase"] == "predict"]
    after_save = min(j for j in jumps if j > 13)
    assert rows[14] == (13, False)  # a copy of its own, at the checkpoint's state
    assert all(rows[step] == (13, False) for step in range(14, after_save + 1))
    assert rows[after_save + 1] == (after_save, True)  # on the anchor again: the own copy is given back


def test_a_cycle_longer_than_the_snapshot_interval_takes_copies_of_its_own(tmp_out, monkeypatch):
    """The warmup makes the first cycle long: the rollback point still moves every `hybrid_guard_snapshot_steps`
    steps, with a copy of the weights of its own, and goes back onto the anchor where the next cycle starts."""
    # The tiny model reads aligned at 3e-3 (autopilot/alignment.py), where a raise would move the steps counted here.
    monkeypatch.setattr("hf_hybrid.autopilot.alignment.ALIGNED", float("inf"))
    trainer = make_trainer(tmp_out, **OUTER, hybrid_warmup_steps=20, hybrid_guard_snapshot_steps=5, max_steps=40)
    rows = train_recording_snapshots(trainer)
    first_jump = min(r["step"] for r in guard_trace(tmp_out) if r["phase"] == "predict")
    taken = sorted({rows[step] for step in range(1, first_jump) if rows[step][0] is not None})
    assert taken == [(1, True), *((step, False) for step in range(6, first_jump - 1, 5))], taken
    assert rows[first_jump + 1] == (first_jump, True)


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
