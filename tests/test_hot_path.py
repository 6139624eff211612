"""The hybrid adds at most one device-to-host read to a real step: the rank-averaged loss and gradient norm that the
engine and the guard decide on; and two more to a step that ends with a reading of the learning-rate autopilot (one
in 10 or more real steps): the optimizer's step counts and its three probe losses, and on a learning-rate trial's
verdict two more; the first reading past step 10 also reads the first steps' alignment. Counted by patching every
way a tensor reaches the host. The operators it adds to a real step (each a kernel launch on a GPU) are a few, whatever
the model's size: counted by a dispatch mode."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback

from hf_hybrid import Phase

from .conftest import BLOCK, VOCAB, hybrid_args, make_trainer, tiny_gpt2, token_dataset

HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy")


class ReadsPerStep(TrainerCallback):
    """Host reads between one step's end and the next, with the step's phase (None for the plain Trainer), whether
    it ended with an autopilot reading, and whether a learning-rate raise was on trial at its end."""

    def __init__(self, counter: list[int]) -> None:
        self.counter, self.trainer, self.rows = counter, None, []

    def on_step_end(self, args, state, control, **kwargs):
        engine = getattr(self.trainer, "_hybrid", None)
        autopilot = getattr(self.trainer, "_lr_autopilot", None)
        reading = autopilot is not None and autopilot.last_line is not None
        trial = autopilot is not None and autopilot.scale.on_trial
        self.rows.append((engine.last_record.phase if engine is not None else None, self.counter[0], reading, trial))
        self.counter[0] = 0


@pytest.fixture
def counter(monkeypatch):
    count = [0]
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            count[0] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return count


def reads(trainer, counter) -> list[tuple]:
    recorder = ReadsPerStep(counter)
    recorder.trainer = trainer
    trainer.add_callback(recorder)
    trainer.train()
    return recorder.rows[1:]  # the first step also pays for the run's setup


def test_a_real_step_makes_at_most_one_host_read_more_than_the_trainers(tmp_path, counter, monkeypatch):
    # The tiny model reads aligned here (0.09-0.17 from 1e-4 to 3e-3; autopilot/alignment.py): a trial would start.
    monkeypatch.setattr("hf_hybrid.autopilot.alignment.ALIGNED", float("inf"))
    common = dict(max_steps=40, logging_steps=1000, max_grad_norm=1.0)
    plain_args = hybrid_args(tmp_path / "plain", **common)
    plain = Trainer(model=tiny_gpt2(), args=plain_args, train_dataset=token_dataset())
    plain_reads = {n for _, n, _, _ in reads(plain, counter)}
    # The library's defaults (outer predictor, guard) on a short schedule, so that jumps and snapshots happen.
    hybrid = make_trainer(tmp_path / "hybrid", hybrid_predictor="outer", hybrid_outer_period=5,
                          hybrid_guard_window=16, hybrid_guard_snapshot_steps=5, hybrid_payoff_check=True, **common)
    rows = reads(hybrid, counter)
    real = [n for phase, n, reading, _ in rows if phase is not Phase.PREDICT and not reading]
    readings = [n for phase, n, reading, _ in rows if reading]
    assert len(plain_reads) == 1 and len(real) > 20 and len(real) + len(readings) < len(rows)
    plain_count = plain_reads.pop()
    assert max(real) <= plain_count + 1, real
    # A reading: the library's read of the optimizer's step counts (one bias correction per count) and one of its
    # three probe losses, and transformers' own read in each of its three forwards (the packed-sequence check of the
    # causal mask, which the Trainer's forward makes too); and once, at the first reading past step 10, the first
    # steps' alignment, summed on the device until then.
    assert 1 <= len(readings) <= 4 and max(readings) <= plain_count + 3 + 3 + 1, readings
    assert sum(n > plain_count + 3 + 3 for n in readings) <= 1, readings


def test_a_learning_rate_trial_adds_no_host_read_to_its_real_steps(tmp_path, counter, monkeypatch):
    """A raise's trial: its real steps read no more than any real step, and the reading that judges it adds only its
    verdict's forwards."""
    # Every reading that reads a line at all, with the loss falling, asks for the largest raise.
    monkeypatch.setattr("hf_hybrid.autopilot.scale.RAISE_REACH", 0.0)
    monkeypatch.setattr("hf_hybrid.autopilot.scale.TARGET_REACH", 1e-6)
    common = dict(max_steps=60, logging_steps=1000, max_grad_norm=1.0, learning_rate=3e-4)
    plain = Trainer(model=tiny_gpt2(), args=hybrid_args(tmp_path / "plain", **common), train_dataset=token_dataset())
    plain_count = max(n for _, n, _, _ in reads(plain, counter))
    hybrid = make_trainer(tmp_path / "hybrid", hybrid_predictor="outer", hybrid_outer_period=5, **common)
    rows = reads(hybrid, counter)
    stats = hybrid.hybrid_stats()
    assert stats["lr_raises_kept"] + stats["lr_trials_undone"] >= 1, stats
    on_trial = [n for phase, n, reading, trial in rows if trial and not reading and phase is not Phase.PREDICT]
    assert on_trial and max(on_trial) <= plain_count + 1, on_trial
    verdicts = [n for (_, _, _, before), (_, n, reading, _) in zip(rows, rows[1:]) if before and reading]
    # A reading's own (see above), then the verdict's: transformers' read in each of its two forwards (at the raised
    # weights and where the user's LR would have taken them), the library's read of the gain and one of its noise.
    assert verdicts and max(verdicts) <= plain_count + 3 + 3 + 2 + 2, verdicts


