"""What every capability shares at the Trainer's loop: the seam to the Trainer (`seam.py`), the extra forwards
(`forward_checks.py`), vetoed and made-up steps (`step_veto.py`), batch replay (`replay.py`), the RNG forks
(`rng.py`), the DataLoader's seed draw (`epoch_seed.py`) and the divergence signals (`divergence.py`)."""
