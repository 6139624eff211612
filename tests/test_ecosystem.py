"""The mixin with the rest of the ecosystem: TRL's SFTTrainer, Seq2SeqTrainer, PEFT/LoRA, TensorBoard, bf16
autocast on CPU, losses that pop the labels, and the one-line errors for set-ups that cannot work."""

from __future__ import annotations

import copy
import json
import math
import warnings
from dataclasses import dataclass

import pytest
import torch
from datasets import Dataset
from transformers import (
    GPT2Config,
    GPT2ForSequenceClassification,
    GPT2LMHeadModel,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    T5Config,
    T5ForConditionalGeneration,
    Trainer,
    TrainerCallback,
)

from hf_hybrid import HybridHFTrainer, HybridMixin, HybridTrainingArguments, Phase

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


def _sft_classes():
    trl = pytest.importorskip("trl")
    from hf_hybrid import HybridSFTConfig, HybridSFTTrainer

    assert issubclass(HybridSFTTrainer, trl.SFTTrainer) and issubclass(HybridSFTTrainer, HybridMixin)
    return trl, HybridSFTConfig, HybridSFTTrainer


def test_without_trl_the_trl_classes_name_the_package_to_install(monkeypatch):
    import sys

    import hf_hybrid

    monkeypatch.setitem(sys.modules, "trl", None)  # what an environment without TRL gives `import trl`
    monkeypatch.delitem(sys.modules, "hf_hybrid.trl_trainers", raising=False)
    for name in ("HybridSFTTrainer", "HybridDPOConfig"):
        with pytest.raises(ImportError, match="need TRL, which is not installed: pip install trl"):
            getattr(hf_hybrid, name)


def _sft_text() -> Dataset:
    subjects = ["the cat", "the dog", "a king", "the queen", "a fool"]
    places = ["the mat", "a hat", "the throne", "the stage", "a ship"]
    texts = [f"{s} sat on {p}, and {p} was under {s}." for s in subjects for p in places]
    return Dataset.from_dict({"text": texts * 4})


def test_sft_config_keeps_trl_defaults_and_validates_hybrid_flags(tmp_path):
    trl, HybridSFTConfig, _ = _sft_classes()
    config = HybridSFTConfig(output_dir=str(tmp_path), use_cpu=True)
    plain = trl.SFTConfig(output_dir=str(tmp_path), use_cpu=True)
    assert isinstance(config, HybridTrainingArguments)
    assert (config.learning_rate, config.logging_steps) == (plain.learning_rate, plain.logging_steps)
    assert config.hybrid_warmup_steps == 100
    with pytest.raises(ValueError, match="hybrid_full_steps"):
        HybridSFTConfig(output_dir=str(tmp_path), use_cpu=True, hybrid_full_steps=0)


def test_sft_trainer_with_mixin_predicts_and_skips_the_optimizer(tmp_path):
    _, HybridSFTConfig, HybridSFTTrainer = _sft_classes()
    from hf_hybrid.data import load_shipped_tokenizer

    tokenizer = load_shipped_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=32, n_embd=16, n_layer=1, n_head=2,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    # TRL's own defaults stay on (gradient checkpointing); two micro-batches per step take SFTTrainer's
    # num_items_in_batch loss path, which the no-grad checking forward of a Predict step must scale alike.
    args = HybridSFTConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=3e-3, max_steps=24, logging_steps=4, save_strategy="no", report_to="none", use_cpu=True,
        disable_tqdm=True, seed=0, bf16=False, max_length=32, **FAST_SCHEDULE,
    )
    assert args.gradient_checkpointing
    trainer = HybridSFTTrainer(model=model, args=args, train_dataset=_sft_text(), processing_class=tokenizer)
    counter = OptimizerStepCounter()
    trainer.add_callback(counter)
    trainer.train()

    stats = trainer.hybrid_stats()
    assert stats["predict_steps"] >= 4
    assert stats["backward_steps"] + stats["predict_steps"] == trainer.state.global_step == 24
    assert_optimizer_ran_only_on_real_steps(trainer, counter)
    assert torch.isfinite(flat_params(model)).all()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    # Per optimizer step (trace): a checked predicted loss is on the scale of the real loss just before it.
    rows = [json.loads(line) for line in (tmp_path / "out" / "hybrid_trace.jsonl").read_text().splitlines()]
    checked = [(prev, row) for prev, row in zip(rows, rows[1:]) if row["phase"] == Phase.PREDICT.value
               and row["loss"] is not None and prev["phase"] != Phase.PREDICT.value]
    assert checked
    for prev, row in checked:
        assert abs(row["loss"] - prev["loss"]) < 0.5, (prev, row)


