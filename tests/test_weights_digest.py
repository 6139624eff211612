"""scripts/weights_digest.py: the same code and seed give the same digest; different weights give another."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "weights_digest.py"


def digest(tmp_path: Path, *args: str) -> dict:
    done = subprocess.run([sys.executable, str(SCRIPT), "--preset", "smoke", "--output_dir", str(tmp_path), *args],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_digest_is_the_weights_bit_for_bit(tmp_path):
    first, again = digest(tmp_path / "a"), digest(tmp_path / "b")
    other = digest(tmp_path / "c", "--lr_scale", "0.5")
    assert len(first["weights_sha256"]) == 64
    assert first == again
    assert other["weights_sha256"] != first["weights_sha256"] and other["lr"] == first["lr"] / 2
