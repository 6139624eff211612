"""The learning-rate autopilot: one judged multiplier on the user's schedule. `line.py` reads the evidence (the probe's
loss along the optimizer's next step); `scale.py` decides (pure Python); `verdict.py` judges a raise on trial against
the user's LR; `ramp.py` spreads a raise past 4x over five steps; `cooldown.py` brings a raised scale back to 1 at the
end where the schedule does not; `runner.py` carries it out at the Trainer's loop."""
