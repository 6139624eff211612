"""Run under `torch.distributed.run --nproc_per_node 2` (gloo, CPU): the hybrid engine on an FSDP2-sharded model.

The engine is driven through the same calls, in the same order, as `HybridHFTrainer` makes them, and the guard's
snapshot is taken, a step skipped and the snapshot restored as the guard would. A replicated
reference model, trained on the same batches by its own engine, shows what every weight should be. accelerate runs
FSDP only on CUDA (on CPU it falls back to DDP), so this drives `fully_shard` directly; tests/test_cuda.py runs the
trainer itself under `accelerate launch` with FSDP2 on a GPU.
"""

from __future__ import annotations

import contextlib
import copy
import json
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from hf_hybrid import Phase  # noqa: E402
from hf_hybrid.config import HYBRID_FIELDS, hybrid_config  # noqa: E402
from hf_hybrid.jumps.engine import HybridEngine  # noqa: E402
from hf_hybrid.memory.snapshot import TrainingSnapshot  # noqa: E402
from tests.conftest import FAST_SCHEDULE, tiny_gpt2, token_dataset  # noqa: E402

LR = 3e-3


def full_state(model) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.named_parameters()}


class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives dispatched while active, eager c10d ones and DTensor's functional ones alike.
    (torch's CommDebugMode does this too, but its module tracker fails on modules run inside it.)"""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional", "c10d_functional"):
            self.count += 1
        return func(*args, **(kwargs or {}))


class Run:
    """One model, its AdamW and its engine; `step` is one optimizer step as the Trainer takes it."""

    def __init__(self, model, settings) -> None:
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.engine = HybridEngine(hybrid_config(settings).jumps, trainable, self.optimizer)
        self.collectives = {"predict": 0, "residual": 0, "other": 0}
        self.correct_steps = 0
        self.guard = TrainingSnapshot()  # FSDP2: each rank keeps its own shards

    @contextlib.contextmanager
    def counted(self, kind: str = "other"):
        """Count the collectives dispatched inside (DTensor redistributions included)."""
        counter = CollectiveCounter()
        with counter:
            yield
        self.collectives[kind] += counter.count

    def step(self, step: int, batch: dict, reject: bool = False, guard: str | None = None) -> Phase:
        """`reject`: roll a jump back at its step, as the probe's verdict would. `guard`: "snapshot", "skip" or
        "rollback", what the guard does on this real step."""
        engine = self.engine
        with self.counted():
            engine.begin_step(step)
        if engine.phase is Phase.PREDICT:
            with self.counted("predict"):
                engine.apply_prediction(LR)
                engine.check_predict_step(None)
                if reject:
                    engine.rollback()
        else:
            loss = self.model(**batch).loss
            loss.backward()
            with self.counted():
                if guard == "snapshot":
                    self.guard.capture(step, engine.made_up_steps, engine.params, self.optimizer, {})
                if guard in ("skip", "rollback"):
                    engine.skip_step(diverged=False)
                elif not engine.check_real_step(loss.item(), None, LR):
                    engine.start_cycle()  # as the trainer does at an accepted step: the outer anchor moves here
                engine.before_optimizer_step(LR)
            if guard == "rollback":
                with self.counted():
                    self.guard.restore(engine.params, self.optimizer)
                    engine.weights_restored()
            elif guard != "skip":
                self.optimizer.step()
                self.correct_steps += engine.phase is Phase.CORRECT
                with self.counted("residual" if engine.phase is Phase.CORRECT else "other"):
                    engine.after_optimizer_step(LR)
            self.optimizer.zero_grad(set_to_none=True)
        phase = engine.phase
        with self.counted():
            engine.end_step()
        return phase


def main(out_dir: str, predictor: str) -> None:
    dist.init_process_group("gloo")
    settings = SimpleNamespace(**{f.name: f.default for f in HYBRID_FIELDS})
    settings.__dict__.update(FAST_SCHEDULE, hybrid_predictor=predictor, hybrid_outer_period=3)
    torch.manual_seed(0)
    model = tiny_gpt2()
    reference = Run(copy.deepcopy(model), settings)
    # A CPU mesh named explicitly: by default the mesh takes the CUDA device of each rank's index, when there is one.
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sharded = Run(model, settings)
    data = token_dataset(n=64)
    # The same batch on every rank: averaged gradients then equal the reference's, so the weights must match.
    batches = [{k: torch.tensor(data[i * 8:(i + 1) * 8][k]) for k in ("input_ids", "labels")} for i in range(8)]

    # Between the warmup and the first jump: the guard's snapshot before step 5's update, a skipped step 6 and a
    # rollback at step 7, back to the snapshot.
    guard_plan = {5: "snapshot", 6: "skip", 7: "rollback"}
    max_diff, predicted, rolled_back, restored, skipped = 0.0, 0, False, False, False
    last_phase, phase_start = None, None
    for step in range(30):
        batch = batches[step % len(batches)]
        # The outer jump is one step long: its rollback comes inside the step, as the probe's would.
        reject = predictor == "outer" and not rolled_back and sharded.engine.controller.phase is Phase.PREDICT
        guard = guard_plan.get(step)
        if guard is not None and sharded.engine.controller.phase is not Phase.FULL:
            guard_plan[step + 1] = guard  # on a Full step: a Predict step has no guard, a Correct step an open jump
            guard = None
        before = full_state(reference.model)
        phase = sharded.step(step, batch, reject, guard)
        assert reference.step(step, batch, reject, guard) is phase
        after = full_state(reference.model)
        if reject:
            rolled_back = all(torch.equal(after[k], before[k]) for k in before)
        if guard == "snapshot":
            at_snapshot = before
        elif guard == "skip":
            skipped = all(torch.equal(after[k], before[k]) for k in before)
        elif guard == "rollback":
            restored = all(torch.equal(after[k], at_snapshot[k]) for k in before)
        predicted += phase is Phase.PREDICT
        if phase is Phase.PREDICT and last_phase is not Phase.PREDICT:
            phase_start = before  # the weights the phase's first predicted step started from
        last_phase = phase
        if phase is Phase.PREDICT and not rolled_back and sharded.engine.controller.phase is Phase.PREDICT:
            # Undo one phase midway, as the divergence monitor would: both must return to the phase's start (the
            # sharded run through `max_diff`).
            for run in (sharded, reference):
                run.engine.record = run.engine.last_record
                with run.counted():
                    run.engine.rollback()
                run.engine.record = None
            after = full_state(reference.model)
            rolled_back = all(torch.equal(after[k], phase_start[k]) for k in phase_start)
        got, want = full_state(sharded.model), full_state(reference.model)
        max_diff = max(max_diff, max((got[k] - want[k]).abs().max().item() for k in want))

    params = list(model.parameters())
    gather = CollectiveCounter()
    with gather:  # the counter's own check: a full tensor must be gathered
        full = params[0].full_tensor()
    result = {
        "counter_sees_a_gather": gather.count > 0,
        "gathered_finite": bool(torch.isfinite(full).all()),
        "world_size": dist.get_world_size(),
        "dtensor_params": all(isinstance(p, DTensor) for p in params),
        "local_fraction": sum(p.to_local().numel() for p in params) / sum(p.numel() for p in params),
        "engine_collectives": sharded.collectives,
        "correct_steps": sharded.correct_steps,
        "predict_steps": predicted,
        "rolled_back": rolled_back,
        "guard_skipped": skipped,
        "guard_restored": restored,
        "max_abs_diff": max_diff,
        "rank": dist.get_rank(),
    }
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    # Neither rank leaves while the other still talks to it.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
