"""The guard on real steps: a bad batch is skipped, damaged weights roll back, too many rollbacks stop the run,
a clean run is untouched, and resuming across any of it is bit-exact."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_hybrid import HybridHFTrainer
from hf_hybrid.checkpoint import FORMAT_VERSION, find_hybrid_state, load_hybrid_state
from hf_hybrid.config import hybrid_config
from hf_hybrid.guard.config import GuardConfig
from hf_hybrid.guard.rules import Action, StepGuard
from hf_hybrid.trainer import GuardStoppedError

from .conftest import flat_params, hybrid_args, tiny_gpt2, token_dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from faults import FaultPlan, LearningRateSpike, with_faults  # noqa: E402

# A short window for 40-step runs, and a learning rate at which the tiny model's loss falls far below that of
# random labels within them (with 64 tokens, they raise the loss less than with GPT-2's vocabulary).
GUARD = dict(hybrid_guard_window=16, hybrid_guard_snapshot_steps=5, max_grad_norm=1.0, learning_rate=1e-2)
SPIKE = 200.0


class StateRecorder(TrainerCallback):
    """Weights and AdamW state at the end of every optimizer step (first in line: before any other callback)."""

    def __init__(self) -> None:
        self.trainer = None
        self.rows = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        optimizer = self.trainer.optimizer
        moments = torch.cat([s["exp_avg"].reshape(-1).clone() for s in optimizer.state.values()])
        snapshot = self.trainer._guard_loop.snapshot
        self.rows.append({"step": state.global_step, "params": flat_params(model), "moments": moments,
                          "lr": self.trainer.lr_scheduler.get_last_lr()[0], "snapshot": snapshot.step})


def guard_config(**changes) -> GuardConfig:
    """The flags' default guard settings, with `changes`."""
    return replace(hybrid_config(SimpleNamespace()).guard, **changes)


def guarded_trainer(output_dir, plan: FaultPlan | None = None, model=None, spike: float = SPIKE,
                    **overrides) -> HybridHFTrainer:
    settings = {"hybrid_predict": False, **GUARD, **overrides}
    cls = with_faults(HybridHFTrainer, plan) if plan is not None else HybridHFTrainer
    trainer = cls(model=model if model is not None else tiny_gpt2(), args=hybrid_args(output_dir, **settings),
                  train_dataset=token_dataset())
    if plan is not None:
        trainer.add_callback(LearningRateSpike(plan.spike_step, spike))
    return trainer


def train_recorded(trainer) -> StateRecorder:
    recorder = StateRecorder()
    recorder.trainer = trainer
    trainer.callback_handler.callbacks.insert(1, recorder)  # right after the hybrid's own hooks
    trainer.train()
    return recorder


def trace(output_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(output_dir) / "hybrid_trace.jsonl").read_text().splitlines()]


def adam_steps(trainer) -> set[float]:
    return {float(s["step"]) for s in trainer.optimizer.optimizer.state.values()}


# ---- the pure guard ------------------------------------------------------------------------------


def test_guard_flags_upward_outliers_and_non_finite_values_only():
    guard = StepGuard(guard_config(window=32), min_steps=8)
    g = torch.Generator().manual_seed(0)
    for step, noise in enumerate(torch.randn(40, generator=g).tolist()):
        assert guard.check(step, 5.0 - 0.02 * step + 0.05 * noise, 1.0 + 0.1 * abs(noise)) is None
    assert guard.check(41, 3.0, 1.0) is None  # a loss far *below* the window is good news
    event = guard.check(42, 9.0, 1.0)
    assert (event.signal, event.action) == ("loss", Action.SKIP) and event.bound < 9.0
    assert guard.check(43, 4.5, 50.0).signal == "grad_norm"
    assert guard.check(44, float("nan"), 1.0).signal == "non-finite loss"
    assert guard.check(45, 4.5, float("inf")).signal == "non-finite grad_norm"
    assert guard.outliers == 4 and guard.consecutive_skips == 4


def test_with_clipped_gradients_only_a_non_finite_gradient_norm_is_an_outlier():
    guard = StepGuard(guard_config(window=32), min_steps=8, grad_norm_outliers=False)
    for step in range(16):
        assert guard.check(step, 5.0 + 0.01 * (step % 3), 1.0) is None
    assert guard.check(16, 5.0, 50.0) is None  # the Trainer's clip bounds this step already
    assert guard.check(17, 5.0, float("inf")).signal == "non-finite grad_norm"
    assert guard.check(18, 9.0, 1.0).signal == "loss"


