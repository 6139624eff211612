"""`HybridHFTrainer`: the Hugging Face `Trainer` with hybrid predictive training.

Thin glue. Each override below exists for one reason:
- `get_batch_samples`: a rolled-back jump's batches were never trained on; they are handed out again
  before fresh ones, so the run keeps the Trainer's data order (replay.py);
- `training_step`: a Predict step must run no backward (only a no-grad forward to check the loss),
  and its predicted delta is applied at the first micro-batch of the optimizer step;
- `_clip_grad_norm` / `_get_grad_norm`: the Trainer calls them on every optimizer step; on a step with
  no backward they must not touch the gradients (or the fp16 GradScaler's unscale bookkeeping), and on
  a real step the gradient norm is where a NaN or an explosion is caught before the optimizer runs;
- `_save_optimizer_and_scheduler` / `_load_optimizer_and_scheduler`: they run on every rank, so the
  hybrid state (including per-rank tensors) is saved and restored beside the optimizer's;
- `log`: to merge the `hybrid/...` metrics into the Trainer's logs, so every `report_to` gets them;
- `train`: a run the guard stopped raises `GuardStoppedError` once the Trainer has finished its bookkeeping.
The optimizer step itself is vetoed through accelerate's public `sync_gradients` flag:
`AcceleratedOptimizer.step` does nothing while it is False. The other loop points come through a
callback placed first in line: at the end of a rolled-back step it rewinds the learning-rate schedule
and adds the undone steps to `state.max_steps`, before `DefaultFlowCallback` decides whether to stop.

The guard (guard.py) judges every real step where its gradient norm is taken, from the same reduced numbers as the
engine; what it decides is carried out at the step's end, after the Trainer stepped the schedule.
"""

from __future__ import annotations

import copy
import json
import math
import os
import pickle
import time

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import ProgressCallback
from transformers.utils import logging

from .config import hybrid_settings
from .controller import Phase
from .engine import HybridEngine
from .guard import Action, GuardEvent, StepGuard
from .memory import EmergencyCheckpointCallback, VramMonitor
from .replay import move_unit
from .snapshot import TrainingSnapshot

HYBRID_STATE_NAME = "hybrid_state_rank{rank}.pt"
TRACE_NAME = "hybrid_trace.jsonl"

logger = logging.get_logger(__name__)


class GuardStoppedError(RuntimeError):
    """The guard stopped training: a rollback was needed after too many, or with no snapshot to go back to."""


class _HybridStepHooks(TrainerCallback):
    """Forwards the loop points that have no overridable method to the trainer."""

    def __init__(self, trainer: HybridMixin) -> None:
        self.trainer = trainer

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        self.trainer._hybrid_train_begin(train_dataloader)

    def on_epoch_begin(self, args, state, control, **kwargs):
        if self.trainer._hybrid is not None:  # just before the Trainer makes the epoch's DataLoader iterator
            self.trainer._hybrid.epoch_seed.epoch_begins()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.trainer._hybrid_before_optimizer_step()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.trainer._hybrid_after_optimizer_step()

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer._hybrid_end_step(control)

    def on_train_end(self, args, state, control, **kwargs):
        self.trainer._hybrid_train_end()