def _preference_pairs() -> Dataset:
    """DPO's kind of data: a prompt, and a completion preferred over another."""
    subjects = ["the cat", "the dog", "a king", "the queen", "a fool"]
    places = ["the mat", "a hat", "the throne", "the stage", "a ship"]
    rows = [{"prompt": f"{s} sat on", "chosen": f" {p}, and it was glad.", "rejected": f" {p} {p} {p} {p}."}
            for s in subjects for p in places]
    return Dataset.from_list(rows * 4)


def _desirability() -> Dataset:
    """KTO's kind of data: a prompt and a completion, labelled desirable or not."""
    rows = [{"prompt": row["prompt"], "completion": row[side], "label": side == "chosen"}
            for row in _preference_pairs() for side in ("chosen", "rejected")]
    return Dataset.from_list(rows)


TRL_KINDS = {"sft": "SFT", "dpo": "DPO", "kto": "KTO", "reward": "Reward"}


def _trl_run(tmp_path, kind: str, hybrid: bool, **overrides):
    """A tiny GPT-2 through one of TRL's offline trainers, with the hybrid's defaults or as TRL's own class."""
    trl = pytest.importorskip("trl")
    import hf_hybrid
    from hf_hybrid.data import load_shipped_tokenizer

    tokenizer = load_shipped_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=32, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    model = GPT2ForSequenceClassification(config) if kind == "reward" else GPT2LMHeadModel(config)
    name = TRL_KINDS[kind]
    config_class = getattr(hf_hybrid, f"Hybrid{name}Config") if hybrid else getattr(trl, f"{name}Config")
    trainer_class = getattr(hf_hybrid, f"Hybrid{name}Trainer") if hybrid else getattr(trl, f"{name}Trainer")
    settings = dict(output_dir=str(tmp_path / f"{kind}-{hybrid}"), per_device_train_batch_size=4, max_steps=24,
                    logging_steps=4, save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True, seed=0,
                    bf16=False, max_length=32)
    args = config_class(**{**settings, **overrides})
    if kind in ("sft", "reward"):
        data = _sft_text() if kind == "sft" else _preference_pairs()
        return trainer_class(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    data = _preference_pairs() if kind == "dpo" else _desirability()
    return trainer_class(model=model, ref_model=copy.deepcopy(model), args=args, train_dataset=data,
                         processing_class=tokenizer)


@pytest.mark.parametrize("kind", list(TRL_KINDS))
def test_trls_token_count_is_its_own_trainers_under_the_hybrid(tmp_path, kind):
    # The autopilot reads the probe batch along the next step every few steps, through the same compute_loss in
    # which TRL counts the tokens trained on: those forwards must not count. DPO's compute_loss also runs a second
    # forward, and warns, wherever a caller asks for its outputs, which the probe has no use for in DPO.
    plain = _trl_run(tmp_path, kind, hybrid=False, learning_rate=1e-4)
    plain.train()
    hybrid = _trl_run(tmp_path, kind, hybrid=True, learning_rate=1e-4)
    before = flat_params(hybrid.model).clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hybrid.train()
    assert hybrid.hybrid_stats()["lr_readings"] >= 1
    assert not torch.equal(flat_params(hybrid.model), before)
    assert not [w for w in caught if "return_outputs" in str(w.message)]
    counted = [[h["num_tokens"] for h in run.state.log_history if "num_tokens" in h] for run in (plain, hybrid)]
    assert len(counted[0]) == 6 and counted[1] == counted[0]


@pytest.mark.parametrize("kind", list(TRL_KINDS))
def test_a_probe_forward_leaves_trls_metrics_as_they_were(tmp_path, kind):
    from hf_hybrid.loop.forward_checks import probe_loss, probe_loss_by_sequence

    trainer = _trl_run(tmp_path, kind, hybrid=True, max_steps=4)
    trainer.train()
    batch = trainer.prepare_inputs(next(iter(trainer.get_train_dataloader())))
    trainer.compute_loss(trainer.model, dict(batch))  # something recorded, as at a training step

    def recorded():
        return trainer._total_train_tokens, {key: list(values) for key, values in trainer._metrics["train"].items()}

    kept = recorded()
    probe_loss(trainer, trainer.model, batch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss, rows = probe_loss_by_sequence(trainer, trainer.model, batch)
    assert recorded() == kept
    # No second forward to return the logits (TRL warns where one runs): SFT's rows come from its fused LM head's
    # output, and split its loss by sequence; DPO's pairs carry no labels and are not split.
    assert not [w for w in caught if "return_outputs" in str(w.message)]
    if kind == "sft":
        counts = (batch["labels"][:, 1:] != -100).sum(1)
        assert float((rows * counts).sum() / counts.sum()) == pytest.approx(float(loss), rel=1e-5)
    else:
        assert rows is None
    trainer.compute_loss(trainer.model, dict(batch))
    assert recorded() != kept  # what a training step records, TRL records


def _online_run(tmp_path, kind: str, mixin: bool, **overrides):
    """A tiny GPT-2 through TRL's GRPO or RLOO trainer, which generates its completions in `_prepare_inputs`, as TRL's
    own class or with the mixin (its config paired as `HybridSFTConfig` pairs SFT's)."""
    trl = pytest.importorskip("trl")
    from hf_hybrid.data import load_shipped_tokenizer

    tokenizer = load_shipped_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=32, n_embd=16, n_layer=1, n_head=2))
    config_class, trainer_class = getattr(trl, f"{kind}Config"), getattr(trl, f"{kind}Trainer")
    if mixin:
        config_class = dataclass(type(f"Hybrid{kind}Config", (config_class, HybridTrainingArguments), {}))
        trainer_class = type(f"Hybrid{kind}Trainer", (HybridMixin, trainer_class), {})
    args = config_class(**{**dict(output_dir=str(tmp_path / f"{kind}-{mixin}"), per_device_train_batch_size=4,
                                  num_generations=4, max_completion_length=6, max_steps=4, save_strategy="no",
                                  report_to="none", use_cpu=True, disable_tqdm=True, seed=0, bf16=False,
                                  learning_rate=1e-3, beta=0.0), **overrides})  # beta 0: no reference model to load
    prompts = Dataset.from_list([{"prompt": f"{s} sat on"} for s in ("the cat", "the dog", "a king", "a fool")] * 4)
    return trainer_class(model=model, reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
                         args=args, train_dataset=prompts, processing_class=tokenizer)