def test_guard_escalates_from_skip_to_rollback_to_stop():
    guard = StepGuard(guard_config(window=16, max_skips=4, max_rollbacks=1), min_steps=8)
    for step in range(16):
        guard.check(step, 4.0 + 0.01 * (step % 3), 1.0)
    event = guard.check(16, 20.0, 1.0)
    guard.judge_weights(event, 4.01, 1.0)  # the last good batch is fine: bad data, not bad weights
    guard.escalate(event, has_snapshot=True)
    assert event.action is Action.SKIP
    event = guard.check(17, 20.0, 1.0)
    guard.judge_weights(event, 4.01, 30.0)  # a steep gradient at an ordinary loss: a sharp region, not damage
    guard.escalate(event, has_snapshot=True)
    assert (event.action, event.signal, guard.rollbacks) == (Action.SKIP, "loss", 0)
    event = guard.check(18, 20.0, 1.0)
    guard.judge_weights(event, 15.0, 1.0)  # the last good batch's loss is flagged too: damaged weights
    guard.escalate(event, has_snapshot=True)
    assert (event.action, event.signal, guard.rollbacks) == (Action.ROLLBACK, "weights (loss)", 1)
    for step in (19, 20, 21):
        assert guard.check(step, 20.0, 1.0).action is Action.SKIP
    event = guard.check(22, 20.0, 1.0)  # the fourth outlier in a row since the rollback: persistence
    assert event.action is Action.ROLLBACK
    guard.escalate(event, has_snapshot=True)
    assert event.action is Action.STOP  # one rollback allowed
    event = StepGuard(guard_config(), min_steps=8).check(0, float("nan"), 1.0)
    event.action = Action.ROLLBACK
    StepGuard(guard_config()).escalate(event, has_snapshot=False)
    assert event.action is Action.STOP  # nothing to roll back to


def test_a_last_batch_whose_loss_its_own_update_raised_convicts_the_weights():
    guard = StepGuard(guard_config(window=16), min_steps=8)
    for step in range(16):
        guard.check(step, 4.0 + 0.01 * (step % 3), 1.0)  # the last accepted loss 4.00; sigma: the 2% floor
    event = guard.check(16, 20.0, 1.0)
    guard.judge_weights(event, 4.07, 1.0)  # within a sigma of its loss when accepted: noise, not damage
    assert event.action is Action.SKIP
    event = guard.check(17, 20.0, 1.0)
    guard.judge_weights(event, 4.2, 1.0)  # under the outlier bound (4.49), but 2.5 sigmas above where it was
    assert event.action is Action.ROLLBACK
    assert event.signal == "weights (last accepted batch's loss, 4 before its update)"
    assert (event.value, event.bound) == (4.2, pytest.approx(4.0 + 0.02 * 4.01))  # the floor at the median


# ---- in the Trainer --------------------------------------------------------------------------------


def test_clean_run_never_triggers_the_guard_and_equals_the_plain_trainer(tmp_path):
    common = dict(per_device_train_batch_size=8, learning_rate=1e-2, max_steps=60, report_to="none", seed=0,
                  use_cpu=True, disable_tqdm=True, save_strategy="no", max_grad_norm=1.0)
    plain = tiny_gpt2()
    Trainer(model=plain, args=TrainingArguments(output_dir=str(tmp_path / "plain"), **common),
            train_dataset=token_dataset()).train()
    guarded = tiny_gpt2()
    trainer = HybridHFTrainer(model=guarded, args=hybrid_args(tmp_path / "guard", hybrid_predict=False,
                                                              **{**GUARD, **common}),
                              train_dataset=token_dataset())
    trainer.train()
    stats = trainer.hybrid_stats()
    assert stats["guard_outliers"] == stats["skipped_steps"] == stats["guard_rollbacks"] == 0
    assert trainer._guard_loop.snapshot.valid  # it did take snapshots, and they changed nothing
    assert torch.equal(flat_params(plain), flat_params(guarded))


