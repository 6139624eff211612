"""The mixin with the rest of the ecosystem: Seq2SeqTrainer, PEFT/LoRA, TensorBoard, bf16 autocast on CPU, losses that
pop the labels, `model_init`, and the one-line errors for set-ups that cannot work. TRL: tests/test_trl.py."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import pytest
import torch
from datasets import Dataset
from transformers import (
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    T5Config,
    T5ForConditionalGeneration,
    Trainer,
    TrainerCallback,
)

from hf_hybrid import HybridHFTrainer, HybridMixin, HybridTrainingArguments, Phase
from hf_hybrid.trace import TRACE_NAME

from .conftest import FAST_SCHEDULE, flat_params, hybrid_args, make_trainer, tiny_gpt2, token_dataset


def adam_step_counts(trainer) -> set[float]:
    """AdamW's per-parameter `step`, for every parameter it holds state for."""
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    return {float(state["step"]) for state in optimizer.state.values()}


class OptimizerStepCounter(TrainerCallback):
    """Counts the calls that reach the torch optimizer's `step` (past accelerate's wrapper and its veto).

    AdamW's per-parameter `step` alone cannot tell: it skips parameters whose `.grad` is None, and a Predict
    step leaves every `.grad` None, so the state would not move even if `step()` ran."""

    def __init__(self) -> None:
        self.calls = 0

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        inner = getattr(optimizer, "optimizer", optimizer)
        inner.register_step_post_hook(self._count)

    def _count(self, optimizer, args, kwargs):
        self.calls += 1


def assert_optimizer_ran_only_on_real_steps(trainer, counter: OptimizerStepCounter) -> None:
    stats = trainer.hybrid_stats()
    assert counter.calls == stats["backward_steps"], "the optimizer's step() ran on a predicted step"
    assert adam_step_counts(trainer) == {float(stats["backward_steps"])}


@torch.no_grad()
def lm_loss(model, dataset: Dataset, n: int = 64) -> float:
    """Plain fp32 language-model loss of `model` on the first `n` sequences."""
    was_training = model.training
    model.eval()
    ids = torch.tensor(dataset[:n]["input_ids"])
    loss = float(model(input_ids=ids, labels=ids).loss)
    model.train(was_training)
    return loss


# ---- TRL ----------------------------------------------------------------------------------------------


@dataclass
class _HybridSeq2SeqArguments(Seq2SeqTrainingArguments, HybridTrainingArguments):
    """Paired as `HybridSFTConfig` pairs TRL's config: the subclass's arguments first, so its defaults win."""


class _HybridSeq2SeqTrainer(HybridMixin, Seq2SeqTrainer):
    pass


def test_an_encoder_decoder_under_seq2seq_trainer_gains_the_hybrid_through_the_mixin(tmp_path):
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=32, d_kv=16, d_ff=64, num_layers=2,
                                                num_heads=2, decoder_start_token_id=0, pad_token_id=0))
    before = flat_params(model)
    args = _HybridSeq2SeqArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, learning_rate=3e-3, max_steps=40,
        save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True, seed=0,
        **dict(FAST_SCHEDULE, hybrid_payoff_check=True),
    )
    trainer = _HybridSeq2SeqTrainer(model=model, args=args, train_dataset=token_dataset())
    counter = OptimizerStepCounter()
    trainer.add_callback(counter)
    trainer.train()

    stats = trainer.hybrid_stats()
    assert stats["predict_steps"] > 0 and stats["predictions_judged"] >= 1 and stats["lr_readings"] >= 1, stats
    assert_optimizer_ran_only_on_real_steps(trainer, counter)
    after = flat_params(model)
    assert torch.isfinite(after).all() and not torch.equal(before, after)


# ---- model_init ---------------------------------------------------------------------------------------


def test_model_init_reinitializes_the_model_the_hybrid_trains(tmp_path):
    """With `model_init` (hyperparameter_search's way) the Trainer builds a fresh model at each `train()`: the hybrid's
    engine must take that one, not the model of `__init__`."""
    from .test_lr_advice import OUTER

    def trained(cls, out, **flags):
        args = hybrid_args(tmp_path / out, **{**OUTER, "max_steps": 40, "learning_rate": 1e-3}, **flags)
        trainer = cls(model_init=lambda: tiny_gpt2(seed=3), args=args, train_dataset=token_dataset())
        trainer.train()
        return trainer

    plain = trained(Trainer, "plain", hybrid=False)
    assert torch.equal(flat_params(trained(HybridHFTrainer, "off", hybrid=False).model), flat_params(plain.model))
    hybrid = trained(HybridHFTrainer, "on")
    stats = hybrid.hybrid_stats()
    assert stats["lr_raises_kept"] >= 1 and stats["predictions_judged"] >= 1, stats
    assert not torch.equal(flat_params(hybrid.model), flat_params(plain.model))
    trained_params = {id(p) for p in hybrid.model.parameters()}
    assert all(id(p) in trained_params for p in hybrid.hybrid_engine.params)