class CountedOps(TorchDispatchMode):
    """Every operator PyTorch dispatches: on a GPU each is a kernel launch or a copy, paid for in host time."""

    def __init__(self) -> None:
        super().__init__()
        self.count = [0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[0] += 1
        return func(*args, **(kwargs or {}))


def gpt2_of_depth(layers: int) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=BLOCK, n_embd=32, n_layer=layers, n_head=2,
                                      bos_token_id=0, eos_token_id=0))


def ops_per_step(trainer) -> list[tuple]:
    ops = CountedOps()
    with ops:
        return reads(trainer, ops.count)


@pytest.mark.parametrize("layers", [2, 8])
def test_the_operators_a_real_step_adds_do_not_grow_with_the_model(tmp_path, layers):
    """A loop over the parameters on the hot path would cost a kernel launch per parameter per step on a GPU (148 at
    GPT-2 124M). Once the first cycle has made its buffers (one tensor at a time, once per run), every real step adds
    the same few operators to the Trainer's at any depth: cycle starts and guard snapshots copy in one multi-tensor
    call here, on one device (on a GPU the copies to pinned memory go a tensor at a time, once per outer period). An
    autopilot reading (three forwards and two moves along the optimizer's step, one in 10 or more real steps) is the
    exception."""
    common = dict(max_steps=40, logging_steps=1000, max_grad_norm=1.0)
    plain = Trainer(model=gpt2_of_depth(layers), args=hybrid_args(tmp_path / "plain", **common),
                    train_dataset=token_dataset())
    plain_ops = {n for _, n, _, _ in ops_per_step(plain)}
    hybrid = make_trainer(tmp_path / "hybrid", model=gpt2_of_depth(layers), hybrid_predictor="outer",
                          hybrid_outer_period=5, hybrid_guard_window=16, hybrid_guard_snapshot_steps=5, **common)
    rows = ops_per_step(hybrid)
    first_jump = next(i for i, (phase, _, _, _) in enumerate(rows) if phase is Phase.PREDICT)
    assert len(plain_ops) == 1
    plain_count = plain_ops.pop()
    added = [n - plain_count for phase, n, reading, _ in rows[first_jump:]
             if phase is not Phase.PREDICT and not reading]
    stats = hybrid.hybrid_stats()
    assert len(added) > 20 and stats["predict_steps"] >= 4 and stats["guard_outliers"] == 0, stats
    assert max(added) <= 12, added


def test_under_torch_compile_the_side_forwards_compile_the_model_no_second_time(tmp_path):
    """A compiled model's graphs are guarded on the grad mode and on the call's keyword arguments: the readings', the
    verdicts' and the Predict steps' forwards call the model as a training step does (grad enabled, the probe's
    `num_items_in_batch`) instead of compiling its forward a second time. Dynamo's own recompile log, with its `eager`
    backend for speed: the guards are the same."""
    import logging

    from .test_lr_advice import OUTER

    reasons = []

    class Recompiles(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            reasons.append(record.getMessage())

    torch._dynamo.reset()
    torch._logging.set_logs(recompiles=True)
    handler, dynamo_logger = Recompiles(), logging.getLogger("torch._dynamo")
    dynamo_logger.addHandler(handler)
    try:
        trainer = make_trainer(tmp_path, learning_rate=1e-3, torch_compile=True, torch_compile_backend="eager",
                               **{**OUTER, "max_steps": 40})
        trainer.train()
        in_training = list(reasons)
        with torch.no_grad():  # a forward that differs from a training step's is logged as a recompile
            trainer.model_wrapped(input_ids=torch.tensor(token_dataset(8)[:]["input_ids"]))
    finally:
        dynamo_logger.removeHandler(handler)
        torch._logging.set_logs()
        torch._dynamo.reset()
    stats = trainer.hybrid_stats()
    # Readings, a raise's verdict and jumps' Predict steps all ran.
    assert stats["lr_readings"] >= 2 and stats["lr_raises_kept"] >= 1 and stats["predict_steps"] >= 1, stats
    assert in_training == [] and any("grad_mode" in r for r in reasons), reasons
