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

from hf_hybrid import HybridHFTrainer  # noqa: E402
from hf_hybrid.payoff import PayoffMeter  # noqa: E402
from tests.conftest import hybrid_args, tiny_gpt2, token_dataset  # noqa: E402
from tests.ddp_guard_worker import HashEveryStep  # noqa: E402
from tests.test_guard import GUARD, SPIKE  # noqa: E402

DEFAULTS = dict(hybrid_predictor="outer", hybrid_outer_period=5, hybrid_payoff_check=True, hybrid_max_rejections=0,
                save_strategy="steps", save_steps=10)


def main(out_dir: str, resume_from: str | None) -> None:
    # Every other verdict rejects its jump, in the same order on both ranks (and in a resumed run, from its count).
    original = PayoffMeter.verdict
    PayoffMeter.verdict = lambda self, gain: original(self, gain if self.verdicts % 2 else float("-inf"))
    # A fifth of GUARD's learning rate, so that the learning-rate autopilot raises it too.
    args = hybrid_args(out_dir, max_steps=40, per_device_train_batch_size=4,
                       **{**GUARD, **DEFAULTS, "learning_rate": GUARD.get("learning_rate", 3e-3) / 5})
    rank = args.process_index
    plan = FaultPlan(nan_step=34 if rank == 1 else None)
    trainer = with_faults(HybridHFTrainer, plan)(model=tiny_gpt2(seed=7 if resume_from else 0), args=args,
                                                 train_dataset=token_dataset())
    trainer.add_callback(LearningRateSpike(20, SPIKE))
    recorder = HashEveryStep()
    trainer.add_callback(recorder)
    trainer.train(resume_from_checkpoint=resume_from)
    trace = Path(out_dir, "hybrid_trace.jsonl").read_text().splitlines() if rank == 0 else []  # rank 0 writes it
    rows = [json.loads(line) for line in trace]
    events = [[r["step"], r["phase"], r["rollback"], r["guard"]] for r in rows
              if r["rollback"] or r["guard"] or r["phase"] == "predict"]
    # Each rank keeps its own first micro-batch as the autopilot's probe (the losses on it are averaged across ranks):
    # the rest of its state must be identical.
    autopilot = {k: v for k, v in trainer._lr_autopilot.state_dict().items() if k != "probe"}
    result = {"world_size": args.world_size, "hashes": recorder.hashes, "stats": trainer.hybrid_stats(),
              "lr_autopilot": autopilot,
              "events": events}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