# ---- PEFT ---------------------------------------------------------------------------------------------


def test_lora_trains_only_adapters_and_predicts(tmp_path):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        tiny_gpt2(), peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn"],
                                     fan_in_fan_out=True)
    )
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert lora and all("lora_" in n for n in lora)

    trainer = HybridHFTrainer(model=model, args=hybrid_args(tmp_path / "out"), train_dataset=token_dataset())
    counter = OptimizerStepCounter()
    trainer.add_callback(counter)
    trainer.train()

    stats = trainer.hybrid_stats()
    assert stats["predict_steps"] > 0
    named = dict(model.named_parameters())
    changed_frozen = [n for n, before in frozen.items() if not torch.equal(named[n], before)]
    assert not changed_frozen, f"frozen weights moved: {changed_frozen[:3]}"
    unchanged_lora = [n for n, before in lora.items() if torch.equal(named[n], before)]
    assert not unchanged_lora, f"LoRA weights did not train: {unchanged_lora}"
    assert all(torch.isfinite(named[n]).all() for n in lora)

    engine_params = trainer._hybrid.params
    assert all(p.requires_grad for p in engine_params)
    assert len(engine_params) == len(lora)
    assert {id(p) for p in engine_params} == {id(named[n]) for n in lora}
    assert_optimizer_ran_only_on_real_steps(trainer, counter)


# ---- TensorBoard ---------------------------------------------------------------------------------------


def test_tensorboard_gets_numeric_hybrid_scalars(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdir = tmp_path / "tb"
    # transformers 5 dropped TrainingArguments.logging_dir; TensorBoardCallback reads this variable instead.
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(logdir))
    trainer = make_trainer(tmp_path / "out", report_to="tensorboard")
    trainer.train()

    assert list(logdir.glob("events.out.tfevents.*")), "no TensorBoard event file written"
    events = EventAccumulator(str(logdir))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    wanted = ["train/hybrid/phase", "train/hybrid/backward_reduction", "train/hybrid/confidence"]
    assert set(wanted) <= tags, sorted(tags)
    series = {tag: [e.value for e in events.Scalars(tag)] for tag in wanted}
    for tag, values in series.items():
        assert len(values) >= 8 and all(math.isfinite(v) for v in values), tag
    assert set(series["train/hybrid/phase"]) <= {0.0, 1.0, 2.0, 3.0}
    assert all(0.0 <= v <= 1.0 for v in series["train/hybrid/confidence"])
    assert max(series["train/hybrid/confidence"]) > 0.0
    stats = trainer.hybrid_stats()
    assert stats["predict_steps"] > 0
    assert series["train/hybrid/backward_reduction"][-1] == pytest.approx(stats["backward_reduction"], rel=1e-6)


# ---- losses that take the labels out of the batch ---------------------------------------------------------


