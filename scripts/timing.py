"""Timing instrumentation of one benchmark arm, inside the arm's process: training seconds per step with evaluation
excluded, forward / backward / optimizer seconds, the hybrid's per-step hook seconds, and the CUDA peak-memory curve.
On a GPU every clock reading waits for the queued kernels first, so that each interval holds its own work."""

from __future__ import annotations

import functools
import time

import torch
from transformers import TrainerCallback

MEMORY_SAMPLE_EVERY = 100  # steps between samples of the CUDA peak-memory curve
HOOK_CLOCKS = ("hybrid_hooks_real", "hybrid_hooks_predict", "guard")  # time_hybrid_hooks' clocks


def tick(cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter()


def spent_updates(trainer) -> int:
    """Gradient updates spent so far: the optimizer steps that ran a backward, those an undo threw away included (a
    predicted step runs none)."""
    engine = getattr(trainer, "_hybrid", None)
    return trainer.hybrid_stats()["backward_steps"] if engine is not None else trainer.state.global_step


class TrainingClock(TrainerCallback):
    """Training time, stopped during evaluation, per optimizer step and in all; records each evaluation on that
    clock, notes when eval loss first reaches `target`, and with `stop_at_target` ends the run there."""

    def __init__(self, trainer, result, target: float | None, stop_at_target: bool, cuda: bool) -> None:
        self.trainer, self.result, self.cuda = trainer, result, cuda
        self.target, self.stop_at_target = target, stop_at_target
        self.t0 = self.paused = self.last_end = self.step_begin = self.clocked = 0.0

    @property
    def train_seconds(self) -> float:
        return self.last_end - self.t0 - self.paused

    def on_train_begin(self, args, state, control, **kwargs):
        self.t0 = self.last_end = time.perf_counter()

    def on_step_begin(self, args, state, control, **kwargs):
        self.step_begin = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        now = tick(self.cuda)
        result = self.result
        result.step_seconds.append(now - self.step_begin)
        clocked = sum(result.timing.get(key, 0.0) for key in HOOK_CLOCKS)
        if clocked:  # where the hooks are timed: this step's share of their clocks (its end_step hook ran before this)
            result.hook_seconds.append(clocked - self.clocked)
            self.clocked = clocked
        engine = getattr(self.trainer, "_hybrid", None)
        result.phases.append(engine.last_record.phase.value if engine is not None else "full")
        if self.cuda and state.global_step % MEMORY_SAMPLE_EVERY == 0:
            result.memory_curve.append([state.global_step, torch.cuda.max_memory_allocated() / 2**20,
                                        torch.cuda.memory_reserved() / 2**20])
        self.last_end = now

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        # Evaluation is not training: stop the clock for it (it ran since the last step ended).
        result = self.result
        loss = metrics["eval_loss"]
        result.evals.append([state.global_step, self.train_seconds, loss, spent_updates(self.trainer)])
        now = time.perf_counter()
        self.paused += now - self.last_end
        self.last_end = now
        print(f"  [{result.arm:>8}] step {state.global_step:4d}, eval loss {loss:.4f}, "
              f"{result.evals[-1][1]:6.1f}s of training", flush=True)
        if self.target is not None and loss <= self.target and result.reached_step is None:
            result.reached_step = state.global_step
            if self.stop_at_target:
                control.should_training_stop = True


def timed_trainer(trainer_cls: type, name: str, result, cuda: bool) -> type:
    """`trainer_cls`, adding its forward and backward seconds to `result.timing` (a predicted step has no
    backward)."""

    class Timed(trainer_cls):
        def compute_loss(self, model, *args, **kwargs):
            if not model.training:  # evaluation
                return super().compute_loss(model, *args, **kwargs)
            t = tick(cuda)
            out = super().compute_loss(model, *args, **kwargs)
            self._fwd = tick(cuda) - t
            result.timing["forward"] = result.timing.get("forward", 0.0) + self._fwd
            return out

        def training_step(self, *args, **kwargs):
            t = tick(cuda)
            self._fwd = 0.0
            out = super().training_step(*args, **kwargs)
            engine = getattr(self, "_hybrid", None)
            if engine is None or engine.phase.value != "predict":
                result.timing["backward"] = result.timing.get("backward", 0.0) + tick(cuda) - t - self._fwd
            return out

    Timed.__name__ = Timed.__qualname__ = name
    return Timed


class OptimizerClockStart(TrainerCallback):
    def __init__(self, cuda: bool) -> None:
        self.cuda, self.started = cuda, 0.0

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.started = tick(self.cuda)


class OptimizerClockStop(TrainerCallback):
    def __init__(self, start: OptimizerClockStart, result) -> None:
        self.start, self.result = start, result

    def on_optimizer_step(self, args, state, control, **kwargs):
        elapsed = tick(self.start.cuda) - self.start.started
        self.result.timing["optimizer"] = self.result.timing.get("optimizer", 0.0) + elapsed


def add_optimizer_clock(trainer, result, cuda: bool) -> None:
    """Adds the optimizer seconds to `result.timing`; call it after adding the other callbacks. Two callbacks, so
    that the clock starts after every other pre-step callback and stops before every other post-step one: the
    hybrid's hooks on either side of the optimizer step count as hooks, not optimizer time."""
    start = OptimizerClockStart(cuda)
    trainer.add_callback(start)
    trainer.callback_handler.callbacks.insert(0, OptimizerClockStop(start, result))


def idle_synchronize_seconds(repeats: int = 200) -> float:
    """The median time of one `torch.cuda.synchronize` with nothing queued: what each synchronized hook clock adds to
    the hook it times, however little device work the hook launched."""
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - t)
    return sorted(samples)[len(samples) // 2]


def time_hybrid_hooks(result, cuda: bool) -> None:
    """Seconds spent in the engine's per-step work, split by real and predicted steps: the hybrid's overhead,
    measured inside one run rather than as a difference of two noisy runs. On a predicted step it includes
    applying the delta. On a GPU each hook's clock waits for the queued kernels before it starts and after the hook
    returns; `<key>_host` holds the part before that second wait (the host's own work, which on a step bound by the
    host is the hook's cost), `<key>_calls` the number of clocked calls, and `idle_synchronize` what one wait costs
    with nothing queued."""
    from hf_hybrid.guard.runner import GuardAtLoop
    from hf_hybrid.jumps.engine import HybridEngine

    if cuda:
        result.timing["idle_synchronize"] = idle_synchronize_seconds()

    def timed(method, key_of):
        @functools.wraps(method)
        def wrapper(self, *args, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            out = method(self, *args, **kwargs)
            host = time.perf_counter() - t
            if cuda:
                torch.cuda.synchronize()
            key = key_of(self)
            timing = result.timing
            timing[key] = timing.get(key, 0.0) + time.perf_counter() - t
            timing[key + "_host"] = timing.get(key + "_host", 0.0) + host
            timing[key + "_calls"] = timing.get(key + "_calls", 0) + 1
            return out

        return wrapper

    def engine_key(engine) -> str:
        record = engine.record if engine.record is not None else engine.last_record
        return "hybrid_hooks_predict" if record.phase.value == "predict" else "hybrid_hooks_real"

    for name in ("begin_step", "check_predict_step", "check_real_step", "start_cycle", "before_optimizer_step",
                 "after_optimizer_step", "end_step"):
        setattr(HybridEngine, name, timed(getattr(HybridEngine, name), engine_key))
    # The guard's verdict and its snapshot happen at the Trainer's loop, on real steps only.
    GuardAtLoop.vetoes = timed(GuardAtLoop.vetoes, lambda loop: "guard")
    GuardAtLoop.accepted = timed(GuardAtLoop.accepted, lambda loop: "guard")
