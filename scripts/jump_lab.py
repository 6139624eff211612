"""Offline experiments on the cpu-small task: what would a jump be worth, before building one into the library?

    python scripts/jump_lab.py record --seed 0 --out /tmp/traj0.pt      # train, keep all weights every 5 steps
    python scripts/jump_lab.py nowcaster --trajectories /tmp/traj0.pt --out /tmp/nowcaster.pt
    python scripts/jump_lab.py oracle --trajectory /tmp/traj0.pt --nowcaster /tmp/nowcaster.pt \
        --train_on mean40,line40@now,line80+20                          # held-out value of candidate jumps
    python scripts/jump_lab.py split --predictor velocity               # per-tensor split, timed A/B

- `record` trains the cpu-small model (the benchmark preset's config, optimizer settings and schedule) in a
  plain loop and keeps all weights every `--every` steps, plus the optimizer state at a few steps.
- `nowcaster` fits a WNN-style per-weight MLP on recorded trajectories: a weight's last moves in, its move
  over the next `--horizon` steps out.
- `oracle` measures on the benchmark's held-out blocks where candidate jump targets land (tail means, line
  fits and their extrapolations, the nowcaster's forecast) in units of baseline steps, and with
  `--train_on` whether the gain survives training on from the jumped point.
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
from benchmark import PRESETS  # noqa: E402

PRESET = PRESETS["cpu-small"]  # --preset smoke swaps it, for the smoke test


def build(seed: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_hybrid.data import build_lm_datasets, load_shipped_corpus, load_shipped_tokenizer

    tokenizer = load_shipped_tokenizer()
    data = build_lm_datasets(load_shipped_corpus(), tokenizer, PRESET["block_size"])
    train = torch.tensor(data["train"]["input_ids"])
    held_out = torch.tensor(data["validation"]["input_ids"][: PRESET["eval_blocks"]])
    config = GPT2Config(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id, **PRESET["model"])
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config), train, held_out


def make_optimizer(model) -> torch.optim.Optimizer:
    # As the Trainer builds it: no weight decay on biases and LayerNorm weights.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": PRESET["weight_decay"]},
                              {"params": no_decay, "weight_decay": 0.0}], lr=PRESET["learning_rate"])


def lr_at(step: int) -> float:
    return PRESET["learning_rate"] * min(1.0, (step + 1) / PRESET["warmup_steps"])


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
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
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
    order = batch_order(len(train), args.steps, args.seed)
    n_snap = args.steps // args.every + 1
    snaps = torch.empty(n_snap, sum(p.numel() for p in model.parameters()))
    snaps[0] = parameters_to_vector(model.parameters()).detach()
    optimizer_states = {}
    keep_optimizer = {int(s) for s in args.optimizer_at.split(",")}

    def on_step(step: int) -> None:
        if step % args.every == 0:
            snaps[step // args.every] = parameters_to_vector(model.parameters()).detach()
        if step in keep_optimizer:
            optimizer_states[step] = copy.deepcopy(optimizer.state_dict())
        if step % 50 == 0:
            print(f"step {step}", flush=True)

    train_steps(model, optimizer, train, order, 0, args.steps, on_step)
    curve = []
    for i in range(n_snap):
        vector_to_parameters(snaps[i], model.parameters())
        curve.append(held_out_loss(model, held_out))
    torch.save({"seed": args.seed, "every": args.every, "batch_size": PRESET["batch_size"], "snaps": snaps,
                "curve": curve, "optimizer_states": optimizer_states}, args.out)
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


def candidates(snaps: torch.Tensor, i: int, every: int, nowcaster=None) -> dict[str, torch.Tensor]:
    out = {"iterate": snaps[i]}
    for window_steps in (20, 40, 80):
        n = window_steps // every + 1
        if i + 1 < n:
            continue
        window = snaps[i + 1 - n: i + 1]
        out[f"mean{window_steps}"] = window.mean(0)
        out[f"line{window_steps}@now"] = line_fit(window, n - 1)
        for ahead in (10, 20, 40):
            out[f"line{window_steps}+{ahead}"] = line_fit(window, n - 1 + ahead / every)
    if nowcaster is not None:
        out.update(nowcaster(snaps, i, every))
    return out


# ---- a learned per-weight nowcaster (WNN-style) ----------------------------------------------------

HISTORY = 4


class Nowcaster(nn.Module):
    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(HISTORY, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                                 nn.Linear(hidden, 1))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net(features).squeeze(-1)


def features(window: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`window`: [HISTORY + 1, P] flat weights, oldest first. Returns per-weight features [P, HISTORY] and the
    per-weight scale [P] (its tensor's RMS move over the window)."""
    now = window[-1]
    moves = torch.stack([now - window[-1 - k] for k in range(1, HISTORY + 1)], dim=1)
    scale = torch.empty_like(now)
    start = 0
    for n in sizes:
        span = moves[start: start + n, -1]
        scale[start: start + n] = span.pow(2).mean().sqrt().clamp_min(1e-12)
        start += n
    return moves / scale[:, None], scale


