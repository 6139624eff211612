"""Offline experiments on a benchmark preset: what would a jump be worth, before building one into the library?

    python scripts/jump_lab.py record --seed 0 --out /tmp/traj0.pt      # train, keep all weights every 5 steps
    python scripts/jump_lab.py nowcaster --trajectories /tmp/traj0.pt --out /tmp/nowcaster.pt
    python scripts/jump_lab.py oracle --trajectory /tmp/traj0.pt --nowcaster /tmp/nowcaster.pt \
        --train_on mean40,line40@now,line80+20                          # held-out value of candidate jumps
    python scripts/jump_lab.py split --predictor velocity               # per-tensor split, timed A/B
    python scripts/jump_lab.py --preset cpu-finetune record --steps 400 --every 10 --out /tmp/ft0.pt

- `record` trains the preset's model (the benchmark preset's config, optimizer settings and schedule; its
  trainable weights only, so the LoRA adapters under cpu-lora) in a plain loop and keeps them every `--every`
  steps, plus the optimizer state at a few steps.
- `nowcaster` fits a WNN-style per-weight MLP on recorded trajectories: a weight's moves between `--ctx` states
  `--spacing` steps apart in, its move over the next `--horizon` steps out.
- `oracle` measures on the benchmark's held-out blocks where candidate jump targets land (tail means, line
  fits and their extrapolations, over short windows and over `--ctx` states `--spacing` steps apart, and the
  nowcaster's forecast) in units of baseline steps, and with `--train_on` whether the gain survives training on
  from the jumped point for `--train_for` steps.
- `split` gives the tied embedding / LM head (most of this model's compute) no weight gradient on every
  `--split_every`-th step and predicts or skips its update, timed side by side with a plain loop.

The numbers are in docs/benchmarks-history.md; nothing here is part of the library.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from jump_lab_nowcaster import nowcaster  # noqa: E402
from jump_lab_oracle import oracle  # noqa: E402
from jump_lab_split import split  # noqa: E402
from jump_lab_trajectory import PRESET, record  # noqa: E402
from presets import PRESETS  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu-small")
    parser.add_argument("--learning_rate", type=float, default=0.0, help="override the preset's")
    parser.add_argument("--batch_size", type=int, default=0, help="override the preset's (less gradient noise)")
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("--seed", type=int, default=0)
    rec.add_argument("--steps", type=int, default=400)
    rec.add_argument("--every", type=int, default=5)
    rec.add_argument("--optimizer_at", default="150,250")
    rec.add_argument("--out", required=True)
    orc = sub.add_parser("oracle")
    orc.add_argument("--trajectory", required=True)
    orc.add_argument("--at", default="100,150,200,250,300")
    orc.add_argument("--train_on", default="", help="candidates to train on from, e.g. mean40,line40+20")
    orc.add_argument("--train_for", type=int, default=40, help="steps trained on from each --train_on candidate")
    orc.add_argument("--eval_every", type=int, default=10, help="held-out evaluations while training on (steps)")
    orc.add_argument("--advance", type=int, default=0,
                     help="train on from step + this, as a kept jump of this many steps would (schedule and data)")
    orc.add_argument("--nowcaster", nargs="*", default=[])
    orc.add_argument("--spacing", type=int, default=40, help="long-horizon line fits: steps between states")
    orc.add_argument("--ctx", type=int, default=5, help="long-horizon line fits: states")
    orc.add_argument("--horizons", default="", help="long-horizon line fits: steps ahead, e.g. 40,80,160")
    orc.add_argument("--report", default="jump_lab_report.json")
    now = sub.add_parser("nowcaster")
    now.add_argument("--trajectories", nargs="+", required=True)
    now.add_argument("--horizon", type=int, default=20)
    now.add_argument("--spacing", type=int, default=5, help="steps between the states it reads")
    now.add_argument("--ctx", type=int, default=5, help="states it reads")
    now.add_argument("--held_out", nargs="*", default=[], help="trajectories to score it on, not trained on")
    now.add_argument("--per_step", type=int, default=20000)
    now.add_argument("--epochs", type=int, default=30)
    now.add_argument("--out", required=True)
    spl = sub.add_parser("split")
    spl.add_argument("--seed", type=int, default=0)
    spl.add_argument("--steps", type=int, default=300)
    spl.add_argument("--eval_every", type=int, default=25)
    spl.add_argument("--split_every", type=int, default=2)
    spl.add_argument("--split_from", type=int, default=50)
    spl.add_argument("--predictor", choices=("velocity", "freeze"), default="velocity")
    spl.add_argument("--report", default="split_report.json")
    args = parser.parse_args()
    PRESET.update(PRESETS[args.preset])
    if args.batch_size:
        PRESET["batch_size"] = args.batch_size
    if args.learning_rate:
        PRESET["learning_rate"] = args.learning_rate
    {"record": record, "nowcaster": nowcaster, "oracle": oracle, "split": split}[args.command](args)


if __name__ == "__main__":
    main()
