"""Run under `accelerate launch --num_processes 2`: the library's defaults (the outer predictor and the guard) with
jumps kept and rolled back, a NaN that only rank 1 sees and a learning-rate spike on both, saving a checkpoint every
10 steps; each rank's weight hash after every step. With a checkpoint as the second argument, it resumes from it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from faults import FaultPlan, LearningRateSpike, with_faults  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from hf_hybrid import HybridHFTrainer  # noqa: E402
from hf_hybrid.autopilot.scale import LrScale  # noqa: E402
from hf_hybrid.jumps.payoff import PayoffMeter  # noqa: E402
from tests.conftest import hybrid_args, tiny_gpt2, token_dataset  # noqa: E402
from tests.ddp_guard_worker import HashEveryStep  # noqa: E402
from tests.test_guard import GUARD, SPIKE  # noqa: E402

# The defaults, with the outer cycle and the warmup before it scaled down to an 80-step run (long enough for a raise
# after the guard's rollback and skip, each of which holds raises for three readings), and a constant schedule: a
# linear decay would freeze the learning-rate autopilot halfway.
DEFAULTS = dict(hybrid_predictor="outer", hybrid_outer_period=5, hybrid_warmup_steps=5, hybrid_payoff_check=True,
                hybrid_max_rejections=0, lr_scheduler_type="constant", save_strategy="steps", save_steps=10,
                hybrid_guard_snapshot_steps=50)  # the default: the snapshots come at the cycle starts


class PlacementEveryStep(TrainerCallback):
    """Where the guard's snapshot and the outer state sit at each step's end: their bytes on this rank, and whether the
    snapshot stands on the outer anchor (its weights not copied again)."""

    def __init__(self) -> None:
        self.trainer, self.rows = None, []

    def on_step_end(self, args, state, control, **kwargs):
        snapshot, outer = self.trainer._guard_loop.snapshot, self.trainer._hybrid.predictor
        if not snapshot.valid:
            return
        # The guard's own copies: weights it stands on that the outer predictor holds as its anchor are not its own.
        own = [*([] if snapshot.on_held_weights else snapshot.weights.tensors or []),
               *(snapshot.optimizer_state.tensors or [])]
        held = [*(outer.anchor or []), *outer.buf]
        self.rows.append({"on_anchor": snapshot.on_held_weights,
                          "is_the_anchor": snapshot.weights.tensors is outer.anchor,
                          "guard_bytes": sum(t.numel() * t.element_size() for t in own),
                          "outer_bytes": sum(t.numel() * t.element_size() for t in held)})


def main(out_dir: str, resume_from: str | None) -> None:
    # Every other verdict rejects its jump, in the same order on both ranks (and in a resumed run, from its count).
    original = PayoffMeter.verdict
    PayoffMeter.verdict = lambda self, gain, noise: original(self, gain if self.verdicts % 2 else float("-inf"), noise)
    # The tiny task's lines along the next step are short: until a raise has been tried, each reading's line still
    # falls at 8 steps, so that the learning-rate autopilot tries one, which both ranks must judge alike. The rule
    # reads the checkpointed scale, so a resumed run follows it too.
    original_reading = LrScale.reading

    def long_until_tried(self, f0, f1, f2, **kwargs):
        if not (self.on_trial or self.raises_kept or self.trials_undone):
            f1, f2 = f0 - 1.0, f0 - 2.0
        return original_reading(self, f0, f1, f2, **kwargs)

    LrScale.reading = long_until_tried
    args = hybrid_args(out_dir, max_steps=80, per_device_train_batch_size=4,
                       **{**GUARD, **DEFAULTS, "learning_rate": GUARD["learning_rate"] / 5})
    rank = args.process_index
    plan = FaultPlan(nan_step=34 if rank == 1 else None)
    trainer = with_faults(HybridHFTrainer, plan)(model=tiny_gpt2(seed=7 if resume_from else 0), args=args,
                                                 train_dataset=token_dataset())
    trainer.add_callback(LearningRateSpike(20, SPIKE))
    recorder, placement = HashEveryStep(), PlacementEveryStep()
    placement.trainer = trainer
    trainer.add_callback(recorder)
    trainer.add_callback(placement)
    trainer.train(resume_from_checkpoint=resume_from)
    trace = Path(out_dir, "hybrid_trace.jsonl").read_text().splitlines() if rank == 0 else []  # rank 0 writes it
    rows = [json.loads(line) for line in trace]
    events = [[r["step"], r["phase"], r["rollback"], r["guard"]] for r in rows
              if r["rollback"] or r["guard"] or r["phase"] == "predict"]
    # Each rank keeps its own first micro-batch as the autopilot's probe (the losses on it are averaged across ranks):
    # the rest of its state must be identical.
    autopilot = {k: v for k, v in trainer._lr_autopilot.state_dict().items() if k != "probe"}
    result = {"world_size": args.world_size, "hashes": recorder.hashes, "stats": trainer.hybrid_stats(),
              "lr_autopilot": autopilot, "events": events, "placement": placement.rows,
              "param_bytes": sum(p.numel() * p.element_size() for p in trainer.model.parameters())}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
