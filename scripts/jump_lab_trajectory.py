"""jump_lab.py's training and trajectories: the preset's model trained in a plain loop as the Trainer would train it
(its optimizer groups, learning-rate schedule and batch order), held-out loss, and the `record` command, which keeps
the trainable weights every few steps."""

from __future__ import annotations

import copy
import json

import torch
from model_and_data import build_model_and_data
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

PRESET: dict = {}  # the --preset's settings with the command line's overrides, filled in by jump_lab.main
LRS: list[float] = []  # the recorded run's schedule, set by `record` and by whatever loads its trajectory


def build(seed: int):
    model, data, eval_set = build_model_and_data(PRESET, seed)
    train = torch.tensor(data["train"][:]["input_ids"])  # a slice: a column is read row by row
    held_out = torch.tensor(eval_set[:]["input_ids"])
    return model, train, held_out


def trainable(model) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def make_optimizer(model) -> torch.optim.Optimizer:
    # As the Trainer builds it: no weight decay on biases and LayerNorm weights.
    decay = [p for p in trainable(model) if p.dim() >= 2]
    no_decay = [p for p in trainable(model) if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": PRESET["weight_decay"]},
                              {"params": no_decay, "weight_decay": 0.0}], lr=PRESET["learning_rate"])


def schedule(total_steps: int) -> list[float]:
    """The preset's learning rate at each step of a `total_steps` run, as the Trainer's scheduler gives it."""
    from transformers import get_scheduler

    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=PRESET["learning_rate"])
    scheduler = get_scheduler(PRESET.get("scheduler", "constant_with_warmup"), optimizer, PRESET["warmup_steps"],
                              total_steps, scheduler_specific_kwargs=PRESET.get("scheduler_kwargs", {}))
    lrs = []
    for _ in range(total_steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def lr_at(step: int) -> float:
    return LRS[step] if step < len(LRS) else LRS[-1]


def batch_order(n: int, steps: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1)
    per_epoch = n // PRESET["batch_size"]
    perms = [torch.randperm(n, generator=g)[: per_epoch * PRESET["batch_size"]] for _ in range(steps // per_epoch + 1)]
    return torch.cat(perms).view(-1, PRESET["batch_size"])[:steps]


def train_steps(model, optimizer, train, order, start: int, stop: int, on_step=None) -> None:
    model.train()
    for step in range(start, stop):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        ids = train[order[step]]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable(model), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if on_step is not None:
            on_step(step + 1)


@torch.no_grad()
def held_out_loss(model, held_out: torch.Tensor) -> float:
    model.eval()
    losses = [model(input_ids=b, labels=b).loss for b in held_out.split(32)]
    model.train()
    return float(torch.stack(losses).mean())


def record(args) -> None:
    torch.set_num_threads(2)
    model, train, held_out = build(args.seed)
    optimizer = make_optimizer(model)
    LRS[:] = schedule(args.steps)
    order = batch_order(len(train), args.steps, args.seed)
    n_snap = args.steps // args.every + 1
    snaps = torch.empty(n_snap, sum(p.numel() for p in trainable(model)))
    snaps[0] = parameters_to_vector(trainable(model)).detach()
    optimizer_states = {}
    keep_optimizer = {int(s) for s in args.optimizer_at.split(",")}

    def on_step(step: int) -> None:
        if step % args.every == 0:
            snaps[step // args.every] = parameters_to_vector(trainable(model)).detach()
        if step in keep_optimizer:
            optimizer_states[step] = copy.deepcopy(optimizer.state_dict())
        if step % 50 == 0:
            print(f"step {step}", flush=True)

    train_steps(model, optimizer, train, order, 0, args.steps, on_step)
    curve = []
    for i in range(n_snap):
        vector_to_parameters(snaps[i], trainable(model))
        curve.append(held_out_loss(model, held_out))
    torch.save({"seed": args.seed, "every": args.every, "batch_size": PRESET["batch_size"], "snaps": snaps,
                "curve": curve, "optimizer_states": optimizer_states, "lrs": LRS,
                "learning_rate": PRESET["learning_rate"]}, args.out)
    print(json.dumps({"curve": [round(c, 4) for c in curve]}))


def spaced_states(snaps: torch.Tensor, i: int, stride: int, ctx: int) -> torch.Tensor | None:
    """`ctx` snapshots `stride` apart ending at `i`, oldest first; None before there are enough."""
    first = i - (ctx - 1) * stride
    return snaps[first: i + 1: stride] if first >= 0 else None
