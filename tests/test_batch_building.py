"""Trainers that build their batches: TRL's GRPO and RLOO generate them in `_prepare_inputs`, which the hybrid's probes
would call again, so they run with the non-finite veto alone; a trainer that builds them inside `training_step` stops
at its first step in one line."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from datasets import Dataset
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
)

from hf_hybrid import HybridMixin, HybridTrainingArguments

from .conftest import flat_params, hybrid_args, tiny_gpt2


def _online_run(tmp_path, kind: str, mixin: bool, **overrides):
    """A tiny GPT-2 through TRL's GRPO, RLOO or (on-policy) distillation trainer, which generate their completions in
    `_prepare_inputs`, as TRL's own class or with the mixin (its config paired as `HybridSFTConfig` pairs SFT's)."""
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
    settings = dict(output_dir=str(tmp_path / f"{kind}-{mixin}"), per_device_train_batch_size=4,
                    max_completion_length=6, max_steps=4, save_strategy="no", report_to="none", use_cpu=True,
                    disable_tqdm=True, seed=0, bf16=False, learning_rate=1e-3)
    prompts = Dataset.from_list([{"prompt": f"{s} sat on"} for s in ("the cat", "the dog", "a king", "a fool")] * 4)
    if kind == "Distillation":  # a teacher of the same shape, initialized apart
        torch.manual_seed(1)
        teacher = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=32, n_embd=16, n_layer=1, n_head=2))
        return trainer_class(model=model, teacher_model=teacher, args=config_class(**{**settings, **overrides}),
                             train_dataset=prompts, processing_class=tokenizer)
    settings.update(num_generations=4, beta=0.0)  # beta 0: no reference model to load
    return trainer_class(model=model, reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
                         args=config_class(**{**settings, **overrides}), train_dataset=prompts,
                         processing_class=tokenizer)


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


@pytest.mark.parametrize("kind", ["GRPO", "RLOO", "Distillation"])
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
