"""jump_lab.py's learned per-weight nowcaster (WNN-style): its features and training samples from recorded
trajectories, the `nowcaster` command that fits it, and the loader that turns a fitted one into the oracle's jump
candidates."""

from __future__ import annotations

import json

import torch
from jump_lab_trajectory import PRESET, build, spaced_states, trainable
from torch import nn


class Nowcaster(nn.Module):
    """Per weight: its moves to the current state from each of the `ctx - 1` earlier states (in units of its tensor's
    RMS last move), and the ratio of the learning rate ahead to the one behind; out: its move over the horizon."""

    def __init__(self, ctx: int, hidden: int = 32) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(ctx, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                                 nn.Linear(hidden, 1))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net(features).squeeze(-1)


def features(states: torch.Tensor, sizes: list[int], lr_ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`states`: [ctx, P] flat weights, oldest first. Returns per-weight features [P, ctx] and the per-weight scale
    [P] (its tensor's RMS move between the last two states)."""
    now = states[-1]
    moves = torch.stack([now - states[-1 - k] for k in range(1, states.shape[0])], dim=1)
    scale = torch.empty_like(now)
    start = 0
    for n in sizes:
        span = moves[start: start + n, 0]
        scale[start: start + n] = span.pow(2).mean().sqrt().clamp_min(1e-12)
        start += n
    ratio = torch.full((now.shape[0], 1), lr_ratio)
    return torch.cat([moves / scale[:, None], ratio], dim=1), scale


def lr_ratio(lrs: list[float], step: int, spacing: int, horizon: int) -> float:
    """Mean learning rate over the horizon ahead over that of the last spacing: a decay shrinks the move to come."""
    behind = lrs[max(step - spacing, 0): step] or [lrs[0]]
    ahead = lrs[step: step + horizon] or [lrs[-1]]
    return (sum(ahead) / len(ahead)) / max(sum(behind) / len(behind), 1e-12)


def samples(traj: dict, sizes: list[int], spacing: int, ctx: int, horizon: int, per_step: int,
            generator: torch.Generator):
    snaps, every, lrs = traj["snaps"], traj["every"], traj["lrs"]
    stride, ahead = spacing // every, horizon // every
    xs, ys = [], []
    first = (ctx - 1) * stride + -(-PRESET["warmup_steps"] // every)  # a history that starts after the LR warmup
    for i in range(first, snaps.shape[0] - ahead):
        x, scale = features(spaced_states(snaps, i, stride, ctx), sizes, lr_ratio(lrs, i * every, spacing, horizon))
        y = (snaps[i + ahead] - snaps[i]) / scale
        pick = torch.randint(0, x.shape[0], (per_step,), generator=generator)
        xs.append(x[pick])
        ys.append(y[pick])
    return torch.cat(xs), torch.cat(ys)


def nowcaster(args) -> None:
    """Fit the per-weight nowcaster on recorded trajectories; report its fit against the best constant gain on the
    last move, and, with --held_out, on trajectories it was not trained on."""
    torch.manual_seed(0)
    model, _, _ = build(0)
    sizes = [p.numel() for p in trainable(model)]
    g = torch.Generator().manual_seed(0)

    def load(paths):
        x, y = zip(*(samples(torch.load(p, weights_only=False), sizes, args.spacing, args.ctx, args.horizon,
                             args.per_step, g) for p in paths))
        return torch.cat(x), torch.cat(y)

    x, y = load(args.trajectories)
    perm = torch.randperm(len(x), generator=g)
    cut = len(x) // 10
    val, fit = perm[:cut], perm[cut:]
    net = Nowcaster(args.ctx)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=0.0)
    for _ in range(args.epochs):
        for batch in fit[torch.randperm(len(fit), generator=g)].split(4096):
            loss = nn.functional.mse_loss(net(x[batch]), y[batch])
            opt.zero_grad()
            loss.backward()
            opt.step()

    @torch.no_grad()
    def scores(x, y) -> dict:
        last = x[:, 0]
        gain = float((last * y).sum() / (last * last).sum())
        return {"mse": float(nn.functional.mse_loss(net(x), y)),
                "best_constant_gain_mse": float(nn.functional.mse_loss(gain * last, y)),
                "constant_gain": gain, "zero_mse": float(y.pow(2).mean())}

    report = {"samples": len(x), "validation": scores(x[val], y[val])}
    if args.held_out:
        report["held_out"] = scores(*load(args.held_out))
    torch.save({"state_dict": net.state_dict(), "horizon": args.horizon, "spacing": args.spacing, "ctx": args.ctx},
               args.out)
    print(json.dumps(report))


def load_nowcaster(path: str, sizes: list[int], lrs: list[float]):
    """The oracle's nowcast candidates at snapshot `i`: the full predicted move and half of it."""
    saved = torch.load(path, weights_only=False)
    spacing, ctx, h = saved["spacing"], saved["ctx"], saved["horizon"]
    net = Nowcaster(ctx)
    net.load_state_dict(saved["state_dict"])

    @torch.no_grad()
    def nowcast(snaps: torch.Tensor, i: int, every: int) -> dict[str, torch.Tensor]:
        states = spaced_states(snaps, i, spacing // every, ctx)
        if states is None:
            return {}
        x, scale = features(states, sizes, lr_ratio(lrs, i * every, spacing, h))
        move = torch.cat([net(chunk) for chunk in x.split(1 << 20)]) * scale
        name = f"nowcast{spacing}x{ctx}+{h}"
        return {name: snaps[i] + move, f"{name}/2": snaps[i] + 0.5 * move}

    return nowcast
