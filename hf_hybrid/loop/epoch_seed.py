"""The DataLoader's epoch seed draw, made where the Trainer makes it.

Each epoch's DataLoader iterator draws its seeds from the global RNG, which on CPU is also the dropout RNG. The
hybrid fetches batches ahead of its real steps by the units that rolled-back jumps gave back (loop/replay.py), so it
creates the next epoch's iterator that many real steps early, and every dropout mask after that differs from the
Trainer's: enough to miss its final loss after identical real steps (docs/benchmarks-history.md, "cpu-long A/B after
the guard change").

So the draw is undone when the epoch's first batch is fetched, and made again just before that batch goes to a
real step: that is where the Trainer made it. The draw is re-made, not restored from a saved state, so it is only
deferred when re-making it reproduces exactly the state the iterator left; otherwise nothing changes (a resumed
run's RNG load, an unknown sampler). A rollback restores the RNG from before the draw and gives the epoch's first
batch back, so the draw is made again when that batch is trained on.

A resumed run's RNG comes from the checkpoint, which the Trainer loads after fetching the first batch (mid-epoch) or
before making the iterator (at an epoch's start). The loaded state holds the draws the saving run had made, and not
one it had still deferred: the checkpoint carries that one (the draws and where the epoch's first unit waits in the
replay queue), and the resumed run makes it where the saving run would have. The resumed run's own iterator, which
skips the trained batches, draws nothing that counts: the load replaces its draws.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

MAX_DRAWS = 4  # the iterator's base and shared seeds, and a RandomSampler's own seed


def _draw() -> None:
    torch.empty((), dtype=torch.int64).random_()  # what torch.utils.data draws for each seed


class EpochSeedDraw:
    def __init__(self) -> None:
        self.before: torch.Tensor | None = None  # the CPU RNG state when the epoch began, until its first fetch
        self.draws = 0
        self.first_unit: object | None = None
        self.carried: tuple[int, object] | None = None  # a deferred draw from the checkpoint, until the RNG load

    def epoch_begins(self) -> None:
        self.before = torch.get_rng_state()

    def first_fetch(self, unit: object) -> None:
        """The epoch's first unit was just fetched: undo the iterator's seed draws, to be made again later."""
        before, self.before = self.before, None
        after = torch.get_rng_state()
        if before is None or torch.equal(before, after):
            return
        torch.set_rng_state(before)
        for draws in range(1, MAX_DRAWS + 1):
            _draw()
            if torch.equal(torch.get_rng_state(), after):
                torch.set_rng_state(before)
                self.draws, self.first_unit = draws, unit
                return
        torch.set_rng_state(after)

    def handing_out(self, unit: object, real_step: bool) -> None:
        """Before `unit` trains: the deferred draws, if it is the epoch's first unit and the step is real."""
        if real_step and unit is self.first_unit:
            for _ in range(self.draws):
                _draw()

    def rng_loaded(self, last_unit: object, real_step: bool) -> None:
        """The Trainer just loaded a checkpoint's RNG state; `last_unit` is the unit fetched before the load, if any,
        and `real_step` whether it trains."""
        self.draws, self.first_unit = self.carried or (0, None)
        self.carried = None
        if self.before is not None:  # the epoch's iterator is made after the load, as in the saving run
            self.before = torch.get_rng_state()
        self.handing_out(last_unit, real_step)  # its draws, if made before the load, were overwritten

    def state_dict(self, queue: Sequence[object]) -> dict:
        waiting = [i for i, unit in enumerate(queue) if unit is self.first_unit]
        return {"draws": self.draws, "queued_at": waiting[0] if waiting else None}

    def load_state_dict(self, state: dict, queue: Sequence[object]) -> None:
        if state["queued_at"] is not None:
            self.carried = (state["draws"], queue[state["queued_at"]])

    @property
    def epoch_starting(self) -> bool:
        return self.before is not None
