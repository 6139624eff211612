"""jump_lab.py's `split` command: the tied embedding / LM head's update predicted or skipped on every few steps,
timed side by side with a plain loop."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from jump_lab_trajectory import LRS, batch_order, build, held_out_loss, lr_at, make_optimizer, schedule


def split(args) -> None:
    """Per-tensor split: on every `--split_every`-th step the tied embedding / LM head (most of this model's
    compute) gets no weight gradient; its update is predicted (EMA of its recent real updates) or skipped.
    Both arms run in this process, alternating in blocks, timed without evaluation."""
    torch.set_num_threads(2)
    LRS[:] = schedule(args.steps)
    arms = {}
    for name in ("baseline", f"split-{args.predictor}"):
        model, train, held_out = build(args.seed)
        arms[name] = dict(model=model, optimizer=make_optimizer(model), seconds=0.0, evals=[],
                          velocity=torch.zeros_like(model.transformer.wte.weight), seen=0)
    order = batch_order(len(train), args.steps, args.seed)
    for start in range(0, args.steps, args.eval_every):
        for name, arm in arms.items():
            model, optimizer, wte = arm["model"], arm["optimizer"], arm["model"].transformer.wte.weight
            model.train()
            t0 = time.perf_counter()
            for step in range(start, start + args.eval_every):
                predicted = name != "baseline" and step >= args.split_from and step % args.split_every == 0
                for group in optimizer.param_groups:
                    group["lr"] = lr_at(step)
                wte.requires_grad_(not predicted)
                ids = train[order[step]]
                model(input_ids=ids, labels=ids).loss.backward()
                torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 1.0)
                before = wte.detach().clone() if not predicted and name != "baseline" else None
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                wte.requires_grad_(True)
                with torch.no_grad():
                    if before is not None:
                        arm["velocity"].mul_(0.9).add_(wte - before, alpha=0.1)
                        arm["seen"] += 1
                    elif predicted and args.predictor == "velocity" and arm["seen"]:  # none seen: none to repeat
                        wte.add_(arm["velocity"] / (1 - 0.9 ** arm["seen"]))
            arm["seconds"] += time.perf_counter() - t0
            arm["evals"].append([start + args.eval_every, arm["seconds"], held_out_loss(model, held_out)])
            print(json.dumps({"arm": name, "eval": arm["evals"][-1]}), flush=True)
    report = {name: arm["evals"] for name, arm in arms.items()}
    Path(args.report).write_text(json.dumps(report, indent=1))
