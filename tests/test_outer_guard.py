"""The guard with the outer-momentum predictor: its snapshot stands on the anchor, a rollback restarts the cycle there,
and the guard takes copies of its own only where the anchor cannot serve."""

from __future__ import annotations

import torch
from transformers import TrainerCallback

from .conftest import flat_params, make_trainer
from .test_guard import FaultPlan, guarded_trainer
from .test_guard import trace as guard_trace
from .test_outer import OUTER


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