def test_bad_batches_are_skipped_leaving_weights_and_optimizer_state_untouched(tmp_out):
    plan = FaultPlan(window=(30, 33))
    trainer = guarded_trainer(tmp_out, plan)
    rows = train_recorded(trainer).rows
    flagged = [r for r in trace(tmp_out) if r["guard"]]
    assert [r["step"] for r in flagged] == [31, 32, 33] and {r["guard"] for r in flagged} == {"skip"}
    for step in (31, 32, 33):  # bit-identical to the end of step 30, the last good one
        assert torch.equal(rows[step - 1]["params"], rows[29]["params"])
        assert torch.equal(rows[step - 1]["moments"], rows[29]["moments"])
        assert rows[step - 1]["lr"] == rows[29]["lr"]
    assert not torch.equal(rows[33]["params"], rows[29]["params"])  # training goes on after the window
    stats = trainer.hybrid_stats()
    assert stats["skipped_steps"] == 3 and stats["guard_rollbacks"] == 0
    # Skipped steps do not count: 40 real updates, 43 optimizer steps.
    assert adam_steps(trainer) == {40.0} and trainer.state.global_step == 43


def test_bad_batches_inside_gradient_accumulation_are_skipped_whole(tmp_out):
    plan = FaultPlan(window=(30, 31))
    trainer = guarded_trainer(tmp_out, plan, gradient_accumulation_steps=2, per_device_train_batch_size=4)
    rows = train_recorded(trainer).rows
    assert [r["step"] for r in trace(tmp_out) if r["guard"]] == [31]
    assert torch.equal(rows[30]["params"], rows[29]["params"])
    assert torch.equal(rows[30]["moments"], rows[29]["moments"])
    assert adam_steps(trainer) == {40.0}


def test_damaged_weights_roll_back_to_the_snapshot_exactly(tmp_out):
    plan = FaultPlan(spike_step=27)
    trainer = guarded_trainer(tmp_out, plan)
    rows = train_recorded(trainer).rows
    events = [r for r in trace(tmp_out) if r["guard"]]
    assert events[0]["step"] == 29 and events[0]["guard"] == "rollback"  # the first step after the spiked update
    rolled = events[0]["step"] - 1
    snapshot_step = rows[rolled - 1]["snapshot"]  # 0-based: the weights before that step's update
    assert snapshot_step <= 27
    assert torch.equal(rows[rolled]["params"], rows[snapshot_step - 1]["params"])
    assert torch.equal(rows[rolled]["moments"], rows[snapshot_step - 1]["moments"])
    assert rows[rolled]["lr"] == rows[snapshot_step - 1]["lr"]
    stats = trainer.hybrid_stats()
    assert stats["guard_rollbacks"] == 1 and stats["guard_undone_steps"] == 28 - snapshot_step
    assert adam_steps(trainer) == {40.0}  # every undone update made up
    assert all(torch.isfinite(r["params"]).all() for r in rows)


def test_an_update_that_raised_its_own_batchs_loss_is_rolled_back(tmp_out, caplog):
    """A 70x update: the next step's loss is flagged, and the batch the update was computed on still reads under the
    outlier bound (4.14 against 4.63); but its loss rose from 2.08 to 4.14 through that update, so the weights are
    bad, not the data. Before session 28 the guard skipped the step and kept the update."""
    trainer = guarded_trainer(tmp_out, FaultPlan(spike_step=27), spike=70.0)
    with caplog.at_level("WARNING", logger="hf_hybrid.guard.runner"):
        rows = train_recorded(trainer).rows
    events = [(r["step"], r["guard"]) for r in trace(tmp_out) if r["guard"]]
    assert events == [(29, "rollback")]
    assert ("step 29: weights (last accepted batch's loss, 2.078 before its update) 4.139 > bound 2.449: rolled back"
            in caplog.text)
    snapshot_step = rows[27]["snapshot"]
    assert snapshot_step <= 27 and torch.equal(rows[28]["params"], rows[snapshot_step - 1]["params"])
    assert adam_steps(trainer) == {40.0}