class HybridMixin:
    """Adds hybrid phases to a `transformers.Trainer` subclass: `class X(HybridMixin, SomeTrainer)`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.hybrid_settings = hybrid_settings(self.args)
        self._hybrid: HybridEngine | None = None
        self._hybrid_pending_state: dict | None = None
        self._hybrid_trace = None
        self._hybrid_window_loss: torch.Tensor | None = None
        self._hybrid_last_step: int | None = None  # the last step the Trainer's epochs can reach (None: no limit)
        self._hybrid_last_loss: torch.Tensor | None = None
        self._guard: StepGuard | None = None
        self._guard_snapshot: TrainingSnapshot | None = None
        self._guard_inputs: list[dict] = []  # the micro-batches of the real step under way
        self._guard_reference: list[dict] | None = None  # the last accepted step's: bad weights or bad data?
        self._guard_pending: tuple | None = None  # (event, scaler state) until the step's end
        self._hybrid_skip_schedule: dict | None = None  # the schedule before a vetoed real step, given back at its end
        self._guard_stop: str | None = None
        self._hybrid_t0 = time.perf_counter()
        self._vram = VramMonitor() if self.hybrid_settings.hybrid else None
        if not self.hybrid_settings.hybrid:
            return
        self._check_launch_mode()
        # First in line: a rollback extends max_steps at the step's end, before DefaultFlowCallback decides to stop.
        self.callback_handler.callbacks.insert(0, _HybridStepHooks(self))
        # Registered on every rank alike (it all-reduces): not on this rank's NVML reading, which may fail alone.
        if self.hybrid_settings.hybrid_vram_min_free_mb > 0 and torch.cuda.is_available():
            self.add_callback(EmergencyCheckpointCallback(self._vram, self.hybrid_settings.hybrid_vram_min_free_mb))

    def _check_launch_mode(self) -> None:
        if self.is_deepspeed_enabled:
            config = (
                self.args.deepspeed or os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or "the accelerate config"
            )
            raise ValueError(
                f"hf_hybrid does not support DeepSpeed yet (config: {config}): DeepSpeed owns the optimizer step and "
                "the fp32 master weights, so a predicted delta would be silently overwritten. Launch with DDP or "
                "FSDP2 (recipes/accelerate/), or pass --hybrid false."
            )
        # `accelerate launch` with an FSDP config sets ACCELERATE_USE_FSDP rather than --fsdp; on CPU it then runs DDP.
        fsdp_requested = bool(self.args.fsdp) or os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true")
        if fsdp_requested and not self.is_fsdp_enabled:
            logger.warning(
                "FSDP was requested but accelerate is not running FSDP (on CPU it falls back to DDP); "
                "hf_hybrid will treat parameters as full, replicated tensors."
            )

    # ---- public -----------------------------------------------------------------------------------

    def hybrid_stats(self) -> dict:
        """Optimizer steps per phase, backward reduction, rollbacks and divergences so far."""
        if self._hybrid is not None:
            return {**self._hybrid.stats(), **(self._guard or StepGuard()).stats()}
        steps = self.state.global_step
        return {
            "phase_steps": {p.value: (steps if p is Phase.FULL else 0) for p in Phase},
            "backward_steps": steps,
            "predict_steps": 0,
            "backward_reduction": 0.0,
            "rollbacks": 0,
            "retired": False,
            "divergences": 0,
            "non_finite": 0,
            "skipped_steps": 0,
            "undone_steps": 0,
            "predictions_judged": 0,
            "predictions_kept": 0,
            **StepGuard().stats(),
        }

    # ---- the step ---------------------------------------------------------------------------------

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        fresh = super().get_batch_samples(epoch_iterator, num_batches, device)
        return self._hybrid.next_batches(fresh) if self._hybrid is not None else fresh

    def training_step(self, model, inputs, num_items_in_batch=None):
        engine = self._hybrid
        if engine is None:
            return super().training_step(model, inputs, num_items_in_batch)
        first_micro_batch = engine.record is None
        if first_micro_batch:
            engine.begin_step(self.state.global_step)
            if engine.starts_prediction:
                engine.schedule_at_jump = self._hybrid_schedule_state()
            self._hybrid_window_loss = torch.zeros((), device=self.args.device)
        if engine.phase is not Phase.PREDICT:
            self._guard_inputs = [inputs] if first_micro_batch else [*self._guard_inputs, inputs]
            loss = super().training_step(model, inputs, num_items_in_batch)
            self._hybrid_window_loss += loss.detach().float()
            return loss
        if first_micro_batch:
            if engine.starts_prediction and self.hybrid_settings.hybrid_payoff_check:
                probe = self._prepare_inputs(inputs)
                engine.set_probe(probe, self._hybrid_reduce(self._probe_loss(model, probe))[0])
            engine.apply_prediction(self._hybrid_lr())
        loss = self._predict_micro_batch(model, inputs, num_items_in_batch, engine.monitored)
        self._hybrid_window_loss += loss.detach().float()
        if self.accelerator.sync_gradients:  # the last micro-batch of this optimizer step
            monitored_loss = self._hybrid_reduce(self._hybrid_window_loss)[0] if engine.monitored else None
            engine.check_predict_step(monitored_loss)
            # The run's last step judges an open jump early, so that a rejected one is made up like any other.
            last_step = self.state.global_step + 1 >= self.state.max_steps
            if (engine.ends_prediction or last_step) and engine.probe is not None:
                engine.judge_probe(self._hybrid_reduce(self._probe_loss(model, engine.probe))[0])
            self._hybrid_veto_optimizer_step()
        return loss

    def _predict_micro_batch(self, model, inputs, num_items_in_batch, monitored: bool) -> torch.Tensor:
        """No backward: a no-grad forward to check the loss, or nothing at all on an unmonitored step."""
        if not monitored:
            # The Trainer only sums this for its loss log; repeat the last checked loss rather than log a 0.
            if self._hybrid_last_loss is None:
                return torch.zeros((), device=self.args.device)
            return self._hybrid_last_loss
        model.train()
        inputs = self._prepare_inputs(inputs)
        # A forked RNG: the check's dropout masks must not shift the real steps' ones, or a rolled-back jump
        # would leave a trace in the training that follows.
        with self._forked_rng(), torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        scaled = getattr(self, "loss_is_scaled_for_ga", None)  # absent from older transformers (5.17)
        if scaled is None:  # the same rule as Trainer.training_step
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or (
                self.compute_loss_func is not None
            )
        if not scaled:
            loss = loss / self.current_gradient_accumulation_steps
        self._hybrid_last_loss = loss.detach()
        return self._hybrid_last_loss

    def _probe_loss(self, model, probe: dict) -> torch.Tensor:
        """Mean loss of the probe batch at the current weights, with the same dropout masks every time (a fixed
        seed in a forked RNG, which leaves the training RNG untouched), so before and after are truly paired."""
        model.train()
        with self._forked_rng(), torch.no_grad(), self.compute_loss_context_manager():
            torch.manual_seed(self.args.seed)
            return self.compute_loss(model, probe).detach()

    def _forked_rng(self):
        devices = [self.args.device] if self.args.device.type == "cuda" else []
        return torch.random.fork_rng(devices=devices)

    def _clip_grad_norm(self, model):
        if self._hybrid_step_has_no_backward():
            return None
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model, grad_norm=None):
        if self._hybrid_step_has_no_backward():
            return None
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        engine = self._hybrid
        if engine is None or engine.record is None:
            return grad_norm
        loss, norm = self._hybrid_reduce(self._hybrid_window_loss, grad_norm)
        if self._guard_vetoes(model, loss, norm) or engine.check_real_step(loss, norm, self._hybrid_lr()):
            self._hybrid_skip_schedule = self._hybrid_schedule_state()
            self._hybrid_veto_optimizer_step()
        return grad_norm

    def _guard_vetoes(self, model, loss: float, grad_norm: float | None) -> bool:
        """The guard's verdict on a real step; a flagged step is vetoed now and dealt with at the step's end."""
        guard, engine = self._guard, self._hybrid
        if guard is None:
            return False
        step = self.state.global_step
        event = guard.check(step + 1, loss, grad_norm)
        jump_open = engine.snapshot.valid
        if event is None:
            self._guard_reference = self._guard_inputs
            snapshot = self._guard_snapshot
            every = self.hybrid_settings.hybrid_guard_snapshot_steps
            due = every and (not snapshot.valid or step - snapshot.step >= every)
            # Never inside a jump: the engine may still reject it, and a snapshot would bring it back. Not before the
            # optimizer has state either: AdamW creates it at its first step, and a resumed run has it from the start.
            if due and not jump_open and engine.optimizer.state:
                snapshot.capture(step, engine.made_up_steps, engine.params, engine.optimizer,
                                 self._hybrid_schedule_state())
            return False
        if jump_open:
            event.action = Action.SKIP  # the engine rolls the jump back, to weights known to be good
        elif event.action is Action.SKIP and self._guard_reference is not None:
            guard.judge_weights(event, *self._hybrid_reduce(*self._guard_reference_signals(model)))
        guard.escalate(event, has_snapshot=self._guard_snapshot.valid)
        engine.record.loss = loss
        non_finite = not math.isfinite(loss) or (grad_norm is not None and not math.isfinite(grad_norm))
        engine.skip_step(non_finite)
        scaler = self.accelerator.scaler
        # A finite outlier leaves the fp16 loss scale alone; an overflow lowers it, as the scaler would anyway.
        scaler_state = scaler.state_dict() if scaler is not None and not non_finite else None
        self._guard_pending = (event, scaler_state)
        return True

    def _hybrid_step_has_no_backward(self) -> bool:
        engine = self._hybrid
        return engine is not None and engine.record is not None and engine.phase is Phase.PREDICT

    def _hybrid_veto_optimizer_step(self) -> None:
        scaler = self.accelerator.scaler
        if scaler is not None and self._hybrid.phase is not Phase.PREDICT:
            # The gradients were already unscaled (clipping or the norm): leaving the step to the scaler with
            # an inf recorded skips it and lowers the scale, which keeps GradScaler's bookkeeping consistent.
            for state in scaler._per_optimizer_states.values():
                for found_inf in state.get("found_inf_per_device", {}).values():
                    found_inf.fill_(1.0)
            return
        self.accelerator.gradient_state._set_sync_gradients(False)

    def _hybrid_before_optimizer_step(self) -> None:
        record = self._hybrid.record if self._hybrid is not None else None
        if record is not None and record.phase.has_backward and self.accelerator.sync_gradients:
            self._hybrid.before_optimizer_step(self._hybrid_lr())

    def _hybrid_after_optimizer_step(self) -> None:
        record = self._hybrid.record if self._hybrid is not None else None
        stepped = self.accelerator.sync_gradients and not self.accelerator.optimizer_step_was_skipped
        if record is not None and record.phase.has_backward and not (record.skipped or record.rollback) and stepped:
            self._hybrid.after_optimizer_step(self._hybrid_lr())

    def _hybrid_end_step(self, control) -> None:
        engine = self._hybrid
        if engine is None or engine.record is None:
            return
        record = engine.record
        if record.rollback:
            self._hybrid_make_up(record.undone_steps, engine.schedule_at_jump)
        elif record.skipped:  # a vetoed real step (a NaN, the guard): it neither counts nor advances the schedule
            self._hybrid_make_up(1, self._hybrid_skip_schedule)
        guard_action = None
        if self._guard_pending is not None:
            event, scaler_state = self._guard_pending
            self._guard_pending = None
            if scaler_state is not None:
                self.accelerator.scaler.load_state_dict(scaler_state)
            self._guard_act(event, control)
            guard_action = event.action.value
        next_phase = engine.end_step()
        if self._hybrid_trace is not None:
            self._hybrid_trace.write(
                json.dumps(
                    {
                        "step": self.state.global_step,
                        "phase": record.phase.value,
                        "loss": record.loss,
                        "time": time.perf_counter() - self._hybrid_t0,
                        "confidence": engine.confidence,
                        "prediction_error": engine.predictor.last_residual,
                        "rollback": record.rollback,
                        "guard": guard_action,
                    }
                )
                + "\n"
            )
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, ProgressCallback) and callback.training_bar is not None:
                callback.training_bar.set_postfix(phase=next_phase.value, refresh=False)

    def _hybrid_make_up(self, steps: int, schedule: dict | None) -> None:
        """A rollback undid `steps` optimizer steps: they are trained again (their batches are replayed), so they
        must not count. The schedule goes back to where the jump began and the run gets `steps` more, so that with
        every jump rejected it ends where the Trainer's run ends, at the same learning rate."""
        if schedule is not None:
            self.lr_scheduler.load_state_dict(schedule["scheduler"])
            for group, saved in zip(self.optimizer.param_groups, schedule["groups"]):
                for key, value in saved.items():
                    if isinstance(group[key], torch.Tensor):  # a fused or capturable optimizer's device tensor
                        group[key].copy_(value)
                    else:
                        group[key] = value
        self._hybrid_extend_max_steps(steps)

    def _guard_reference_signals(self, model) -> tuple[torch.Tensor, torch.Tensor]:
        """Loss and gradient norm of the last accepted step's batches at the current weights, over its whole
        accumulation window as the guard saw the flagged step's: would they be flagged too? One step's forward and
        backward, only on a flagged step, whose update is vetoed anyway (so its gradients may be overwritten).
        Unscaled: the fp16 loss scale is not involved."""
        model.train()
        model.zero_grad()
        total = torch.zeros((), device=self.args.device)
        with self._forked_rng():
            torch.manual_seed(self.args.seed)
            for inputs in self._guard_reference:
                with self.compute_loss_context_manager():
                    loss = self.compute_loss(model, self._prepare_inputs(inputs)) / len(self._guard_reference)
                loss.backward()
                total += loss.detach().float()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        return total, torch.nn.utils.get_total_norm(grads)

    def _guard_act(self, event: GuardEvent, control) -> None:
        """Carry out a flagged step's verdict: the skip is done (vetoed, made up); a rollback or a stop puts the last
        snapshot back and drops the batches since it. Then one warning line says what happened."""
        engine, snapshot = self._hybrid, self._guard_snapshot
        done = "skipped the step; its batch is dropped"
        if event.action is not Action.SKIP and snapshot.valid:
            schedule = snapshot.restore(engine.params, engine.optimizer)
            # Updates in effect go back to the snapshot's; every step since then no longer counts.
            undone = (engine.record.step + 1 - snapshot.step) - (engine.made_up_steps - snapshot.made_up)
            engine.made_up_steps += undone
            self._guard.undone_steps += undone
            self._hybrid_make_up(undone, schedule)
            engine.weights_restored()
            self._guard_reference = None
            done = (f"rolled back to the snapshot before step {snapshot.step + 1} ({undone} updates undone, their "
                    "batches dropped)")
        message = f"hf_hybrid guard: step {event.step}: {event.describe()}: {done}."
        if event.action is Action.STOP:
            control.should_save = control.should_training_stop = True
            checkpoint = os.path.join(self.args.output_dir, f"checkpoint-{self.state.global_step}")
            restored = done if snapshot.valid else "no snapshot to restore (--hybrid_guard_snapshot_steps 0)"
            message = (
                f"hf_hybrid guard stopped training at step {event.step}: {event.describe()} after "
                f"{self._guard.rollbacks} rollbacks (--hybrid_guard_max_rollbacks); {restored}; "
                f"checkpoint: {checkpoint}. "
                "Try a lower learning rate or a longer warmup, check the data near this step, or raise "
                "--hybrid_guard_threshold."
            )
            self._guard_stop = message
        if self.is_world_process_zero():
            logger.warning(message)

    def _hybrid_extend_max_steps(self, steps: int) -> None:
        """Add steps to max_steps, as far as the Trainer's epochs reach: its loop ends with the last epoch."""
        room = steps if self._hybrid_last_step is None else min(steps, self._hybrid_last_step - self.state.max_steps)
        room = max(room, 0)
        self.state.max_steps += room
        if room < steps and self.is_world_process_zero():
            logger.warning(
                f"{steps - room} optimizer steps undone by a rolled-back jump cannot be made up: the Trainer's last "
                f"epoch ends at step {self._hybrid_last_step}. This run makes {steps - room} fewer real updates than "
                "the Trainer would; a max_steps short of the data's last epoch leaves room for them."
            )
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, ProgressCallback) and callback.training_bar is not None:
                callback.training_bar.total = self.state.max_steps

    def _hybrid_schedule_state(self) -> dict:
        """What a rollback needs to rewind the schedule: the scheduler's state and the optimizer's hyperparameters,
        which the scheduler writes (the learning rate the next step will use is already in the param groups)."""
        groups = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        return {"scheduler": copy.deepcopy(self.lr_scheduler.state_dict()), "groups": copy.deepcopy(groups)}

    # ---- helpers ----------------------------------------------------------------------------------

    def _build_engine(self) -> HybridEngine:
        # Parameters of the prepared model: under FSDP2 these are the DTensors that hold the local shards.
        params = [p for p in self.model_wrapped.parameters() if p.requires_grad]
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
        engine = HybridEngine(self.hybrid_settings, params, optimizer, seed=self.args.seed)
        if self._hybrid_pending_state is not None:
            engine.load_state_dict(self._hybrid_pending_state)
        return engine

    def _build_guard(self, engine: HybridEngine) -> None:
        settings, saved = self.hybrid_settings, self._hybrid_pending_state or {}
        self._guard = self._guard_snapshot = self._guard_reference = self._guard_stop = None
        if not settings.hybrid_guard:
            return
        self._guard = StepGuard(window=settings.hybrid_guard_window, threshold=settings.hybrid_guard_threshold,
                                max_skips=settings.hybrid_guard_max_skips,
                                max_rollbacks=settings.hybrid_guard_max_rollbacks,
                                grad_norm_outliers=not self.args.max_grad_norm)
        self._guard_snapshot = TrainingSnapshot()
        if "guard" in saved:  # absent from checkpoints written before the guard, or by a run without it
            self._guard.load_state_dict(saved["guard"]["stats"])
            self._guard_snapshot.load_state_dict(saved["guard"]["snapshot"], engine.params, engine.optimizer)
            reference = saved["guard"]["reference"]
            self._guard_reference = move_unit((reference, None), self.args.device)[0] if reference else None

    def _hybrid_lr(self) -> float:
        return float(self.lr_scheduler.get_last_lr()[0])

    def _hybrid_reduce(self, *values) -> list[float]:
        """Average scalars across ranks in one collective, so every rank decides on the same numbers."""
        device = self.args.device
        # Under FSDP2 the gradient norm comes back as a DTensor, which cannot be stacked with plain tensors.
        values = [v.full_tensor() if hasattr(v, "full_tensor") else v for v in values]
        stacked = torch.stack([torch.as_tensor(v, dtype=torch.float32).to(device).reshape(()) for v in values])
        if self.accelerator.num_processes > 1:
            stacked = self.accelerator.reduce(stacked, reduction="mean")
        return stacked.tolist()

    def _hybrid_epochs_end_at(self, train_dataloader) -> int | None:
        """The optimizer step at which the Trainer's epoch loop ends, as `Trainer.set_initial_training_values`
        counts it; None when the data has no length (the loop then runs until max_steps)."""
        try:
            batches = len(train_dataloader)
        except TypeError:
            return None
        accumulation = self.args.gradient_accumulation_steps
        return self.state.num_train_epochs * max(-(-batches // accumulation), 1)

    def _hybrid_train_begin(self, train_dataloader) -> None:
        # The model and optimizer are prepared by now; each train() call builds the engine anew, before any file
        # is touched, so a setup error (no trainable parameter, an optimizer the predictor can't read) leaves none.
        self._hybrid = self._build_engine()
        self._build_guard(self._hybrid)
        self._hybrid_pending_state = None
        self._hybrid_last_step = self._hybrid_epochs_end_at(train_dataloader)
        # A resumed run: the Trainer set max_steps from the arguments again.
        self._hybrid_extend_max_steps(self._hybrid.made_up_steps)
        self._hybrid_t0 = time.perf_counter()
        if not (self.hybrid_settings.hybrid_trace and self.is_world_process_zero()):
            return
        os.makedirs(self.args.output_dir, exist_ok=True)
        path = os.path.join(self.args.output_dir, TRACE_NAME)
        # A resumed run keeps the trace up to its checkpoint and continues its clock; a fresh one starts over.
        kept = []
        if self.state.global_step > 0 and os.path.isfile(path):
            with open(path) as f:
                kept = [line for line in f if json.loads(line)["step"] <= self.state.global_step]
            if kept:
                self._hybrid_t0 -= json.loads(kept[-1])["time"]
        with open(path, "w") as f:
            f.writelines(kept)
        self._hybrid_trace = open(path, "a", buffering=1)

    def _hybrid_train_end(self) -> None:
        if self._hybrid is not None:
            self._hybrid.finish()
        if self._hybrid_trace is not None:
            self._hybrid_trace.close()
            self._hybrid_trace = None
        if self._vram is not None:
            self._vram.shutdown()

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self._hybrid is not None and not any(k.startswith("eval_") for k in logs):
            logs = {**logs, **self._hybrid.log_metrics(), **(self._guard.log_metrics() if self._guard else {})}
            if self._vram is not None:
                logs.update(self._vram.metrics())
        super().log(logs, start_time)

    # ---- checkpoints --------------------------------------------------------------------------------

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self._hybrid is not None and self._hybrid.offloader is not None:
            self._hybrid.offloader.wait()  # an asynchronous restore may still be writing the state
        super()._save_optimizer_and_scheduler(output_dir)
        if self._hybrid is not None:
            path = os.path.join(output_dir, HYBRID_STATE_NAME.format(rank=self.args.process_index))
            state = self._hybrid.state_dict()
            if self._guard is not None:
                reference = self._guard_reference
                state["guard"] = {
                    "stats": self._guard.state_dict(),
                    "snapshot": self._guard_snapshot.state_dict(),
                    "reference": move_unit((reference, None), "cpu")[0] if reference else None,
                }
            torch.save(state, path)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None or not self.hybrid_settings.hybrid:
            return
        path = os.path.join(checkpoint, HYBRID_STATE_NAME.format(rank=self.args.process_index))
        if not os.path.isfile(path):
            # Resumed on more ranks than saved: under DDP every rank's state is the same, so rank 0's serves. A
            # rank that started fresh instead would take other phases than its peers and hang their collectives.
            path = os.path.join(checkpoint, HYBRID_STATE_NAME.format(rank=0))
        if os.path.isfile(path):
            self._hybrid_pending_state = load_hybrid_state(path)

    def train(self, *args, **kwargs):
        output = super().train(*args, **kwargs)
        if self._guard_stop is not None:
            raise GuardStoppedError(self._guard_stop)
        return output


def load_hybrid_state(path: str) -> dict:
    """The hybrid state of a checkpoint, as plain types and tensors only: a file that holds any other object is
    refused, because unpickling it could run code."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise ValueError(
            f"{path} holds objects other than tensors and plain Python types, so hf_hybrid will not load it "
            "(unpickling it could run code). Resume from a checkpoint written by hf_hybrid, or delete this file to "
            f"resume without the hybrid state. ({str(err).splitlines()[0]})"
        ) from None


class HybridHFTrainer(HybridMixin, Trainer):
    """A drop-in `transformers.Trainer` with Warmup, Full, Predict and Correct phases."""
