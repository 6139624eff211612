"""What the hybrid adds to a run at GPT-2 124M on the CPU: peak resident memory, checkpoint bytes and host time per
real step, each beside the plain Trainer's, in multiples of the parameters' bytes P.

Each arm runs in its own process (peak RSS is per process), on the real GPT-2 124M config with the shipped tokenizer
and corpus, and saves one checkpoint at its last step. The hybrid runs the library's defaults except a shorter warmup
and outer period (`--hybrid_warmup_steps`, `--hybrid_outer_period`), so that a few steps hold a jump, guard snapshots
and a save; what the hybrid allocates does not depend on them.

Host time per real step: the hybrid's work between backward and `optimizer.step` (the overridden gradient-norm hook
past the Trainer's own, and the pre-step hook), timed with `time.perf_counter` around those calls. On the CPU every
operation is synchronous, so this is host time.

    python scripts/memory_budget.py --steps 24 --warmup 5 --period 6 --pairs 1 \
        --out docs/reports/gpt2-124m-memory-budget.json

Step time is measured under glibc's default allocator too, where the hybrid's extra buffers change the heap layout
and with it how often the large activations and gradients are mapped and unmapped (runs 13-14). `--tuned_allocator`
runs both arms with the benchmark's raised mmap and trim thresholds (`TUNED_HOST_ALLOCATOR`), for step times that
compare the work done; the peak resident memory it reports then includes freed memory the allocator kept.

`--count_ops` counts the operators PyTorch dispatches in each step (each a kernel launch or a copy on a GPU, where
their host cost is what a host-bound step pays) and reports the hybrid's per kind of step beside the Trainer's. The
counting slows every operator, so its step and hook times are not comparable with a run without it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from presets import TUNED_HOST_ALLOCATOR  # noqa: E402


def run_arm(arm: str, steps: int, warmup: int, period: int, output_dir: str, count_ops: bool) -> dict:
    import torch
    from model_and_data import build_model_and_data
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from hf_hybrid import HybridHFTrainer, HybridTrainingArguments
    from hf_hybrid.trainer import HybridMixin

    preset = dict(model=dict(), block_size=128, eval_blocks=1)
    model, datasets, _ = build_model_and_data(preset, seed=0)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    common = dict(output_dir=output_dir, per_device_train_batch_size=4, learning_rate=6e-4, max_steps=steps,
                  save_strategy="steps", save_steps=steps, logging_steps=steps, report_to="none", seed=0,
                  use_cpu=True, disable_tqdm=True, max_grad_norm=1.0)
    hook_seconds = [0.0]
    if arm == "plain":
        trainer = Trainer(model=model, args=TrainingArguments(**common), train_dataset=datasets["train"])
    else:
        args = HybridTrainingArguments(**common, hybrid_warmup_steps=warmup, hybrid_outer_period=period)
        trainer = HybridHFTrainer(model=model, args=args, train_dataset=datasets["train"])
        # The hybrid's hooks are timed whole; the Trainer's own gradient norm, which the override calls, is taken out.
        for cls, name, sign in ((HybridMixin, "_get_grad_norm", 1), (Trainer, "_get_grad_norm", -1),
                                (HybridMixin, "_hybrid_before_optimizer_step", 1)):
            setattr(cls, name, _timed(getattr(cls, name), hook_seconds, sign))

    ops = [0]

    class CountedOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops[0] += 1
            return func(*args, **(kwargs or {}))

    step_ops: list[int] = []
    step_faults: list[int] = []  # minor page faults: memory the allocator mapped afresh, zero-filled at first touch
    step_seconds: list[float] = []
    step_kinds: list[str] = []  # the hybrid's: the phase, and whether the step took a reading or a guard snapshot
    hook_per_real_step: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.t, self.hooks, self.ops = time.perf_counter(), hook_seconds[0], ops[0]
            self.faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt

        def on_step_end(self, args, state, control, **kwargs):
            step_seconds.append(time.perf_counter() - self.t)
            step_ops.append(ops[0] - self.ops)
            step_faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - self.faults)
            engine = getattr(trainer, "_hybrid", None)
            if engine is None:
                return
            if engine.last_record.phase.has_backward:
                hook_per_real_step.append(hook_seconds[0] - self.hooks)
            autopilot, guard = trainer._lr_autopilot, trainer._guard_loop
            extras = [("reading", autopilot is not None and autopilot.last_line is not None),
                      ("snapshot", guard is not None and guard.snapshot.step == state.global_step - 1)]
            step_kinds.append("+".join([engine.last_record.phase.value, *(k for k, on in extras if on)]))

    trainer.add_callback(Clock())
    if count_ops:
        with CountedOps():
            trainer.train()
    else:
        trainer.train()
    checkpoint = Path(output_dir) / f"checkpoint-{trainer.state.global_step}"
    files = {f.name: f.stat().st_size for f in checkpoint.iterdir() if f.is_file()}
    stats = trainer.hybrid_stats() if arm == "hybrid" else {}
    return {
        "arm": arm, "param_bytes": params, "torch_threads": torch.get_num_threads(),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "checkpoints": sorted(p.name for p in Path(output_dir).glob("checkpoint-*")),
        "checkpoint_files": files,
        "hybrid_checkpoint_bytes": sum(v for k, v in files.items() if k.startswith("hybrid")),
        "median_step_seconds": statistics.median(step_seconds[1:]), "step_seconds": step_seconds,
        "step_kinds": step_kinds, "step_ops": step_ops if count_ops else None, "step_faults": step_faults,
        "hook_seconds_per_real_step": hook_per_real_step, "stats": stats,
    }


def _timed(method, total: list[float], sign: int):
    def call(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            total[0] += sign * (time.perf_counter() - t0)
    return call


def _ops_added_by_kind(hybrid: dict, plain: dict) -> dict:
    """The hybrid's operators per step past the Trainer's median step, for each kind of step: [min, median, max]. The
    first step is left out of both: it also pays for the run's setup."""
    base = statistics.median(plain["step_ops"][1:])
    by_kind: dict[str, list[int]] = {}
    for n, kind in zip(hybrid["step_ops"][1:], hybrid["step_kinds"][1:]):
        by_kind.setdefault(kind, []).append(n - base)
    return {kind: [min(v), statistics.median(v), max(v)] for kind, v in by_kind.items()} | {"trainer_step": base}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--period", type=int, default=10)
    parser.add_argument("--pairs", type=int, default=1, help="plain/hybrid pairs, run alternately")
    parser.add_argument("--out", default=None)
    parser.add_argument("--tuned_allocator", action="store_true", help="both arms under TUNED_HOST_ALLOCATOR")
    parser.add_argument("--count_ops", action="store_true", help="count the operators dispatched per step (slower)")
    parser.add_argument("--arm", choices=["plain", "hybrid"], help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:
        with tempfile.TemporaryDirectory() as tmp:
            result = run_arm(args.arm, args.steps, args.warmup, args.period, tmp, args.count_ops)
        Path(args.result).write_text(json.dumps(result))
        return
    runs = []
    for pair in range(args.pairs):
        for arm in ("plain", "hybrid"):
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                subprocess.run([sys.executable, __file__, "--arm", arm, "--result", out.name, "--steps",
                                str(args.steps), "--warmup", str(args.warmup), "--period", str(args.period),
                                *(["--count_ops"] if args.count_ops else [])],
                               check=True, env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                                                **(TUNED_HOST_ALLOCATOR if args.tuned_allocator else {})})
                runs.append(json.loads(Path(out.name).read_text()))
            print(f"pair {pair}: {arm} done", flush=True)
    plain = [r for r in runs if r["arm"] == "plain"]
    hybrid = [r for r in runs if r["arm"] == "hybrid"]
    p = plain[0]["param_bytes"]
    summary = {
        "P_bytes": p,
        "peak_rss_added_P": statistics.median((h["peak_rss_bytes"] - q["peak_rss_bytes"]) / p
                                              for h, q in zip(hybrid, plain)),
        "checkpoint_added_P": hybrid[0]["hybrid_checkpoint_bytes"] / p,
        "checkpoints": {"plain": plain[0]["checkpoints"], "hybrid": hybrid[0]["checkpoints"]},
        # The median real step takes no snapshot; the mean spreads the guard's snapshot copies over the run.
        "hook_ms_per_real_step_median": statistics.median(
            statistics.median(h["hook_seconds_per_real_step"]) * 1e3 for h in hybrid),
        "hook_ms_per_real_step_mean": statistics.median(
            statistics.mean(h["hook_seconds_per_real_step"]) * 1e3 for h in hybrid),
        "step_time_ratio": [h["median_step_seconds"] / q["median_step_seconds"] for h, q in zip(hybrid, plain)],
        # The hybrid's real steps that took neither a reading nor a snapshot, against the Trainer's median step.
        "plain_real_step_ratio": [statistics.median(
            s for s, kind in zip(h["step_seconds"][1:], h["step_kinds"][1:]) if kind in ("warmup", "full", "correct")
        ) / q["median_step_seconds"] for h, q in zip(hybrid, plain)],
    }
    # Where the step times part, whether the allocator is why: each arm's median minor page faults per step.
    summary["median_page_faults_per_step"] = {arm: [statistics.median(r["step_faults"][1:]) for r in rs]
                                              for arm, rs in (("plain", plain), ("hybrid", hybrid))}
    if args.count_ops:
        summary["ops_added_per_step_by_kind"] = _ops_added_by_kind(hybrid[0], plain[0])
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "summary": summary, "runs": runs},
                                             indent=1))


if __name__ == "__main__":
    main()
