"""The command line shared by the tuning-half probes of issue 49 (early_lines.py, warmup_evidence.py): one setting of
the tuning half, a list of LRs, a plain Trainer run per LR measured by `measure`, and one JSON report."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from presets import PRESETS


def per_learning_rate(script: str, doc: str, measure: Callable[[dict, float, int, str], list[list[float]]],
                      show: Callable[[list[float]], str], default_steps: int) -> None:
    """Parse `--setting`, `--learning_rates`, `--steps` and `--out`; refuse a report-half setting; run `measure(preset,
    lr, steps, out_dir)` per LR, printing each row with `show`; write {command, setting, rows: {lr: rows}}."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", required=True, help="a survey setting of the tuning half")
    parser.add_argument("--learning_rates", required=True)
    parser.add_argument("--steps", type=int, default=default_steps)
    parser.add_argument("--out", default=f"runs/{script}.json")
    args = parser.parse_args()
    preset = PRESETS[f"survey-{args.setting}"]
    if preset["half"] != "tune":
        parser.error(f"{args.setting} is in the {preset['half']} half, which tuning does not read")
    found = {}
    for lr in (float(x) for x in args.learning_rates.split(",")):
        found[f"{lr:g}"] = measure(preset, lr, args.steps, f"runs/{script}/{args.setting}-{lr:g}")
        print(f"{args.setting} {lr:g}: " + " ".join(show(row) for row in found[f"{lr:g}"]), flush=True)
    command = f"python scripts/{script.replace('-', '_')}.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items())
    Path(args.out).write_text(json.dumps({"command": command, "setting": args.setting, "rows": found}, indent=1) + "\n")
