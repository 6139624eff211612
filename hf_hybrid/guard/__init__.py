"""The guard: a real step whose loss is NaN or an outlier is skipped, and damaged weights are rolled back to the last
known-good snapshot. `rules.py` decides (pure Python, rank-identical inputs); `runner.py` carries it out at the
Trainer's loop."""