def _not_finite_at_training_forward(trainer, call: int) -> None:
    """The `call`-th forward with gradients (a training step's; generation runs without) returns NaN: one bad step,
    as an overflow makes."""
    calls = {"n": 0}

    def hook(module, args, output):
        if torch.is_grad_enabled():
            calls["n"] += 1
            if calls["n"] == call:
                return output * float("nan")

    trainer.model.transformer.ln_f.register_forward_hook(hook)


@pytest.mark.parametrize("kind", ["GRPO", "RLOO"])
def test_trainers_that_generate_their_batches_run_as_trls_own_with_the_non_finite_veto(tmp_path, kind, caplog):
    # The probe and the guard's re-run would call _prepare_inputs again, which here generates: with the full hybrid a
    # run would train on other completions than TRL's trainer even where nothing is kept. So the hybrid keeps only the
    # veto of a non-finite step, and with nothing to veto the run is TRL's own, bit for bit.
    weights = []
    for mixin in (False, True):
        with caplog.at_level("WARNING"):
            trainer = _online_run(tmp_path, kind, mixin)
        before = flat_params(trainer.model).clone()
        trainer.train()
        weights.append(flat_params(trainer.model))
        assert not torch.equal(weights[-1], before)
    assert torch.equal(*weights)
    line = next(r.getMessage() for r in caplog.records if "_prepare_inputs" in r.getMessage())
    assert f"{kind}Trainer builds its batches" in line and "autopilot, the jumps and the guard's checks are off" in line


