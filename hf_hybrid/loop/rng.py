"""The hybrid's own random draws (its paired forwards' dropout masks, the loss forecast's initial weights) run inside
a fork of the RNG, so that the Trainer's own streams (data order, dropout) stay exactly those of a plain run.

Inside a fork, only the forked generators are seeded. `torch.manual_seed` would reseed every CUDA device's generator
too, and a fork restores only the devices it names: on a GPU, seeding the loss forecast that way moves the Trainer's
dropout masks from the first step on (docs/benchmarks-history.md, "the Trainer's weights on a GPU"; on a CPU the fork
restores the generator, so CPU runs stay exact either way).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def forked_rng(device: torch.device, seed: int | None = None) -> Iterator[None]:
    """The CPU's generator and, on CUDA, `device`'s, seeded with `seed` if given; both as they were on exit."""
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else []):
        if seed is not None:
            torch.default_generator.manual_seed(seed)
            if cuda:
                index = device.index if device.index is not None else torch.cuda.current_device()
                torch.cuda.default_generators[index].manual_seed(seed)
        yield
