"""Shared fixtures: a tiny GPT-2 and a small learnable token dataset, all on the CPU."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under pytest-xdist each worker, and every process it launches, computes on one thread: two workers on two cores
# would otherwise each spin two.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

from datasets import Dataset  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

from hf_hybrid import HybridHFTrainer, HybridTrainingArguments  # noqa: E402

VOCAB = 64
BLOCK = 16


def tiny_gpt2(seed: int = 0, dropout: float = 0.0) -> GPT2LMHeadModel:
    """`dropout`: every forward draws masks from the RNG, which a replayed or resumed step must draw again alike."""
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=BLOCK, n_embd=32, n_layer=2, n_head=2, resid_pdrop=dropout,
                        embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def token_dataset(n: int = 512, seed: int = 0) -> Dataset:
    """Sequences that count up modulo a random stride: learnable, so the loss really falls."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, VOCAB, (n, 1), generator=g)
    strides = torch.randint(1, 4, (n, 1), generator=g)
    ids = (starts + strides * torch.arange(BLOCK)) % VOCAB
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})


# A schedule that makes a 40-step run predict several times; no payoff gate, a loose band (tests that need the
# gate or the band set them). The velocity predictor's multi-step Predict and Correct phases are what these tests
# exercise; the outer predictor sets its own schedule (tests/test_outer.py).
FAST_SCHEDULE = dict(
    hybrid_predictor="velocity",
    hybrid_warmup_steps=5,
    hybrid_full_steps=3,
    hybrid_max_predict_steps=4,
    hybrid_min_predict_steps=2,
    hybrid_correct_steps=1,
    hybrid_confidence_threshold=0.0,
    hybrid_payoff_check=False,
    hybrid_loss_band=50.0,
)


def hybrid_args(output_dir, **overrides) -> HybridTrainingArguments:
    values = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        max_steps=40,
        logging_steps=5,
        save_strategy="no",
        report_to="none",
        seed=0,
        data_seed=0,
        use_cpu=True,
        disable_tqdm=True,
        **FAST_SCHEDULE,
    )
    values.update(overrides)
    return HybridTrainingArguments(**values)


def make_trainer(output_dir, model=None, dataset=None, eval_dataset=None, **overrides) -> HybridHFTrainer:
    return HybridHFTrainer(
        model=model if model is not None else tiny_gpt2(),
        args=hybrid_args(output_dir, **overrides),
        train_dataset=dataset if dataset is not None else token_dataset(),
        eval_dataset=eval_dataset,
    )


def reject_every_jump(monkeypatch) -> None:
    """Every probe verdict sees an infinitely bad jump: each Predict phase ends in a rollback."""
    from hf_hybrid.jumps.payoff import PayoffMeter

    original_verdict = PayoffMeter.verdict
    monkeypatch.setattr(PayoffMeter, "verdict", lambda self, gain, noise: original_verdict(self, float("-inf")))


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


@pytest.fixture
def tmp_out(tmp_path):
    return tmp_path / "out"
