"""Where the LR autopilot's first reading spends its time (issue 46: on a GPU it took about a second more than later
ones, cause unknown). The hybrid at the preset's learning rate for a few tens of steps, each optimizer step profiled on
its own (torch.profiler: host operators and CUDA runtime calls). For the first two steps that took a reading, and the
step before each: the step's time in the trace, and the host operators and runtime calls that took the most of it. A
kernel loaded on first use, a device or pinned allocation, a cuDNN plan or a device wait show there by name.

    python scripts/first_reading.py --preset gpt2-124m --out $OUT/first_reading.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from arms import run_arm
from plotting import TRACE_FILE, read_trace
from presets import PRESETS
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

TOP = 10


class StepProfiles(TrainerCallback):
    """A profile of each optimizer step in `steps`, from its start to the end of the hybrid's step-end work (the
    reading). Each profile is parsed when its step ends, which on a GPU takes a good share of a step: a window around
    the readings keeps the part inside its time limit."""

    def __init__(self, steps: range) -> None:
        self.steps = steps
        self.current = None
        self.by_step: dict[int, list[dict]] = {}

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        import torch

        if state.global_step + 1 not in self.steps:
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self.current = profile(activities=activities)
        self.current.__enter__()

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        import torch

        if self.current is None:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.current.__exit__(None, None, None)
        events = sorted(self.current.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        self.by_step[state.global_step] = [{"name": e.key, "self_cpu_ms": e.self_cpu_time_total / 1e3,
                                            "calls": e.count} for e in events[:TOP]]
        self.current = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt2-124m")
    # Past the second reading, which must not fall in the last READ_EVERY steps before a constant schedule's
    # cooldown (its last fifth): at a 50-step warmup the readings come at steps 50 and 60.
    parser.add_argument("--max_steps", type=int, default=100)
    parser.add_argument("--profile_steps", default="",
                        help="FROM-TO: profile only these steps (default: every step)")
    parser.add_argument("--output_dir", default="runs/first-reading")
    parser.add_argument("--out", default="runs/first-reading.json")
    args = parser.parse_args()
    preset = {**PRESETS[args.preset], "max_steps": args.max_steps, "early_eval_steps": 0}
    preset["eval_steps"] = args.max_steps  # no evaluation before the end: nothing else loads kernels in between
    first, _, last = args.profile_steps.partition("-")
    profiles = StepProfiles(range(int(first), int(last) + 1) if first else range(1, args.max_steps + 1))
    run_arm("hybrid", preset, Path(args.output_dir), seed=0, hybrid_overrides={}, budget=1.0, target=None,
            hook_clock_on_gpu=False, watchers=(profiles,))
    trace = read_trace(Path(args.output_dir) / TRACE_FILE)
    seconds = {row["step"]: row["time"] - before["time"] for before, row in zip(trace, trace[1:])}
    readings = [row["step"] for row in trace if row["probe_line"] is not None][:2]
    rows = [{"step": step, "reading": step in readings, "seconds": seconds.get(step),
             "top": profiles.by_step.get(step, [])} for reading in readings for step in (reading - 1, reading)]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"preset": args.preset, "readings": readings, "steps": rows}, indent=1))
    for row in rows:  # the last lines are what a log's tail shows
        top = ", ".join(f"{e['name'][:40]} {e['self_cpu_ms']:.1f} ms ({e['calls']}x)" for e in row["top"][:4])
        print(f"step {row['step']}{' (a reading)' if row['reading'] else ''}: {row['seconds'] or 0:.3f} s; its top "
              f"host time: {top or 'not profiled (outside --profile_steps)'}")


if __name__ == "__main__":
    main()