def test_too_many_rollbacks_save_a_checkpoint_and_stop(tmp_out):
    plan = FaultPlan(spike_step=27)
    trainer = guarded_trainer(tmp_out, plan, hybrid_guard_max_rollbacks=0)
    with pytest.raises(GuardStoppedError, match=r"stopped training at step 29: weights \(.* after 0 rollbacks .*"
                                                r"checkpoint-29\. Try a lower learning rate"):
        trainer.train()
    snapshot = trainer._guard_loop.snapshot
    saved = load_hybrid_state(str(tmp_out / "checkpoint-29" / "hybrid_state_rank0.pt"))
    assert "snapshot" not in saved["guard"]  # no second copy of weights and optimizer state in the checkpoint
    # The checkpoint holds the snapshot's weights, not the damaged ones.
    assert torch.equal(flat_params(trainer.model), torch.cat([t.reshape(-1) for t in snapshot.weights.tensors]))
    saved_weights = load_file(tmp_out / "checkpoint-29" / "model.safetensors")
    params = dict(trainer.model.named_parameters())
    assert len(saved_weights.keys() & params.keys()) >= len(params) - 1  # a tied head may be saved once
    assert all(torch.equal(saved_weights[name], params[name]) for name in saved_weights.keys() & params.keys())


def test_nan_reaches_no_weight_and_a_finite_outlier_keeps_the_schedule(tmp_out):
    plan = FaultPlan(nan_step=3, window=(30, 31))  # the NaN comes before the statistics are ready
    trainer = guarded_trainer(tmp_out, plan)
    rows = train_recorded(trainer).rows
    assert [(r["step"], r["guard"]) for r in trace(tmp_out) if r["guard"]] == [(4, "skip"), (31, "skip")]
    for skipped in (3, 30):  # 0-based rows of steps 4 and 31: no weight moved, the schedule did not advance
        assert torch.equal(rows[skipped]["params"], rows[skipped - 1]["params"])
        assert rows[skipped]["lr"] == rows[skipped - 1]["lr"] != rows[skipped + 1]["lr"]
    assert trainer.hybrid_stats()["non_finite"] == 1
    assert all(torch.isfinite(r["params"]).all() for r in rows)


# After a rollback; right before two skips (a skipped step writes no checkpoint: `--save_steps` counts updates).
@pytest.mark.parametrize("resume_at", [30, 34])
def test_resume_across_guard_events_is_bit_exact(tmp_path, resume_at):
    plan = FaultPlan(window=(34, 36), spike_step=20)
    settings = dict(save_strategy="steps", save_steps=1, hybrid_predict=True, hybrid_payoff_check=True)
    full = guarded_trainer(tmp_path / "full", plan, **settings)
    full.train()
    events = {r["guard"] for r in trace(tmp_path / "full") if r["guard"]}
    assert events == {"skip", "rollback"}
    resumed_model = tiny_gpt2(seed=123)
    resumed = guarded_trainer(tmp_path / "resumed", plan, model=resumed_model, **settings)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / f"checkpoint-{resume_at}"))
    assert resumed.state.global_step == full.state.global_step
    assert torch.equal(flat_params(full.model), flat_params(resumed_model))
    assert resumed.hybrid_stats() == full.hybrid_stats()


def test_a_checkpoint_holding_a_pickled_object_is_refused(tmp_path):
    path = tmp_path / "hybrid_state_rank0.pt"
    torch.save({"controller": {}, "payload": Path("/tmp")}, path)  # any class instance, not plain data
    with pytest.raises(ValueError, match="holds objects other than tensors and plain Python types"):
        load_hybrid_state(str(path))


@pytest.mark.parametrize("saved, layout", [({"controller": {}}, "unversioned"),
                                           ({"format_version": 2, "autopilot": {"scale": {}}}, "2")])
def test_a_checkpoint_of_another_layout_is_refused_by_name(tmp_path, saved, layout):
    """A part's state loads with no default guessed for a key it lacks: a hybrid state of another layout (none, or
    layout 2, whose autopilot kept no first steps' alignment) is refused, with the way out, before any part reads it."""
    (tmp_path / "checkpoint-5").mkdir()
    torch.save(saved, tmp_path / "checkpoint-5" / "hybrid_state_rank0.pt")
    with pytest.raises(ValueError, match=rf"layout {layout}, and this hf_hybrid reads layout {FORMAT_VERSION}\. "
                                         r".*delete the checkpoint's hybrid_\*\.pt files"):
        find_hybrid_state(str(tmp_path / "checkpoint-5"), 0)
