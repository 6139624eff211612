"""The dynamics ensemble, the divergence monitor and the payoff meter, each on its own."""

from __future__ import annotations

import math
import random

import torch

from hf_hybrid.jumps.dynamics import LossDynamicsModel
from hf_hybrid.jumps.payoff import PayoffMeter
from hf_hybrid.loop.divergence import DivergenceMonitor


def feed(model: LossDynamicsModel, noise: float, steps: int = 260, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    losses = [4.0 * math.exp(-i / 150) + 1.0 + rng.gauss(0, noise) for i in range(steps)]
    for loss in losses:
        model.observe(loss, 1.0, 1e-3)
    return losses


def test_dynamics_forecast_tracks_a_falling_loss():
    model = LossDynamicsModel(seed=0)
    losses = feed(model, noise=0.02)
    mean, std = model.forecast(5)
    recent = sum(losses[-10:]) / 10
    assert abs(mean[0] - recent) < 0.15
    assert all(s > 0 and math.isfinite(s) for s in std)


def test_confidence_is_lower_for_noisy_training():
    smooth, noisy = LossDynamicsModel(seed=0), LossDynamicsModel(seed=0)
    feed(smooth, noise=0.01)
    feed(noisy, noise=0.8)
    c_smooth, c_noisy = smooth.confidence(), noisy.confidence()
    assert 0.0 <= c_noisy < c_smooth <= 1.0


def test_dynamics_state_round_trip_is_exact():
    a = LossDynamicsModel(seed=3)
    feed(a, noise=0.05, steps=150)
    b = LossDynamicsModel(seed=99)
    b.load_state_dict(a.state_dict())
    for i in range(120):  # crosses a training round (every 100 steps)
        a.observe(2.0 - i * 1e-3, 1.0, 1e-3)
        b.observe(2.0 - i * 1e-3, 1.0, 1e-3)
    assert a.confidence() == b.confidence()
    assert a.forecast(4) == b.forecast(4)


def test_dynamics_does_not_touch_the_global_rng():
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    feed(LossDynamicsModel(seed=0), noise=0.05, steps=120)
    assert torch.equal(torch.rand(3), expected)


def test_divergence_band_ignores_trend_and_catches_jumps():
    monitor = DivergenceMonitor(band_sigmas=3.0, grad_explosion_factor=10.0)
    rng = random.Random(0)
    for i in range(100):  # a steep, steady fall with small noise
        monitor.observe(6.0 - 0.02 * i + rng.gauss(0, 0.01), 1.0)
    assert monitor.loss_sigma < 0.05  # the trend is not counted as noise
    assert not monitor.loss_diverged(monitor.loss_level + 0.02)
    assert monitor.loss_diverged(monitor.loss_level + 0.5)
    assert monitor.loss_diverged(float("nan")) and monitor.non_finite == 1
    assert monitor.grad_diverged(50.0) and not monitor.grad_diverged(2.0)
    assert monitor.divergences == 3


def test_payoff_requires_what_plain_training_would_have_gained():
    def meter_after_fall() -> PayoffMeter:
        meter = PayoffMeter(forward_cost=0.35, noise_margin=2.0)
        rng = random.Random(0)
        for i in range(64):  # plain training improves 0.01 per unit cost
            meter.tick_real(5.0 - 0.01 * i + rng.gauss(0, 0.005))
        meter.begin_prediction()
        meter.tick_probe()  # probe before
        for _ in range(8):
            meter.tick_predict(monitored=False)
        meter.tick_probe()  # probe after: 0.35 + 8 x 0.02 + 0.35 = 0.86 units
        return meter

    good = meter_after_fall()
    assert good.verdict(0.02) is True and abs(good.last_required - 0.0086) < 1e-3
    bad = meter_after_fall()
    assert bad.verdict(0.005) is False  # a gain, but less than plain training's for the same cost
    assert meter_after_fall().verdict(float("nan")) is False
    assert (good.verdicts, good.paid, bad.paid) == (1, 1, 0)
    restored = PayoffMeter(forward_cost=0.35, noise_margin=2.0)
    restored.load_state_dict(good.state_dict())
    assert restored.state_dict() == good.state_dict()
    assert (restored.clock, restored.paid, len(restored.history)) == (good.clock, 1, 64) and restored.clock > 64
