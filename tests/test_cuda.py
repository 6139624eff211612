"""On a GPU only (skipped elsewhere): predicted steps under bf16 autocast and the fp16 GradScaler, `--hybrid false`
bit for bit, the guard under fp16, the trainer under FSDP2, and training after rejected jumps and readings bit for bit
the Trainer's. What the hybrid holds on the device and in pinned memory: test_cuda_memory.py."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_hybrid import HybridHFTrainer, Phase

from .conftest import hybrid_args, make_trainer, reject_every_jump, tiny_gpt2, token_dataset
from .test_equivalence_resume import assert_bit_identical, state
from .test_predict import StepRecorder, kept_predicted_steps
from .test_rejected_jumps import WeightsPerStep
from .test_safety import nan_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ON_GPU = dict(use_cpu=False)
FSDP2_WORKER = Path(__file__).with_name("fsdp2_trainer_worker.py")
ACCELERATE_FSDP2 = Path(__file__).resolve().parents[1] / "recipes" / "accelerate" / "fsdp2.yaml"


@pytest.fixture(autouse=True)
def restore_determinism():
    """`full_determinism=True` switches deterministic algorithms on for the whole process; switch them back."""
    yield
    torch.use_deterministic_algorithms(False)


class ScaleRecorder(StepRecorder):
    """Adds the GradScaler's scale and whether the scaler skipped the optimizer step."""

    def on_step_end(self, args, state, control, **kwargs):
        super().on_step_end(args, state, control, **kwargs)
        scaler = self.trainer.accelerator.scaler
        self.rows[-1]["scale"] = scaler.get_scale() if scaler is not None else None
        self.rows[-1]["scaler_skipped"] = self.trainer.accelerator.optimizer_step_was_skipped


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_predict_under_mixed_precision(tmp_out, precision):
    recorder = ScaleRecorder()
    trainer = make_trainer(tmp_out, max_steps=60, **ON_GPU, **{precision: True})
    trainer.add_callback(recorder)
    recorder.trainer = trainer
    trainer.train()
    rows = recorder.rows
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters()), "master weights must stay fp32"
    predicted = kept_predicted_steps(rows)
    assert len(predicted) >= 5
    # A predicted step must not touch the scaler: no unscale, no update, so its scale cannot move.
    assert all(rows[i]["scale"] == rows[i - 1]["scale"] for i in predicted)
    for i, row in enumerate(rows[1:], start=1):
        if row["phase"] is not Phase.PREDICT:
            assert row["had_grad"] is True
            assert row["adam_step"] == rows[i - 1]["adam_step"] + (0 if row["scaler_skipped"] else 1)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < losses[0]


def test_nan_under_fp16_never_reaches_the_weights(tmp_out):
    model = nan_model(at_grad=(3, 9, 17))
    trainer = make_trainer(tmp_out, model=model, fp16=True, **ON_GPU)
    trainer.train()
    stats = trainer.hybrid_stats()
    assert stats["non_finite"] == 3
    assert all(torch.isfinite(p).all() for p in model.parameters())
    adam_steps = {float(s["step"]) for s in trainer.optimizer.optimizer.state.values()}
    assert max(adam_steps) <= stats["backward_steps"] - 3


def test_hybrid_false_is_the_plain_trainer_under_bf16(tmp_path):
    common = dict(per_device_train_batch_size=8, learning_rate=3e-3, max_steps=25, report_to="none", seed=0,
                  disable_tqdm=True, save_strategy="no", bf16=True, full_determinism=True)
    plain_model = tiny_gpt2()
    Trainer(model=plain_model, args=TrainingArguments(output_dir=str(tmp_path / "a"), **common),
            train_dataset=token_dataset()).train()
    hybrid_model = tiny_gpt2()
    HybridHFTrainer(model=hybrid_model, args=hybrid_args(tmp_path / "b", hybrid=False, **ON_GPU, **common),
                    train_dataset=token_dataset()).train()
    assert next(plain_model.parameters()).is_cuda
    assert_bit_identical(state(plain_model), state(hybrid_model))


