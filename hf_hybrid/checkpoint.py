"""The hybrid state in a Trainer checkpoint, beside the optimizer's, loaded safely.

The state is one entry per stateful part of the run (the engine, the guard, the LR autopilot: `Stateful`), each its
own `state_dict()`, written in two kinds of file. The parameter-sized tensors (the predictor's buffers, a jump's undo
copy when one is open, the autopilot's copy of the start weights through its first 10 steps: `TENSOR_PATHS`) go where
the Trainer puts the weights: once per job when every rank holds the same ones (one process, DDP), one file per rank
when each rank holds its own shards (FSDP2). The rest is small and partly rank-local (the batches a rolled-back jump
will replay, the probe, the guard's reference batch), one file per rank.
"""

from __future__ import annotations

import os
import pickle
from typing import Protocol

import torch

HYBRID_STATE_NAME = "hybrid_state_rank{rank}.pt"
HYBRID_TENSORS_NAME = "hybrid_tensors.pt"
HYBRID_TENSOR_SHARDS_NAME = "hybrid_tensors_rank{rank}.pt"
# Where the parameter-sized entries sit in the state, by part: each is written to the tensors file under its dotted
# path and put back there on loading. A part the run does not have (no autopilot) has none.
TENSOR_PATHS = (("engine", "predictor"), ("engine", "snapshot"), ("lr_autopilot", "alignment", "start"))
# The layout of the hybrid state. Raised with any change to what a part saves, or where, so that a checkpoint of another
# layout is refused by name instead of loaded with defaults guessed for what it lacks.
FORMAT_VERSION = 8


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def load_parts(parts: dict[str, Stateful], state: dict) -> None:
    """Load each part from its entry. A part the saving run did not have (a flag turned on since) starts fresh, and
    an entry whose part this run lacks (a flag turned off) is left unread."""
    for key, part in parts.items():
        if key in state:
            part.load_state_dict(state[key])


def save_hybrid_state(output_dir: str, rank: int, state: dict, sharded: bool, writes_replicated: bool) -> None:
    """`sharded`: each rank holds its own shards of the tensors. `writes_replicated`: this rank writes what every rank
    holds alike (the Trainer's `should_save` rank)."""
    # Every rank writes here, and the Trainer may not have made the folder yet on this one: under DDP, rank 1's save
    # would fail with "Parent directory ... does not exist" (tests/test_ddp.py).
    os.makedirs(output_dir, exist_ok=True)
    state, tensors = dict(state, format_version=FORMAT_VERSION), {}
    for path in TENSOR_PATHS:
        if path[0] in state:
            tensors[".".join(path)] = _pop_path(state, path)
    torch.save(state, os.path.join(output_dir, HYBRID_STATE_NAME.format(rank=rank)))
    if sharded:
        torch.save(tensors, os.path.join(output_dir, HYBRID_TENSOR_SHARDS_NAME.format(rank=rank)))
    elif writes_replicated:
        torch.save(tensors, os.path.join(output_dir, HYBRID_TENSORS_NAME))


def find_hybrid_state(checkpoint: str, rank: int) -> dict | None:
    """This rank's hybrid state in a checkpoint, or None when it has none."""
    path = os.path.join(checkpoint, HYBRID_STATE_NAME.format(rank=rank))
    if not os.path.isfile(path):
        # Resumed on more ranks than saved: under DDP every rank's state is the same, so rank 0's serves. A
        # rank that started fresh instead would take other phases than its peers and hang their collectives.
        path = os.path.join(checkpoint, HYBRID_STATE_NAME.format(rank=0))
    if not os.path.isfile(path):
        return None
    state = load_hybrid_state(path)
    if state.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path} holds hybrid state of layout {state.get('format_version', 'unversioned')}, and this hf_hybrid "
            f"reads layout {FORMAT_VERSION}. Resume with the hf_hybrid that wrote it, or delete the checkpoint's "
            "hybrid_*.pt files to resume without the hybrid state (the weights, optimizer and schedule resume as the "
            "Trainer's)."
        )
    # The parameter-sized tensors: this rank's shards (FSDP2), or the one copy every rank shares.
    for name in (HYBRID_TENSOR_SHARDS_NAME.format(rank=rank), HYBRID_TENSORS_NAME):
        tensors = os.path.join(checkpoint, name)
        if os.path.isfile(tensors):
            for dotted, value in load_hybrid_state(tensors).items():
                *parents, key = dotted.split(".")
                _dict_at(state, parents)[key] = value
            break
    return state


def _pop_path(state: dict, path: tuple[str, ...]) -> object:
    """Take the entry at `path` out of `state`, copying the dicts along it: the parts' own dicts stay whole."""
    node = state
    for key in path[:-1]:
        node[key] = dict(node[key])
        node = node[key]
    return node.pop(path[-1])


def _dict_at(state: dict, keys: list[str]) -> dict:
    """The dict at `keys` inside `state`, where a loaded tensor entry goes back."""
    for key in keys:
        state = state[key]
    return state


def load_hybrid_state(path: str) -> dict:
    """A hybrid state file of a checkpoint, as plain types and tensors only: a file that holds any other object is
    refused, because unpickling it could run code."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise ValueError(
            f"{path} holds objects other than tensors and plain Python types, so hf_hybrid will not load it "
            "(unpickling it could run code). Resume from a checkpoint written by hf_hybrid, or delete this file to "
            f"resume without the hybrid state. ({str(err).splitlines()[0]})"
        ) from None
