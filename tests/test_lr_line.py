"""The line the autopilot reads along Adam's next step (autopilot/line.py): its move, and the weights put back."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_hybrid.autopilot.line import SPACING, _move_along_next_step, _step_groups, next_step_line
from hf_hybrid.loop.forward_checks import probe_loss, probe_loss_by_sequence
from hf_hybrid.memory.snapshot import WeightSnapshot

from .conftest import make_trainer
from .test_equivalence_resume import assert_bit_identical, state
from .test_lr_advice import OUTER


def test_the_line_runs_along_adams_next_step_and_puts_the_weights_back(tmp_out):
    trainer = make_trainer(tmp_out, learning_rate=1e-3, lr_scheduler_type="constant", **{**OUTER, "max_steps": 12})
    trainer.train()
    model, engine, optimizer = trainer.model, trainer._hybrid, trainer.optimizer.optimizer
    probe = trainer._lr_autopilot.probe
    before = state(model)
    scratch = WeightSnapshot()
    losses, rows = next_step_line(trainer, model, engine.shards(), scratch, probe)
    f0, f1, f2 = (float(loss) for loss in losses)
    assert_bit_identical(state(model), before)
    assert not scratch.valid and not engine.jump_open
    assert f0 == float(probe_loss(trainer, model, probe)) and rows is None
    # Read by sequence (a reading that also judges a raise): the same line, and the rows the verdict would read at W.
    losses, rows = next_step_line(trainer, model, engine.shards(), scratch, probe, by_sequence=True)
    assert [float(loss) for loss in losses] == [f0, f1, f2]
    assert_bit_identical(state(model), before)
    assert torch.equal(rows, probe_loss_by_sequence(trainer, model, probe)[1])
    with torch.no_grad():  # 2 x SPACING of Adam's next step, weight decay aside, by its own formula
        for group in optimizer.param_groups:
            (beta1, beta2), lr = group["betas"], group["lr"]
            for p in group["params"]:
                s = optimizer.state[p]
                step = float(s["step"])
                m_hat, v_hat = s["exp_avg"] / (1 - beta1**step), s["exp_avg_sq"] / (1 - beta2**step)
                p -= 2 * SPACING * lr * m_hat / (v_hat.sqrt() + group["eps"])
    assert f2 == pytest.approx(float(probe_loss(trainer, model, probe)), abs=1e-5)
    assert f1 != f0 and f2 != f1


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _trained_adamw(layers: int, fused: bool) -> torch.optim.AdamW:
    """AdamW after three steps over `layers` linear layers in two parameter groups, one weight a step behind."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(layers)))
    weights, biases = [m.weight for m in model], [m.bias for m in model]
    optimizer = torch.optim.AdamW([{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0}],
                                  lr=1e-3, fused=fused)
    for _ in range(3):
        model(torch.randn(4, 16)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    optimizer.state[weights[0]]["step"] -= 1
    return optimizer


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("lists", [False, True])
def test_the_move_along_adams_next_step_is_the_per_parameter_formula_in_lists_whose_launches_do_not_grow(fused, lists):
    moved = {}
    for layers in (2, 20):
        optimizer = _trained_adamw(layers, fused)
        expected = []
        with torch.no_grad():  # Adam's next step, one parameter at a time, by its own formula
            for group in optimizer.param_groups:
                (beta1, beta2), lr = group["betas"], group["lr"]
                for p in group["params"]:
                    s = optimizer.state[p]
                    m_hat = s["exp_avg"] / (1 - beta1 ** s["step"])
                    denom = (s["exp_avg_sq"] / (1 - beta2 ** s["step"])).sqrt_().add_(group["eps"])
                    expected.append(p + m_hat.div_(denom).mul_(lr).mul_(-SPACING))
        step_groups = _step_groups(optimizer, lists)
        with _CountOps() as ops:
            _move_along_next_step(step_groups, SPACING)
        moved[layers] = ops.count
        params = [p for group in optimizer.param_groups for p in group["params"]]
        assert all(torch.equal(p, e) for p, e in zip(params, expected))
        # In lists (an accelerator's): the weights at two step counts, the biases at one; else one per parameter.
        assert len(step_groups) == (3 if lists else 2 * layers)
    assert (moved[20] == moved[2]) if lists else (moved[20] == 10 * moved[2])


class _Interrupted(Exception):
    pass


def test_a_reading_cut_off_between_its_forwards_puts_the_weights_back(tmp_out, monkeypatch):
    """Ctrl-C in a notebook, or an out-of-memory error, at the line's second point: the weights are the last step's,
    not W + c*step."""
    trainer = make_trainer(tmp_out, learning_rate=1e-3, lr_scheduler_type="constant", **{**OUTER, "max_steps": 12})
    trainer.train()
    model, engine = trainer.model, trainer._hybrid
    before, calls = state(model), []

    def cut_off(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise _Interrupted
        return probe_loss(*args, **kwargs)

    monkeypatch.setattr("hf_hybrid.autopilot.line.probe_loss", cut_off)
    scratch = WeightSnapshot()
    with pytest.raises(_Interrupted):
        next_step_line(trainer, model, engine.shards(), scratch, trainer._lr_autopilot.probe)
    assert len(calls) == 2  # it was cut off with the weights one move along the line
    assert_bit_identical(state(model), before)
    assert not scratch.valid


def test_auto_find_batch_size_trains_on_from_the_last_steps_weights_after_an_oom_in_a_reading(tmp_out, monkeypatch):
    """The Trainer catches an out-of-memory error, cuts the batch and starts its loop again from the model as it
    stands: a reading cut off by one must leave that model where the last step left it."""
    from transformers import TrainerCallback

    starts, at_reading = [], []

    class Starts(TrainerCallback):
        def on_train_begin(self, args, state_, control, model=None, **kwargs):
            starts.append(state(model))

    def out_of_memory_once(trainer, model, probe, *args, **kwargs):
        if not at_reading:  # the reading's first forward, at the weights the last step made
            at_reading.append(state(model))
        elif len(at_reading) == 1:
            at_reading.append(None)
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes.")
        return probe_loss(trainer, model, probe, *args, **kwargs)

    monkeypatch.setattr("hf_hybrid.autopilot.line.probe_loss", out_of_memory_once)
    trainer = make_trainer(tmp_out, learning_rate=1e-3, auto_find_batch_size=True, **{**OUTER, "max_steps": 30})
    trainer.add_callback(Starts())
    trainer.train()
    assert len(starts) == 2 and trainer._train_batch_size < 8  # the Trainer cut the batch and started again
    assert_bit_identical(starts[1], at_reading[0])
    assert trainer.state.global_step >= 30
