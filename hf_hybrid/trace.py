"""The step trace: one JSON line per optimizer step in `<output_dir>/hybrid_trace.jsonl` (phase, loss, time,
confidence, prediction error, rollback, guard action, learning rate, and at a reading of the learning-rate autopilot
its probe line and, on a trial, the raise's probe gain and its noise), which `scripts/plot.py` draws."""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .guard.rules import Action
    from .jumps.engine import HybridEngine, StepRecord

TRACE_NAME = "hybrid_trace.jsonl"


class StepTrace:
    """An open trace file. A resumed run keeps the trace up to its checkpoint and continues its clock; a fresh one
    starts over."""

    def __init__(self, output_dir: str, global_step: int) -> None:
        os.makedirs(output_dir, exist_ok=True)
        path = os.path.join(output_dir, TRACE_NAME)
        self.t0 = time.perf_counter()
        kept = []
        if global_step > 0 and os.path.isfile(path):
            with open(path) as f:
                kept = [line for line in f if json.loads(line)["step"] <= global_step]
            if kept:
                self.t0 -= json.loads(kept[-1])["time"]
        with open(path, "w") as f:
            f.writelines(kept)
        self._file = open(path, "a", buffering=1)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def write_step(self, step: int, record: StepRecord, engine: HybridEngine, guard_action: Action | None,
                   probe_line: tuple | None, raise_verdict: tuple | None, lr: float) -> None:
        """The row of the optimizer step that just ended (`record`: the engine's record of it)."""
        row = {"step": step, "phase": record.phase.value, "loss": record.loss, "time": self.elapsed(),
               "confidence": engine.confidence, "prediction_error": engine.predictor.last_residual,
               "rollback": record.rollback, "guard": guard_action and guard_action.value, "probe_line": probe_line,
               "raise_verdict": raise_verdict, "lr": lr}
        self._file.write(json.dumps(row) + "\n")

    @property
    def closed(self) -> bool:
        return self._file.closed

    def close(self) -> None:
        self._file.close()
