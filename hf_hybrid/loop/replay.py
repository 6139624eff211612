"""Batch replay: a rolled-back jump, or an undone learning-rate trial, gives its batches back to the data stream.

The batches of a Predict phase (and of the Correct steps after it) are not trained on while the jump is
open: predicted steps run no backward, and a rollback undoes the Correct steps too. Without replay they
would simply be skipped, so after a rejected jump the run would see a different data order from the
Trainer's and land at a different point for reasons that have nothing to do with prediction.

With replay, the next real steps train on those batches first, in their original order. Each fresh
batch waits in a queue behind them, so the n-th real step trains on the Trainer's n-th batch. A run
whose every jump is rejected then follows the Trainer's trajectory bit for bit, in real steps, and
differs only in the time the attempts cost, with dropout and evaluations too: an evaluation comes after
as many of the Trainer's updates as the Trainer's (loop/step_veto.py), and so does its DataLoader's seed draw.

A learning-rate trial (autopilot/runner.py) is undone the same way: the updates since its undo point are undone, and
their batches come back first, so a run whose every raise is undone still trains on the Trainer's batches in order. A
guard rollback is not a replay: its batches hold the trouble it caught, and are dropped (guard/runner.py); a trial that
meets a guard event no longer replays its batches either.

A unit trained on is counted once in the Trainer's `num_input_tokens_seen`, as in the Trainer: a Predict step's units
count when they are trained on, and a unit that was trained on and given back (an undone trial's, a rolled-back jump's
Correct steps') counted the first time.

A unit is what `Trainer.get_batch_samples` returns for one optimizer step: the micro-batches and their
item count. A unit is only swapped for one with as many micro-batches (the last step of an epoch may be
short). Batches live on the device; at most `max_units` wait, and beyond that the newest are dropped,
which skips them as if there were no replay.
"""

from __future__ import annotations

from collections import deque

import torch

Unit = tuple[list, torch.Tensor | int | None]


class BatchReplay:
    def __init__(self, max_units: int = 256) -> None:
        self.max_units = max_units
        self.queue: deque[Unit] = deque()
        self.open: list[Unit] | None = None  # units handed out since the open jump's snapshot
        # Units handed out since a learning-rate trial's undo point. Not checkpointed: a save asks for a new undo point
        # at the next accepted step (guard/runner.py), which starts a new record, in a resumed run too.
        self.trial: list[Unit] | None = None
        self.last: Unit | None = None  # the unit of the optimizer step under way
        self.counts_tokens = True  # whether the step under way counts its unit's tokens: it trains on it, first time
        self.counted: list[Unit] = []  # units trained on that may come back: waiting, or on a jump's or trial's record

    def hand_out(self, fresh: Unit, new_jump: bool, trains: bool) -> Unit:
        """The unit for the next optimizer step; `new_jump` when that step starts a Predict phase, `trains` when the
        step trains on it (it is not a Predict step)."""
        unit = fresh
        if self.queue and len(fresh[0]) == len(self.queue[0][0]):
            self.queue.append(fresh)
            unit = self.queue.popleft()
        if new_jump:
            self.open = []
        if self.open is not None:
            self.open.append(unit)
        if self.trial is not None:
            self.trial.append(unit)
        self.last = unit
        self.counts_tokens = trains and not self._was_counted(unit)
        if self.counts_tokens and (self.open is not None or self.trial is not None):
            self.counted.append(unit)
        return unit

    def _was_counted(self, unit: Unit) -> bool:
        return any(unit is counted for counted in self.counted)

    def _forget_gone(self) -> None:
        """Keep the record of counted units that can still come back."""
        if self.counted:
            waiting = [*self.queue, *(self.open or []), *(self.trial or [])]
            self.counted = [unit for unit in self.counted if any(unit is other for other in waiting)]

    def _first(self, units: list[Unit]) -> None:
        self.queue.extendleft(reversed(units))
        while len(self.queue) > self.max_units:
            self.queue.pop()

    def give_back(self) -> None:
        """The open jump was rolled back: its units go first, in order."""
        if self.open:
            self._first(self.open)
            if self.trial:  # a trial's snapshot is never taken inside a jump, so the jump's units are its last
                del self.trial[len(self.trial) - len(self.open):]
        self.open = None
        self._forget_gone()

    def begin_trial(self) -> None:
        """A learning-rate trial's undo point was just taken, before the update of the step under way."""
        self.trial = [self.last] if self.last is not None else []
        if self.trial and self.counts_tokens and not self._was_counted(self.last):
            self.counted.append(self.last)

    def undo_trial(self) -> None:
        """The trial was undone back to its undo point: the units since then go first, in order."""
        if self.trial:
            self._first(self.trial)
        self.trial = None
        self._forget_gone()

    def end_trial(self) -> None:
        """The trial was kept, or a guard event dropped batches inside it: nothing will be given back."""
        self.trial = None
        self._forget_gone()

    def settle(self) -> None:
        """The open jump was kept: its units were used."""
        self.open = None
        self._forget_gone()

    def state_dict(self) -> dict:
        saved = [*self.queue, *(self.open or [])]
        return {
            "queue": [move_unit(unit, "cpu") for unit in self.queue],
            "open": [move_unit(unit, "cpu") for unit in self.open] if self.open is not None else None,
            "counted": [i for i, unit in enumerate(saved) if self._was_counted(unit)],  # in the queue, then open
        }

    def load_state_dict(self, state: dict, device: torch.device) -> None:
        self.queue = deque(move_unit(unit, device) for unit in state["queue"])
        self.open = [move_unit(unit, device) for unit in state["open"]] if state["open"] is not None else None
        saved = [*self.queue, *(self.open or [])]
        self.counted = [saved[i] for i in state["counted"]]


def move_batch(batch: dict | None, device: torch.device | str) -> dict | None:
    """A batch with its tensors on `device` (a checkpoint's on the CPU); None stays None."""
    if batch is None:
        return None
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def move_unit(unit: Unit, device: torch.device | str) -> Unit:
    batches, num_items = unit
    moved = [move_batch(batch, device) for batch in batches]
    return moved, num_items.to(device) if isinstance(num_items, torch.Tensor) else num_items