def test_a_non_finite_step_leaves_a_grpo_run_finite_where_grpo_trainer_ends_at_nan(tmp_path, caplog):
    plain = _online_run(tmp_path, "GRPO", mixin=False, max_steps=8)
    _not_finite_at_training_forward(plain, 3)
    with pytest.raises(RuntimeError, match="probability tensor contains"):  # its next generation samples from NaN
        plain.train()
    assert not torch.isfinite(flat_params(plain.model)).all()
    hybrid = _online_run(tmp_path, "GRPO", mixin=True, max_steps=8)
    _not_finite_at_training_forward(hybrid, 3)
    with caplog.at_level("WARNING"):
        hybrid.train()
    assert "hf_hybrid: step 3: its loss is not finite: skipped the step; its batch is dropped." in caplog.text
    stats = hybrid.hybrid_stats()
    assert torch.isfinite(flat_params(hybrid.model)).all()
    assert stats["non_finite"] == stats["skipped_steps"] == 1 and stats["backward_steps"] == 9  # the step made up


class _TokenizesInTrainingStep(Trainer):
    """Builds each batch inside its own training_step from the texts the collator hands it, as TRL's online DPO
    generates from prompts there: the batch reaching training_step holds no tensor."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        ids = torch.tensor([[(len(text) + k) % 64 for k in range(16)] for text in inputs["text"]])
        return super().training_step(model, {"input_ids": ids, "labels": ids}, num_items_in_batch)


class _HybridTokenizesInTrainingStep(HybridMixin, _TokenizesInTrainingStep):
    pass


def _texts_run(tmp_path, trainer_class, **overrides):
    texts = Dataset.from_dict({"text": [f"line {i} " * (i % 7 + 1) for i in range(64)]})
    args = hybrid_args(tmp_path / trainer_class.__name__, max_steps=12, remove_unused_columns=False, **overrides)
    return trainer_class(model=tiny_gpt2(), args=args, train_dataset=texts,
                         data_collator=lambda rows: {"text": [row["text"] for row in rows]})


def test_batches_built_inside_training_step_stop_the_run_in_one_line_before_any_update(tmp_path):
    # The probes and the guard's re-run take the batch as it reaches training_step: here, texts they cannot take a
    # loss on. Unchecked, the run would fail at the autopilot's first reading, in GPT-2's forward.
    trainer = _texts_run(tmp_path, _HybridTokenizesInTrainingStep)
    before = flat_params(trainer.model).clone()
    with pytest.raises(ValueError) as info:
        trainer.train()
    message = str(info.value)
    assert "\n" not in message
    assert "_HybridTokenizesInTrainingStep's batches reach training_step with no tensor" in message
    assert "--hybrid_lr_autopilot false --hybrid_predict false --hybrid_guard false" in message
    assert torch.equal(flat_params(trainer.model), before)
    # With the flags it names, the run is the plain subclass's, bit for bit.
    off = dict(hybrid_lr_autopilot=False, hybrid_predict=False, hybrid_guard=False)
    weights = []
    for trainer_class, flags in ((_TokenizesInTrainingStep, {}), (_HybridTokenizesInTrainingStep, off)):
        run = _texts_run(tmp_path, trainer_class, **flags)
        run.train()
        weights.append(flat_params(run.model))
    assert torch.equal(*weights) and not torch.equal(weights[0], before)


# ---- any other Trainer subclass ------------------------------------------------------------------------


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
    ],
    ids=["no-trainable-params", "adam-predictor-with-sgd"],
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


def test_unsupported_setup_leaves_no_open_trace_file(tmp_path):
    trainer = make_trainer(tmp_path / "out", max_steps=3, hybrid_predictor="adam", optim="sgd")
    with pytest.raises(ValueError, match="velocity"):
        trainer.train()
    trace = trainer._hybrid_trace
    try:
        assert trace is None or trace.closed, "hybrid_trace.jsonl left open after a failed train()"
    finally:
        if trace is not None:
            trace.close()


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