class _LabelledLoss:
    """A `compute_loss_func`: the model's own next-token loss, noting whether each call got the batch's labels."""

    def __init__(self) -> None:
        self.calls_without_labels = 0
        self.calls = 0

    def __call__(self, outputs, labels, num_items_in_batch=None):
        self.calls += 1
        if labels is None:
            self.calls_without_labels += 1
            return outputs.logits.sum() * 0.0
        return torch.nn.functional.cross_entropy(outputs.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


@pytest.mark.parametrize("loss_setup", ["label_smoothing_factor", "compute_loss_func"])
def test_a_loss_that_pops_the_labels_still_reads_and_judges_on_them(tmp_path, loss_setup):
    """`Trainer.compute_loss` pops "labels" from the batch it is given under a label smoother or a
    `compute_loss_func`; the probe batch the autopilot and the jumps read again and again must keep them."""
    loss_func = _LabelledLoss()
    overrides = dict(max_steps=60, hybrid_payoff_check=True)
    if loss_setup == "label_smoothing_factor":
        overrides["label_smoothing_factor"] = 0.1
    trainer = make_trainer(tmp_path / "out", **overrides)
    if loss_setup == "compute_loss_func":
        trainer.compute_loss_func = loss_func
    trainer.train()

    stats = trainer.hybrid_stats()
    assert stats["lr_readings"] >= 1 and stats["predictions_judged"] >= 1, stats
    assert loss_func.calls_without_labels == 0
    if loss_setup == "compute_loss_func":
        assert loss_func.calls > stats["backward_steps"], "the probe's forwards went through the user's loss"


# ---- one-line errors ----------------------------------------------------------------------------------


def _frozen_model():
    model = tiny_gpt2()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        (dict(model=_frozen_model), ["trainable"]),
        (dict(hybrid_predictor="adam", optim="sgd"), ["hybrid_predictor", "adam", "SGD", "velocity"]),
        # Adam's hyperparameters but no first moment: the predictor read a zero step from it.
        (dict(hybrid_predictor="adam", optim="schedule_free_adamw", lr_scheduler_type="constant"),
         ["hybrid_predictor", "adam", "AdamWScheduleFree", "velocity"]),
    ],
    ids=["no-trainable-params", "adam-predictor-with-sgd", "adam-predictor-with-schedule-free-adamw"],
)
def test_unsupported_setups_fail_in_one_line(tmp_path, overrides, needles):
    overrides = dict(overrides)
    if "model" in overrides:
        overrides["model"] = overrides["model"]()
    trainer = make_trainer(tmp_path / "out", max_steps=3, **overrides)
    with pytest.raises(ValueError) as info:
        trainer.train()
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message


class _CutOffAtStep2(TrainerCallback):
    """Raises at step 2's end, holding on to the trace file the run has open then."""

    def __init__(self, trainer):
        self.trainer, self.trace = trainer, None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2:
            self.trace = self.trainer._hybrid_trace
            raise RuntimeError("cut off at step 2")


def test_a_failed_train_leaves_no_open_trace_file(tmp_path):
    # A setup error comes before the trace would open: no file at all.
    trainer = make_trainer(tmp_path / "setup", max_steps=3, hybrid_predictor="adam", optim="sgd")
    with pytest.raises(ValueError, match="velocity"):
        trainer.train()
    assert not (tmp_path / "setup" / TRACE_NAME).exists()
    # An error once it is open: the steps so far stay in it, and the file is closed.
    trainer = make_trainer(tmp_path / "cut", max_steps=5)
    cut_off = _CutOffAtStep2(trainer)
    trainer.add_callback(cut_off)
    with pytest.raises(RuntimeError, match="cut off at step 2"):
        trainer.train()
    assert cut_off.trace is not None and cut_off.trace.closed, "hybrid_trace.jsonl left open after a failed train()"
    rows = [json.loads(line) for line in (tmp_path / "cut" / TRACE_NAME).read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]


# ---- bf16 autocast on CPU -----------------------------------------------------------------------------


class _ForwardDtypes:
    """The dtype of lm_head's output on each forward, by the phase of the optimizer step it ran in."""

    def __init__(self, trainer, model) -> None:
        self.by_phase: dict[Phase, set[torch.dtype]] = {}
        model.lm_head.register_forward_hook(self._hook)
        self.trainer = trainer

    def _hook(self, module, args, output):
        engine = self.trainer._hybrid
        if engine is not None and engine.record is not None:
            self.by_phase.setdefault(engine.record.phase, set()).add(output.dtype)


def test_bf16_autocast_on_cpu_predicts_and_learns(tmp_path):
    model, data = tiny_gpt2(), token_dataset()
    before = lm_loss(model, data)
    trainer = make_trainer(tmp_path / "out", model=model, dataset=data, bf16=True)
    dtypes = _ForwardDtypes(trainer, model)
    counter = OptimizerStepCounter()
    trainer.add_callback(counter)
    trainer.train()

    assert trainer.accelerator.mixed_precision == "bf16"
    stats = trainer.hybrid_stats()
    assert stats["predict_steps"] > 0 and stats["rollbacks"] == 0
    assert_optimizer_ran_only_on_real_steps(trainer, counter)
    assert all(p.dtype is torch.float32 for p in model.parameters()), "autocast must keep fp32 master weights"
    assert torch.isfinite(flat_params(model)).all()
    # The checking forward of a Predict step runs under the same autocast as a real step's forward.
    assert dtypes.by_phase.get(Phase.PREDICT) == {torch.bfloat16}
    assert dtypes.by_phase.get(Phase.FULL) == {torch.bfloat16}
    after = lm_loss(model, data)
    assert after < before - 0.5, (before, after)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < losses[0]
