"""What a benchmark result depends on beyond its command, recorded in its report."""

from __future__ import annotations

import platform
import shlex
import subprocess
import sys
from pathlib import Path


def environment(device: str | None = None) -> dict:
    """The command that made a result, and what it depends on beyond it: the library's commit (and whether its files
    differed from it), its behaviour version, the versions, and the processor. Two records that disagree can then be
    told apart by these before anything else (two on record do not reproduce: run 200's and session 27's survey).
    `device`: the GPU's name as an arm's process read it, so that a parent that only launches arms never makes a CUDA
    context of its own beside theirs; read here where not given."""
    import accelerate
    import torch
    import transformers

    import hf_hybrid

    library = Path(hf_hybrid.__file__).resolve().parent

    def git(*args: str) -> str:  # "" without git, or outside a repository (a copied tree)
        try:
            done = subprocess.run(["git", "-C", str(library), *args], capture_output=True, text=True)
        except OSError:
            return ""
        return done.stdout.strip() if done.returncode == 0 else ""

    names = [line.split(":", 1)[1].strip() for line in _read_lines("/proc/cpuinfo") if line.startswith("model name")]
    cpu = names[0] if names else platform.processor()
    script = Path(sys.argv[0]).resolve()
    script = script.relative_to(library.parent) if script.is_relative_to(library.parent) else script
    return {"command": shlex.join(["python", str(script), *sys.argv[1:]]), "library": str(library),
            "commit": git("rev-parse", "HEAD"),
            "behaviour_version": hf_hybrid.BEHAVIOUR_VERSION,
            "library_changed": bool(git("status", "--porcelain", "--", ".")),
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "accelerate": accelerate.__version__, "cpu": cpu, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch_threads": torch.get_num_threads(),
            "device": device or (torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")}


def _read_lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []
