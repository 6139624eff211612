"""How far the LR autopilot's verdict can see (issue 49). A raise is judged against where the user's LR would have
taken the weights, estimated as W0 + (W - W0) / raise from the undo point W0 (hf_hybrid/autopilot/verdict.py). This
measures that estimate against the user's LR's real path as the horizon grows, on the short-horizon trap of
tests/test_lr_cooldown.py: a tiny GPT-2 from scratch at a constant LR, where twice the LR leads early and ends higher.

    python scripts/verdict_horizon.py --out docs/reports/issue49-verdict-horizon.json

Two plain Trainer runs with the same init and data order: one at the user's LR throughout, one raised at `--raise_at`.
At each horizon: the held-out loss of the raised weights W, of the estimate, and of the user's real weights.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from datasets import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

VOCAB, BLOCK = 64, 16


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=BLOCK, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def counting(n: int, seed: int) -> Dataset:
    """Sequences that count up modulo a random stride (the tests' `token_dataset`)."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, VOCAB, (n, 1), generator=g)
    strides = torch.randint(1, 4, (n, 1), generator=g)
    ids = (starts + strides * torch.arange(BLOCK)) % VOCAB
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--learning_rate", type=float, default=4e-3)
    parser.add_argument("--raise_factor", type=float, default=2.0)
    parser.add_argument("--raise_at", type=int, default=30)
    parser.add_argument("--max_steps", type=int, default=400)
    parser.add_argument("--out", default="runs/verdict-horizon.json")
    args = parser.parse_args()
    train, held = counting(512, 0), torch.tensor(counting(128, 1)[:]["input_ids"])
    horizons = sorted({args.raise_at + h for h in (10, 20, 40, 80)} | set(range(80, args.max_steps + 1, 40)))

    def held_loss(model) -> float:
        with torch.no_grad():
            return float(model(input_ids=held, labels=held).loss)

    class Watch(TrainerCallback):
        def __init__(self, raised: bool) -> None:
            self.raised, self.rows, self.start = raised, {}, None

        def on_step_end(self, args_, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
            step = state.global_step
            if self.raised and step == args.raise_at:
                self.start = [p.detach().clone() for p in model.parameters()]
                lr_scheduler.base_lrs = [b * args.raise_factor for b in lr_scheduler.base_lrs]
                for group in optimizer.param_groups:
                    group["lr"] *= args.raise_factor
            if step not in horizons:
                return
            row = {"weights": held_loss(model)}
            if self.raised:
                now = [p.detach().clone() for p in model.parameters()]
                with torch.no_grad():
                    for p, w0, w in zip(model.parameters(), self.start, now):
                        p.copy_(w0 + (w - w0) / args.raise_factor)
                row["estimate_of_user"] = held_loss(model)
                with torch.no_grad():
                    for p, w in zip(model.parameters(), now):
                        p.copy_(w)
            self.rows[step] = row

    runs = {}
    for raised in (True, False):
        watch = Watch(raised)
        trainer = Trainer(model=tiny_gpt2(), train_dataset=train, callbacks=[watch], args=TrainingArguments(
            output_dir="runs/verdict-horizon", learning_rate=args.learning_rate, per_device_train_batch_size=4,
            max_steps=args.max_steps, warmup_steps=10, lr_scheduler_type="constant_with_warmup", weight_decay=0.1,
            logging_steps=1000, save_strategy="no", report_to="none", seed=0, data_seed=0, use_cpu=True,
            disable_tqdm=True))
        trainer.train()
        runs["raised" if raised else "user"] = watch.rows
    rows = [{"step": s, "horizon": s - args.raise_at, "raised": runs["raised"][s]["weights"],
             "estimate_of_user": runs["raised"][s]["estimate_of_user"], "user": runs["user"][s]["weights"]}
            for s in horizons]
    for r in rows:
        print(f"step {r['step']:4d}  raised {r['raised']:.3f}  estimate of the user's {r['estimate_of_user']:.3f}"
              f"  the user's real {r['user']:.3f}  verdict's gain {r['estimate_of_user'] - r['raised']:+.3f}"
              f"  real gain {r['user'] - r['raised']:+.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"settings": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
