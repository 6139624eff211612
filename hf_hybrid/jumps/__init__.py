"""Jumps: every few real steps the predictor moves the weights ahead (the Predict phase), the probe judges the jump,
and a jump that does not pay is rolled back bit for bit. `engine.py` runs one optimizer step at a time; `controller.py`
picks the next step's phase; `lifecycle.py` opens, watches and closes a jump; `payoff.py` judges it; `predictors/` make
the moves; `clock.py` times what a jump costs."""