def samples(traj: dict, sizes: list[int], horizon: int, per_step: int, generator: torch.Generator):
    snaps, every = traj["snaps"], traj["every"]
    ahead = horizon // every
    xs, ys = [], []
    first = HISTORY + -(-PRESET["warmup_steps"] // every)  # a history that starts after the LR warmup
    for i in range(first, snaps.shape[0] - ahead):
        x, scale = features(snaps[i - HISTORY: i + 1], sizes)
        y = (snaps[i + ahead] - snaps[i]) / scale
        pick = torch.randint(0, x.shape[0], (per_step,), generator=generator)
        xs.append(x[pick])
        ys.append(y[pick])
    return torch.cat(xs), torch.cat(ys)


def nowcaster(args) -> None:
    """Fit the per-weight nowcaster on recorded trajectories; report its fit against the best constant gain."""
    torch.manual_seed(0)
    model, _, _ = build(0)
    sizes = [p.numel() for p in model.parameters()]
    g = torch.Generator().manual_seed(0)
    x, y = zip(*(samples(torch.load(p, weights_only=False), sizes, args.horizon, args.per_step, g)
                 for p in args.trajectories))
    x, y = torch.cat(x), torch.cat(y)
    perm = torch.randperm(len(x), generator=g)
    cut = len(x) // 10
    val, fit = perm[:cut], perm[cut:]
    net = Nowcaster()
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=0.0)
    for _ in range(args.epochs):
        for batch in fit[torch.randperm(len(fit), generator=g)].split(4096):
            loss = nn.functional.mse_loss(net(x[batch]), y[batch])
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        last = x[val][:, -1]
        gain = float((last * y[val]).sum() / (last * last).sum())
        report = {"val_mse": float(nn.functional.mse_loss(net(x[val]), y[val])),
                  "best_constant_gain_mse": float(nn.functional.mse_loss(gain * last, y[val])),
                  "constant_gain": gain, "zero_mse": float(y[val].pow(2).mean()), "samples": len(x)}
    torch.save({"state_dict": net.state_dict(), "horizon": args.horizon}, args.out)
    print(json.dumps(report))


def load_nowcaster(path: str, sizes: list[int]):
    """The oracle's nowcast candidates at snapshot `i`: the full predicted move and half of it."""
    saved = torch.load(path, weights_only=False)
    net = Nowcaster()
    net.load_state_dict(saved["state_dict"])

    @torch.no_grad()
    def nowcast(snaps: torch.Tensor, i: int, every: int) -> dict[str, torch.Tensor]:
        if i < HISTORY:
            return {}
        x, scale = features(snaps[i - HISTORY: i + 1], sizes)
        move = torch.cat([net(chunk) for chunk in x.split(1 << 20)]) * scale
        h = saved["horizon"]
        return {f"nowcast+{h}": snaps[i] + move, f"nowcast+{h}/2": snaps[i] + 0.5 * move}

    return nowcast


def oracle(args) -> None:
    torch.set_num_threads(2)
    traj = torch.load(args.trajectory, weights_only=False)
    snaps, curve, every = traj["snaps"], traj["curve"], traj["every"]
    model, train, held_out = build(traj["seed"])
    sizes = [p.numel() for p in model.parameters()]
    nowcast = load_nowcaster(args.nowcaster, sizes) if args.nowcaster else None
    rows = []
    for t in (int(s) for s in args.at.split(",")):
        i = t // every
        for name, weights in candidates(snaps, i, every, nowcast).items():
            vector_to_parameters(weights, model.parameters())
            loss = held_out_loss(model, held_out)
            rows.append({"step": t, "candidate": name, "loss": round(loss, 4),
                         "gain_steps": round(equivalent_step(curve, every, loss) - t, 1)})
            print(json.dumps(rows[-1]), flush=True)
    if args.train_on:
        rows += train_on(args, traj, model, train, held_out)
    Path(args.report).write_text(json.dumps(rows, indent=1))


def train_on(args, traj, model, train, held_out) -> list[dict]:
    """From a jumped point with the optimizer state of that step, train on: is the gain kept?"""
    snaps, curve, every = traj["snaps"], traj["curve"], traj["every"]
    PRESET["batch_size"] = traj.get("batch_size", PRESET["batch_size"])  # train on with the recorded batches
    order = batch_order(len(train), len(curve) * every, traj["seed"])
    rows = []
    for t, state in sorted(traj["optimizer_states"].items()):
        i = t // every
        for name in args.train_on.split(","):
            weights = candidates(snaps, i, every)[name]
            vector_to_parameters(weights, model.parameters())
            optimizer = make_optimizer(model)
            optimizer.load_state_dict(state)
            after = {}

            def on_step(step: int, after: dict = after) -> None:
                if step % 10 == 0:
                    after[step] = held_out_loss(model, held_out)

            train_steps(model, optimizer, train, order, t, min(t + 40, len(curve) * every - every), on_step)
            for step, loss in after.items():
                rows.append({"step": t, "candidate": name, "trained_to": step, "loss": round(loss, 4),
                             "baseline_loss": round(curve[step // every], 4),
                             "gain_steps": round(equivalent_step(curve, every, loss) - step, 1)})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def split(args) -> None:
    """Per-tensor split: on every `--split_every`-th step the tied embedding / LM head (most of this model's
    compute) gets no weight gradient; its update is predicted (EMA of its recent real updates) or skipped.
    Both arms run in this process, alternating in blocks, timed without evaluation."""
    import time

    torch.set_num_threads(2)
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
    parser.add_argument("--preset", choices=("cpu-small", "smoke"), default="cpu-small")
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
    orc.add_argument("--nowcaster", default="")
    orc.add_argument("--report", default="jump_lab_report.json")
    now = sub.add_parser("nowcaster")
    now.add_argument("--trajectories", nargs="+", required=True)
    now.add_argument("--horizon", type=int, default=20)
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
    {"record": record, "nowcaster": nowcaster, "oracle": oracle, "split": split}[args.command](args)


if __name__ == "__main__":
    main()
