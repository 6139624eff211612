"""The sha256 of the weights the hybrid arm trains on a preset, as the benchmark runs it (the preset's hybrid
settings). A change meant to keep every run's behaviour (a move, a rename, a new seam) shows that it did when the
digest is the same before and after it.

    python scripts/weights_digest.py --preset cpu-small                           # at the preset's LR
    python scripts/weights_digest.py --preset cpu-finetune --lr_scale 0.2         # at a fifth of it
    python scripts/weights_digest.py --preset cpu-small --faults window,spike,nan # the faults run's hybrid arm

The arm is the benchmark's own (scripts/arms.py, scripts/faults.py), from the scripts folder `--scripts` names. To
digest another commit, check it out in a worktree and run this file with `PYTHONPATH=<worktree>` and
`--scripts <worktree>/scripts`: that commit's library, driven by that commit's scripts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import torch


def digest(model) -> str:
    sha = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        sha.update(name.encode())
        sha.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="cpu-small")
    parser.add_argument("--lr_scale", type=float, default=1.0, help="a fraction of the preset's learning rate")
    parser.add_argument("--faults", default="", help="inject these faults (faults.py) into the hybrid arm")
    parser.add_argument("--max_steps", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scripts", default=str(Path(__file__).resolve().parent))
    parser.add_argument("--output_dir", default="runs/weights-digest")
    args = parser.parse_args()
    sys.path.insert(0, args.scripts)
    import arms
    import faults
    from presets import PRESETS

    preset = dict(PRESETS[args.preset])
    preset["learning_rate"] *= args.lr_scale
    if args.max_steps:
        preset["max_steps"] = args.max_steps
    built = []  # the (model, datasets, eval set) each arm builds: the model is the one it trains

    def keeping(build):
        def build_and_keep(*args, **kwargs):
            built.append(build(*args, **kwargs))
            return built[-1]
        return build_and_keep

    for module in (arms, faults):
        module.build_model_and_data = keeping(module.build_model_and_data)
    out = Path(args.output_dir) / args.preset
    if args.faults:
        preset["eval_steps"] = max(preset["max_steps"] // 10, 1)  # as the faults mode sets it
        plan = faults.FaultPlan.for_run(preset["max_steps"], args.faults.split(","))
        result = faults.run_arm("hybrid-faults", preset, plan, args.seed, out)
        final, stats = result["final_eval_loss"], result["hybrid_stats"]
    else:
        result = arms.run_arm("hybrid", preset, out, args.seed, {}, 1.0, None, False)
        final, stats = result.evals[-1][2], result.hybrid_stats
    model = built[0][0]
    keys = ("predictions_judged", "predictions_kept", "guard_rollbacks", "skipped_steps", "lr_scale", "lr_raises_kept")
    print(json.dumps({"preset": args.preset, "lr": preset["learning_rate"], "faults": args.faults,
                      "final_eval_loss": final, "stats": {k: stats.get(k) for k in keys},
                      "weights_sha256": digest(model)}))


if __name__ == "__main__":
    main()
