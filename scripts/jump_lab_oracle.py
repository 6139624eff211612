"""jump_lab.py's `oracle` command: the candidate jump targets at a recorded step (tail means, line fits and their
extrapolations, the nowcaster's forecasts), where each lands on the held-out curve in baseline steps, and with
`--train_on` whether the gain survives training on from the jumped point."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from jump_lab_nowcaster import load_nowcaster
from jump_lab_trajectory import (
    LRS,
    PRESET,
    batch_order,
    build,
    held_out_loss,
    make_optimizer,
    spaced_states,
    train_steps,
    trainable,
)
from torch.nn.utils import vector_to_parameters


def equivalent_step(curve: list[float], every: int, loss: float) -> float:
    """The baseline step at which the held-out curve (monotone envelope) first reaches `loss`."""
    best = float("inf")
    envelope = []
    for c in curve:
        best = min(best, c)
        envelope.append(best)
    if loss >= envelope[0]:
        return 0.0
    for i in range(1, len(envelope)):
        if envelope[i] <= loss:
            lo, hi = envelope[i - 1], envelope[i]
            frac = (lo - loss) / (lo - hi) if lo > hi else 1.0
            return (i - 1 + frac) * every
    return float("inf")


def line_fit(window: torch.Tensor, at: float) -> torch.Tensor:
    """Least-squares line through the rows of `window` (equally spaced, x = 0..n-1), evaluated at x = `at`."""
    n = window.shape[0]
    x = torch.arange(n, dtype=window.dtype)
    xm = x.mean()
    slope = ((x - xm)[:, None] * (window - window.mean(0))).sum(0) / ((x - xm) ** 2).sum()
    return window.mean(0) + slope * (at - xm)


def candidates(snaps: torch.Tensor, i: int, every: int, long: tuple = ()) -> dict[str, torch.Tensor]:
    """Jump targets at snapshot `i`. `long`: (spacing, ctx, horizons) for line fits through `ctx` states `spacing`
    steps apart, extrapolated `horizons` steps ahead (a long-horizon nowcast from widely spaced states)."""
    out = {"iterate": snaps[i]}
    for window_steps in (20, 40, 80):
        n = window_steps // every + 1
        if n < 2 or i + 1 < n:  # a window of one snapshot has no line through it
            continue
        window = snaps[i + 1 - n: i + 1]
        out[f"mean{window_steps}"] = window.mean(0)
        out[f"line{window_steps}@now"] = line_fit(window, n - 1)
        for ahead in (10, 20, 40):
            out[f"line{window_steps}+{ahead}"] = line_fit(window, n - 1 + ahead / every)
    if long:
        spacing, ctx, horizons = long
        states = spaced_states(snaps, i, spacing // every, ctx)
        if states is not None:
            out[f"mean{spacing}x{ctx}"] = states.mean(0)
            for ahead in horizons:
                out[f"line{spacing}x{ctx}+{ahead}"] = line_fit(states, ctx - 1 + ahead / spacing)
    return out


def jump_targets(snaps: torch.Tensor, i: int, every: int, long: tuple, nowcasts: list) -> dict[str, torch.Tensor]:
    """`candidates`, plus each loaded nowcaster's forecasts."""
    found = candidates(snaps, i, every, long)
    for nowcast in nowcasts:
        found.update(nowcast(snaps, i, every))
    return found


def oracle(args) -> None:
    torch.set_num_threads(2)
    traj = torch.load(args.trajectory, weights_only=False)
    snaps, curve, every = traj["snaps"], traj["curve"], traj["every"]
    LRS[:] = traj["lrs"]
    model, train, held_out = build(traj["seed"])
    sizes = [p.numel() for p in trainable(model)]
    nowcasts = [load_nowcaster(path, sizes, LRS) for path in args.nowcaster]
    long = (args.spacing, args.ctx, [int(h) for h in args.horizons.split(",")]) if args.horizons else ()
    rows = []
    for t in (int(s) for s in args.at.split(",")):
        i = t // every
        found = jump_targets(snaps, i, every, long, nowcasts)
        for name, weights in found.items():
            vector_to_parameters(weights, trainable(model))
            loss = held_out_loss(model, held_out)
            rows.append({"step": t, "candidate": name, "loss": round(loss, 4),
                         "gain_steps": round(equivalent_step(curve, every, loss) - t, 1)})
            print(json.dumps(rows[-1]), flush=True)
    if args.train_on:
        rows += train_on(args, traj, model, train, held_out, long, nowcasts)
    Path(args.report).write_text(json.dumps(rows, indent=1))


def train_on(args, traj, model, train, held_out, long, nowcasts) -> list[dict]:
    """From a jumped point with the optimizer state of that step, train on: is the gain kept? With `--advance k`
    the jump is kept the way the trainer keeps one: the step count, the schedule and the data move on by k, so the
    run has made k real steps fewer at every step after it. `gain_steps` counts real steps saved."""
    snaps, curve, every = traj["snaps"], traj["curve"], traj["every"]
    PRESET["batch_size"] = traj.get("batch_size", PRESET["batch_size"])  # train on with the recorded batches
    order = batch_order(len(train), len(curve) * every, traj["seed"])
    rows = []
    for t, state in sorted(traj["optimizer_states"].items()):
        i = t // every
        found = jump_targets(snaps, i, every, long, nowcasts)
        for name in args.train_on.split(","):
            vector_to_parameters(found[name], trainable(model))
            optimizer = make_optimizer(model)
            optimizer.load_state_dict(state)
            after = {}

            def on_step(step: int, after: dict = after) -> None:
                if step % 10 == 0 and step % args.eval_every == 0:
                    after[step] = held_out_loss(model, held_out)

            start = t + args.advance
            train_steps(model, optimizer, train, order, start,
                        min(start + args.train_for, (len(curve) - 1) * every), on_step)
            for step, loss in after.items():
                rows.append({"step": t, "candidate": name, "advance": args.advance, "trained_to": step,
                             "loss": round(loss, 4), "baseline_loss": round(curve[step // every], 4),
                             "gain_steps": round(equivalent_step(curve, every, loss) - (step - args.advance), 1)})
                print(json.dumps(rows[-1]), flush=True)
    return rows
