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

The numbers are in docs/benchmarks.md; nothing here is part of the library.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

sys.path.insert(0, str(Path(__file__).parent))
from benchmark import PRESETS, build_model_and_data  # noqa: E402

PRESET = PRESETS["cpu-small"]  # --preset smoke swaps it, for the smoke test


def build(seed: int):
    model, data, eval_set = build_model_and_data(PRESET, seed)
    train = torch.tensor(data["train"]["input_ids"])
    held_out = torch.tensor(eval_set["input_ids"])
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


LRS: list[float] = []  # the recorded run's schedule, set by `record` and by whatever loads its trajectory


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


def spaced_states(snaps: torch.Tensor, i: int, stride: int, ctx: int) -> torch.Tensor | None:
    """`ctx` snapshots `stride` apart ending at `i`, oldest first; None before there are enough."""
    first = i - (ctx - 1) * stride
    return snaps[first: i + 1: stride] if first >= 0 else None


# ---- a learned per-weight nowcaster (WNN-style) ----------------------------------------------------


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


def split(args) -> None:
    """Per-tensor split: on every `--split_every`-th step the tied embedding / LM head (most of this model's
    compute) gets no weight gradient; its update is predicted (EMA of its recent real updates) or skipped.
    Both arms run in this process, alternating in blocks, timed without evaluation."""
    import time

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
                    elif predicted and args.predictor == "velocity":
                        wte.add_(arm["velocity"] / (1 - 0.9 ** arm["seen"]))
            arm["seconds"] += time.perf_counter() - t0
            arm["evals"].append([start + args.eval_every, arm["seconds"], held_out_loss(model, held_out)])
            print(json.dumps({"arm": name, "eval": arm["evals"][-1]}), flush=True)
    report = {name: arm["evals"] for name, arm in arms.items()}
    Path(args.report).write_text(json.dumps(report, indent=1))


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
    global PRESET
    PRESET = dict(PRESETS[args.preset])
    if args.batch_size:
        PRESET["batch_size"] = args.batch_size
    if args.learning_rate:
        PRESET["learning_rate"] = args.learning_rate
    {"record": record, "nowcaster": nowcaster, "oracle": oracle, "split": split}[args.command](args)


if __name__ == "__main__":
    main()
