"""The house rules a grep can check. The library's comments say why in the present: run and session numbers and
dates belong to docs/benchmarks.md and the git log, where they stay true."""

from __future__ import annotations

import re
from pathlib import Path

LIBRARY = Path(__file__).resolve().parents[1] / "hf_hybrid"
HISTORY = re.compile(r"\bruns? [0-9]+|\bsessions? [0-9]+|\b20[0-9]{2}-[01][0-9]-[0-3][0-9]\b")


def test_no_run_numbers_sessions_or_dates_in_the_library():
    found = [f"{path.relative_to(LIBRARY)}:{number}: {line.strip()}"
             for path in sorted(LIBRARY.rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1) if HISTORY.search(line)]
    assert found == []


def test_only_the_trainer_glue_reads_a_trainers_private_attributes():
    # The loop parts reach the trainer through seam.py's protocol, where a reader sees all they ask of it.
    reach = re.compile(r"trainer\._[a-z]")
    glue = {"trainer.py", "sft.py", "__init__.py"}
    found = [f"{path.name}:{number}" for path in sorted(LIBRARY.rglob("*.py")) if path.name not in glue
             for number, line in enumerate(path.read_text().splitlines(), 1) if reach.search(line)]
    assert found == []
