"""RSSM-lite: a small recurrent ensemble that forecasts the training loss, with an uncertainty.

Inputs per real optimizer step are three training-state features (loss, log gradient norm, learning
rate), each normalized by running statistics. Each ensemble member is a GRU with a Gaussian head that
predicts the change of the normalized loss at the next step; members differ by seed and by a bootstrap mask over time
steps. The forecast rolls the members forward, holding the other features at their last values.

Confidence = 0.4 * ensemble agreement + 0.4 * recent accuracy + 0.2 * loss stability, each in [0, 1]:
- agreement: how close the members' forecasts are, in units of the loss's own noise;
- accuracy: how often the last one-step forecasts held the realized loss inside 2 sigma;
- stability: how small the loss's noise is next to its level.

It always runs on the CPU, in float32, from rank-identical inputs with seeded generators, so every
rank computes the same confidence; it is a few thousand parameters and trains every `train_every`
steps for a few iterations, so its cost stays out of the step time.
"""

from __future__ import annotations

import copy
import math
from collections import deque

import torch
from torch import nn

from ..loop.rng import forked_rng

NUM_FEATURES = 3


class _Member(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.gru = nn.GRU(NUM_FEATURES, hidden, batch_first=True)
        self.head = nn.Linear(hidden, 2)

    def forward(self, x: torch.Tensor, h: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        out, h = self.gru(x, h)
        return self.head(out), h


class _RunningNorm:
    """Welford mean/variance per feature."""

    def __init__(self) -> None:
        self.n = 0
        self.mean = [0.0] * NUM_FEATURES
        self.m2 = [0.0] * NUM_FEATURES

    def update(self, x: list[float]) -> None:
        self.n += 1
        for i, v in enumerate(x):
            d = v - self.mean[i]
            self.mean[i] += d / self.n
            self.m2[i] += d * (v - self.mean[i])

    def std(self, i: int) -> float:
        return math.sqrt(self.m2[i] / self.n) if self.n > 1 and self.m2[i] > 0 else 1.0

    def normalize(self, x: list[float]) -> list[float]:
        return [(v - self.mean[i]) / self.std(i) for i, v in enumerate(x)]


class LossDynamicsModel:
    def __init__(
        self,
        ensemble_size: int = 4,
        hidden: int = 16,
        window: int = 48,
        train_every: int = 100,
        train_iters: int = 3,
        seed: int = 0,
    ) -> None:
        self.window, self.train_every, self.train_iters = window, train_every, train_iters
        self.norm = _RunningNorm()
        self.raw: deque[list[float]] = deque(maxlen=window + 1)
        self.members = []
        for k in range(ensemble_size):
            # Seeded per member, without moving the Trainer's RNG.
            with forked_rng(torch.device("cpu"), seed * 1009 + k):
                self.members.append(_Member(hidden))
        params = [p for m in self.members for p in m.parameters()]
        self.optimizer = torch.optim.Adam(params, lr=1e-2)
        self.generator = torch.Generator().manual_seed(seed)
        self.steps = 0
        self.hits: deque[float] = deque(maxlen=32)
        self._last_forecast: tuple[float, float] | None = None
        self._hidden: list[torch.Tensor] | None = None  # each member's state after the latest step
        self._next: list[torch.Tensor] | None = None  # each member's head output for the next step

    @property
    def ready(self) -> bool:
        return len(self.raw) > 8 and self._hidden is not None

    def observe(self, loss: float, grad_norm: float | None, lr: float) -> None:
        """Record one real step; score the previous one-step forecast; train now and then."""
        x = [loss, math.log(max(grad_norm or 0.0, 1e-12)), lr]
        if not all(math.isfinite(v) for v in x):
            return
        if self._last_forecast is not None:
            mean, std = self._last_forecast
            self.hits.append(1.0 if abs(loss - mean) <= 2.0 * std else 0.0)
            self._last_forecast = None
        self.norm.update(x)
        self.raw.append(x)
        self.steps += 1
        if len(self.raw) <= 8:
            return
        if self.steps % self.train_every == 0 or self._hidden is None:
            if self.steps % self.train_every == 0:
                self._train()
            self._replay()
        else:
            self._advance(x)
        mean, std = self.forecast(1)
        self._last_forecast = (mean[0], std[0])

    @torch.no_grad()
    def _replay(self) -> None:
        """Recompute every member's state over the window (after training changed the weights)."""
        seq = self._sequence()
        self._hidden, self._next = [], []
        for member in self.members:
            out, h = member(seq)
            self._hidden.append(h)
            self._next.append(out[:, -1:])

    @torch.no_grad()
    def _advance(self, x: list[float]) -> None:
        """One recurrent step per member: the per-step cost stays constant between trainings."""
        step = torch.tensor([[self.norm.normalize(x)]], dtype=torch.float32)
        for k, member in enumerate(self.members):
            self._next[k], self._hidden[k] = member(step, self._hidden[k])

    def _sequence(self) -> torch.Tensor:
        return torch.tensor([self.norm.normalize(x) for x in self.raw], dtype=torch.float32).unsqueeze(0)

    def _train(self) -> None:
        seq = self._sequence()
        inputs, targets = seq[:, :-1], seq[:, 1:, 0]
        masks = [
            (torch.rand(targets.shape, generator=self.generator) < 0.8).float() for _ in self.members
        ]
        for _ in range(self.train_iters):
            self.optimizer.zero_grad(set_to_none=True)
            total = torch.zeros(())
            for member, mask in zip(self.members, masks):
                out, _ = member(inputs)
                # A residual on the last loss: an untrained member forecasts persistence, not noise.
                mean, log_var = inputs[..., 0] + out[..., 0], out[..., 1].clamp(-6.0, 4.0)
                nll = 0.5 * (log_var + (targets - mean) ** 2 / log_var.exp())
                total = total + (nll * mask).sum() / mask.sum().clamp_min(1.0)
            total.backward()
            self.optimizer.step()

    @torch.no_grad()
    def _rollouts(self, horizon: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per member, the normalized mean and variance of the next `horizon` losses."""
        last = torch.tensor([[self.norm.normalize(self.raw[-1])]], dtype=torch.float32)
        means, variances = [], []
        for member, h, step_out in zip(self.members, self._hidden, self._next):
            inputs = last.clone()
            m_list, v_list = [], []
            for k in range(horizon):
                mean, log_var = inputs[..., 0] + step_out[..., 0], step_out[..., 1].clamp(-6.0, 4.0)
                m_list.append(mean.reshape(()))
                v_list.append(log_var.exp().reshape(()))
                if k + 1 < horizon:  # the step after the last one is never read: no recurrent call for it
                    inputs[..., 0] = mean
                    step_out, h = member(inputs, h)
            means.append(torch.stack(m_list))
            variances.append(torch.stack(v_list))
        return torch.stack(means), torch.stack(variances)

    def forecast(self, horizon: int) -> tuple[list[float], list[float]]:
        """Mean and standard deviation of the next `horizon` losses, in loss units."""
        if not self.ready:
            last = self.raw[-1][0] if self.raw else 0.0
            return [last] * horizon, [float("inf")] * horizon
        means, variances = self._rollouts(horizon)
        scale, shift = self.norm.std(0), self.norm.mean[0]
        mean = means.mean(0)
        var = variances.mean(0) + means.var(0, unbiased=False)
        return (mean * scale + shift).tolist(), (var.sqrt() * scale).tolist()

    def confidence(self, horizon: int = 8) -> float:
        if not self.ready:
            return 0.0
        means, _ = self._rollouts(horizon)
        spread = means.std(0, unbiased=False).mean().item()  # in units of the loss's running std
        agreement = math.exp(-spread)
        accuracy = sum(self.hits) / len(self.hits) if self.hits else 0.0
        losses = [x[0] for x in self.raw]
        level = abs(sum(losses) / len(losses)) or 1.0
        noise = math.sqrt(sum((a - b) ** 2 for a, b in zip(losses[1:], losses[:-1])) / (2 * (len(losses) - 1)))
        stability = 1.0 / (1.0 + 10.0 * noise / level)
        return 0.4 * agreement + 0.4 * accuracy + 0.2 * stability

    def state_dict(self) -> dict:
        return {
            "members": [m.state_dict() for m in self.members],
            # A copy: Optimizer.load_state_dict keeps the very tensors it is given, which would alias two models.
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "generator": self.generator.get_state(),
            "norm": {"n": self.norm.n, "mean": list(self.norm.mean), "m2": list(self.norm.m2)},
            "raw": [list(x) for x in self.raw],
            "steps": self.steps,
            "hits": list(self.hits),
            "last_forecast": self._last_forecast,
            # Advanced step by step since the last replay; a replay would not reproduce it exactly.
            "hidden": [h.clone() for h in self._hidden] if self._hidden is not None else None,
            "next": [n.clone() for n in self._next] if self._next is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        for member, member_state in zip(self.members, state["members"]):
            member.load_state_dict(member_state)
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])
        self.norm.n, self.norm.mean, self.norm.m2 = state["norm"]["n"], state["norm"]["mean"], state["norm"]["m2"]
        self.raw = deque(state["raw"], maxlen=self.window + 1)
        self.steps = state["steps"]
        self.hits = deque(state["hits"], maxlen=32)
        self._last_forecast = tuple(state["last_forecast"]) if state["last_forecast"] else None
        self._hidden = [h.clone() for h in state["hidden"]] if state["hidden"] is not None else None
        self._next = [n.clone() for n in state["next"]] if state["next"] is not None else None