@pytest.mark.parametrize("predictor", ["velocity", "adam"])
def test_trainer_under_accelerate_fsdp2(tmp_path, predictor):
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE_FSDP2),
           "--num_processes", "1", str(FSDP2_WORKER), str(tmp_path), predictor]
    done = subprocess.run(cmd, env=dict(os.environ), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((tmp_path / "rank0.json").read_text())
    # The engine must see the sharded DTensors, not full copies.
    assert result["fsdp_version"] == 2 and result["engine_param_types"] == ["DTensor"], result
    assert result["predict_steps_kept"] >= 5 and result["moved_on_predict"] == result["predict_steps_kept"]
    assert result["apply_calls"] == result["predict_steps"] and result["apply_collectives"] == 0
    assert result["finite"] and result["last_loss"] < result["first_loss"]


def test_guard_skip_under_fp16_keeps_the_loss_scale_and_rolls_back_exactly(tmp_out):
    """A finite outlier leaves GradScaler's scale where it was; a rollback from the guard's snapshot is exact."""
    from .test_guard import FaultPlan, guarded_trainer, train_recorded

    trainer = guarded_trainer(tmp_out, FaultPlan(window=(30, 32), spike_step=35), fp16=True, **ON_GPU)
    scales = []

    class Scale(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            scales.append(trainer.accelerator.scaler.get_scale())

    trainer.add_callback(Scale())
    rows = train_recorded(trainer).rows
    events = {r["step"]: r["guard"] for r in map(json.loads, (tmp_out / "hybrid_trace.jsonl").read_text().splitlines())
              if r["guard"]}
    assert events.get(31) == "skip" and events.get(32) == "skip" and "rollback" in events.values(), events
    assert scales[30] == scales[31] == scales[29]
    rolled = next(step for step, action in events.items() if action == "rollback") - 1
    assert torch.equal(rows[rolled]["params"], rows[rows[rolled - 1]["snapshot"] - 1]["params"])


class Readings:
    """Counts the autopilot's readings: each applies a step along its line and restores what it touched."""

    def __init__(self, monkeypatch) -> None:
        from hf_hybrid.autopilot.scale import LrScale

        self.count, original = 0, LrScale.reading

        def counted(scale, *args, **kwargs):
            self.count += 1
            return original(scale, *args, **kwargs)

        monkeypatch.setattr(LrScale, "reading", counted)


@pytest.mark.parametrize("predictor", ["outer", "velocity"])
@pytest.mark.parametrize("optim", ["adamw_torch_fused", "adamw_torch"])
def test_after_rejected_jumps_and_readings_training_is_the_trainers_bit_for_bit(tmp_path, monkeypatch, optim,
                                                                               predictor):
    """The CPU suite's rejected-jumps test (test_safety.py) through the GPU's own paths: the outer state and the guard's
    snapshot on the device (where the placement puts it at 124M) with asynchronous copies, the CUDA dropout RNG, bf16
    autocast, fused AdamW, and the autopilot's readings (never a raise here). GPT-2 124M on one GPU ended its one pair
    0.025-0.05 above its Trainer, within what two plain runs there differ (docs/benchmarks-history.md, run 124): this
    settles whether any of it is the hybrid's."""
    settings = dict(max_steps=100, lr_scheduler_type="linear", optim=optim, weight_decay=0.1, bf16=True,
                    full_determinism=True, **ON_GPU)
    plain = WeightsPerStep()
    reference = make_trainer(tmp_path / "plain", model=tiny_gpt2(dropout=0.1), dataset=token_dataset(1024),
                             hybrid=False, **settings)
    reference.add_callback(plain)
    reference.train()

    reject_every_jump(monkeypatch)
    monkeypatch.setattr("hf_hybrid.autopilot.scale.RAISE_REACH", math.inf)
    monkeypatch.setattr("hf_hybrid.autopilot.scale.STEADY_REACH", math.inf)
    # Nor does any reading hold the jumps back: they are to be tried and rejected.
    monkeypatch.setattr("hf_hybrid.autopilot.scale.LrScale.steps_long_enough", property(lambda self: False))
    readings = Readings(monkeypatch)
    recorder = StepRecorder()
    trainer = make_trainer(tmp_path / "hybrid", model=tiny_gpt2(dropout=0.1), dataset=token_dataset(1024),
                           hybrid_predictor=predictor, hybrid_outer_period=10, hybrid_payoff_check=True,
                           hybrid_max_rejections=3, **settings)
    trainer.add_callback(recorder)
    recorder.trainer = trainer
    trainer.train()
    stats = trainer.hybrid_stats()
    assert stats["predictions_judged"] == 3 and stats["predictions_kept"] == 0 and stats["lr_scale"] == 1.0
    assert readings.count >= 2
    real = [r["params"] for r in recorder.rows if r["phase"] is not Phase.PREDICT]
    assert len(real) == 100
    for n, params in enumerate(real):
        assert torch.equal(params, plain.params[n]), f"real step {n + 1} differs from the Trainer's"
