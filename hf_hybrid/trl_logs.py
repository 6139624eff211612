"""What TRL's trainers record inside `compute_loss`, kept out of the forwards the hybrid runs besides training.

TRL's trainers (SFT, DPO, KTO, reward, ...) count the tokens trained on (`_total_train_tokens`) and gather each batch's
metrics (entropy and token accuracy, DPO's rewards and margins) in `compute_loss`, then average them into the next log
(`_metrics`). The hybrid's own forwards (the autopilot's readings along the next step, a jump's probe, the guard's
re-run of the last accepted batch) go through the same `compute_loss`, on the probe batch or at weights training never
took, so what they record there is taken back: a run's TRL metrics are those of its training steps alone. A training
step on a batch trained on before an undo gave it back counts no tokens again, as the Trainer's own count does not
(loop/replay.py). Neither attribute has a public way in; tests/test_trl.py pins both on SFT, DPO, KTO and the reward
model.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class TrlLogsKept:
    """The trainer's `side_forward` (loop/seam.py): a base of `HybridMixin`, so that it reads the trainer's own
    attributes. A plain `Trainer` records nothing in `compute_loss`, and the block costs nothing there."""

    @contextmanager
    def side_forward(self) -> Iterator[None]:
        """Within the block `compute_loss` may record what it likes; TRL's token count and metrics come back as they
        were."""
        metrics = getattr(self, "_metrics", None)
        tokens = getattr(self, "_total_train_tokens", None)
        kept = ({mode: {key: list(values) for key, values in by_key.items()} for mode, by_key in metrics.items()}
                if isinstance(metrics, dict) else None)
        try:
            yield
        finally:
            if kept is not None:
                for mode, by_key in metrics.items():
                    by_key.clear()
                    by_key.update(kept.get(mode, {}))
            if tokens is not None:
                self._total_train_tokens = tokens

    @contextmanager
    def tokens_counted(self, counts: bool) -> Iterator[None]:
        """A training step; unless it `counts` its batch's tokens, TRL's token count comes back as it was."""
        tokens = getattr(self, "_total_train_tokens", None)
        try:
            yield
        finally:
            if tokens is not None and not counts:
                self._total_train_tokens = tokens
                self._metrics["train"]["num_tokens"] = [tokens]
