"""TRL's trainers at the learning rate their users type: `DPOConfig`'s default 1e-6 and `SFTConfig`'s 2e-5. Side by
side from the same pretrained GPT-2 (the CPU fine-tunes' checkpoint, pretrained on the shipped Shakespeare), on the
same data, seed and order: TRL's trainer at the user's LR, its hybrid (`HybridDPOTrainer`, `HybridSFTTrainer`) with
its defaults at the same LR, and TRL's trainer at the swept LR. TRL's config defaults otherwise (SFT's gradient
checkpointing included), bf16 off on the CPU.

The data come from the shipped transformers docstrings. DPO: 32-token blocks, the prompt a block's first 16 tokens,
the chosen completion its own next 16, the rejected one the next 16 of another block (a non sequitur). SFT: each
48-token block as a text. Held out: the trainer's loss on 64 validation pairs or texts, every 10 updates and at the
start. Speed is to the user-LR trainer's final held-out loss, in updates and in training seconds (evaluations
excluded), interpolated between evaluations; G is the log of the hybrid's speedup over the log of the swept LR's.

    python scripts/trl_check.py sweep --trainer dpo|sft [--seed 0 --learning_rates ...]
    python scripts/trl_check.py run --trainer dpo|sft --swept LR [--seeds 0,1,2]
    python scripts/trl_check.py check --trainer dpo|sft --learning_rates ... [--seed 0]   # never worse
Reports go to docs/reports/{dpo,sft}-check-*.json.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from model_and_data import pretrained_checkpoint, tokenized_corpus
from presets import FINETUNE
from report import SECONDS, time_to

ROOT = Path(__file__).resolve().parent.parent
REPORTS = ROOT / "docs" / "reports"
PROMPT, COMPLETION, SFT_BLOCK = 16, 16, 48  # within the checkpoint's 64 positions
RETOKENIZED_ROOM = 16  # decoded text tokenizes again to about as many tokens, plus TRL's end token
STEPS, BATCH, EVAL_EVERY, EVAL_PAIRS, TRAIN_PAIRS = 100, 8, 10, 64, 1600
STEP = 0  # an evaluation is [step, training seconds, held-out loss], as report.time_to reads it
USER_LR = {"dpo": 1e-6, "sft": 2e-5}  # trl.DPOConfig's and trl.SFTConfig's defaults
SWEEP = {"dpo": "1e-6,1e-5,1e-4,1e-3", "sft": "2e-5,2e-4,1e-3,3e-3,1e-2"}


def training_data(trainer: str):
    """Train and validation data as text, built the same way every time, and the tokenizer."""
    from datasets import Dataset

    from hf_hybrid.data import load_shipped_tokenizer

    tokenizer = load_shipped_tokenizer()
    if trainer == "sft":
        tokenizer.pad_token = tokenizer.eos_token
    blocks = tokenized_corpus("transformers-docs", SFT_BLOCK if trainer == "sft" else PROMPT + COMPLETION)

    def rows(split: str, n: int) -> Dataset:
        ids = blocks[split]["input_ids"][:n]
        if trainer == "sft":
            return Dataset.from_list([{"text": tokenizer.decode(block)} for block in ids])
        return Dataset.from_list([{"prompt": tokenizer.decode(block[:PROMPT]),
                                   "chosen": tokenizer.decode(block[PROMPT:]),
                                   "rejected": tokenizer.decode(ids[(i + 7919) % len(ids)][PROMPT:])}
                                  for i, block in enumerate(ids)])

    return rows("train", TRAIN_PAIRS), rows("validation", EVAL_PAIRS), tokenizer


class Clock:
    """Training seconds per optimizer step (the hybrid's readings included, evaluations not), and each evaluation's
    [updates, training seconds, held-out loss]."""

    def __init__(self) -> None:
        from transformers import TrainerCallback

        clock = self

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                clock.started = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                clock.seconds += time.perf_counter() - clock.started

            def on_evaluate(self, args, state, control, metrics=None, **kwargs):
                clock.evals.append([state.global_step, clock.seconds, metrics["eval_loss"]])

        self.callback, self.seconds, self.started, self.evals = Callback(), 0.0, 0.0, []


def run_arm(trainer: str, arm: str, learning_rate: float, seed: int, data) -> dict:
    import torch
    import trl

    import hf_hybrid

    train, validation, tokenizer = data
    hybrid, name = arm == "hybrid", trainer.upper()
    owner = hf_hybrid if hybrid else trl
    prefix = "Hybrid" if hybrid else ""
    config, trainer_class = getattr(owner, f"{prefix}{name}Config"), getattr(owner, f"{prefix}{name}Trainer")
    torch.manual_seed(seed)
    args = config(output_dir=str(ROOT / "runs" / f"{trainer}-check" / f"{arm}-{learning_rate:g}-seed{seed}"),
                  learning_rate=learning_rate, max_steps=STEPS, per_device_train_batch_size=BATCH,
                  per_device_eval_batch_size=32, eval_strategy="steps", eval_steps=EVAL_EVERY, eval_on_start=True,
                  max_length=(SFT_BLOCK if trainer == "sft" else PROMPT + COMPLETION) + RETOKENIZED_ROOM,
                  logging_steps=10**6, save_strategy="no", report_to="none", seed=seed, data_seed=seed, use_cpu=True,
                  bf16=False, disable_tqdm=True)
    clock = Clock()
    run = trainer_class(model=pretrained_checkpoint(FINETUNE), args=args, train_dataset=train,
                        eval_dataset=validation, processing_class=tokenizer, callbacks=[clock.callback])
    run.train()
    stats = run.hybrid_stats() if hybrid else None
    print(f"{trainer} {arm} lr {learning_rate:g} seed {seed}: final {clock.evals[-1][2]:.4f}, {clock.seconds:.1f} s"
          + (f", scale {stats['lr_scale']:.2f}" if stats else ""), flush=True)
    return {"arm": arm, "learning_rate": learning_rate, "seed": seed, "evals": clock.evals,
            "train_seconds": clock.seconds, "hybrid_stats": stats}


def speedups(baseline: dict, arm: dict) -> tuple[float, float] | None:
    """The arm's speedup over the baseline to the baseline's final held-out loss: (updates, seconds)."""
    target, base = baseline["evals"][-1][2], baseline["evals"][-1]
    at = [time_to(arm["evals"], target, column) for column in (STEP, SECONDS)]
    return None if at[0] is None else (base[STEP] / at[0], base[SECONDS] / at[1])


def sweep(args) -> None:
    data = training_data(args.trainer)
    results = [run_arm(args.trainer, "baseline", lr, args.seed, data)
               for lr in map(float, (args.learning_rates or SWEEP[args.trainer]).split(","))]
    path = REPORTS / f"{args.trainer}-check-sweep-seed{args.seed}.json"
    kept = json.loads(path.read_text())["arms"] if path.exists() else []
    new = {r["learning_rate"] for r in results}
    results = sorted([r for r in kept if r["learning_rate"] not in new] + results, key=lambda r: r["learning_rate"])
    path.write_text(json.dumps({"behaviour_version": behaviour_version(), "arms": results}, indent=1))
    for r in results:
        print(f"{r['learning_rate']:g}: {r['evals'][-1][2]:.4f}")
    print(f"wrote {path.relative_to(ROOT)}")


def run(args) -> None:
    data, user = training_data(args.trainer), USER_LR[args.trainer]
    for seed in map(int, args.seeds.split(",")):
        arms = [run_arm(args.trainer, arm, lr, seed, data)
                for arm, lr in (("baseline", user), ("hybrid", user), ("swept", args.swept))]
        baseline = arms[0]
        summary = {arm["arm"]: speedups(baseline, arm) for arm in arms[1:]}
        hybrid, swept = summary["hybrid"], summary["swept"]
        g = [math.log(h) / math.log(s) if h and s and s > 1 else None for h, s in zip(hybrid or (), swept or ())]
        summary.update(g=g, final={arm["arm"]: arm["evals"][-1][2] for arm in arms})
        path = REPORTS / f"{args.trainer}-check-v{behaviour_version()}-seed{seed}.json"
        path.write_text(json.dumps({"behaviour_version": behaviour_version(), "summary": summary, "arms": arms},
                                   indent=1))
        print(json.dumps(summary), f"-> {path.relative_to(ROOT)}", flush=True)


def check(args) -> None:
    """Never worse: the hybrid against the plain run at each LR, same seed; the plain run is the sweep's where it
    has one (the same arm)."""
    data = training_data(args.trainer)
    swept = REPORTS / f"{args.trainer}-check-sweep-seed{args.seed}.json"
    plain = {r["learning_rate"]: r for r in json.loads(swept.read_text())["arms"]} if swept.exists() else {}
    rows = []
    for lr in map(float, args.learning_rates.split(",")):
        baseline = plain.get(lr) or run_arm(args.trainer, "baseline", lr, args.seed, data)
        hybrid = run_arm(args.trainer, "hybrid", lr, args.seed, data)
        rows.append({"learning_rate": lr, "hybrid_minus_trainer": hybrid["evals"][-1][2] - baseline["evals"][-1][2],
                     "bit_for_bit": [e[2] for e in hybrid["evals"]] == [e[2] for e in baseline["evals"]],
                     "hybrid": hybrid})
        print(f"{lr:g}: hybrid - Trainer {rows[-1]['hybrid_minus_trainer']:+.4f}"
              f"{' (every evaluation bit for bit)' if rows[-1]['bit_for_bit'] else ''}", flush=True)
    path = REPORTS / f"{args.trainer}-check-v{behaviour_version()}-never-worse-seed{args.seed}.json"
    path.write_text(json.dumps({"behaviour_version": behaviour_version(), "checks": rows}, indent=1))
    print(f"wrote {path.relative_to(ROOT)}")


def behaviour_version() -> int:
    from hf_hybrid import BEHAVIOUR_VERSION

    return BEHAVIOUR_VERSION


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    s = commands.add_parser("sweep")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--learning_rates", default=None, help="default: SWEEP[trainer]")
    r = commands.add_parser("run")
    r.add_argument("--swept", type=float, required=True)
    r.add_argument("--seeds", default="0,1,2")
    c = commands.add_parser("check")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--learning_rates", required=True)
    for command in (s, r, c):
        command.add_argument("--trainer", choices=sorted(USER_LR), required=True)
    args = parser.parse_args()
    {"sweep": sweep, "run": run, "check": check}[args.command](args)


if __name__ == "__main__":
    main()
