"""The hybrid state in a Trainer checkpoint: one file per rank beside the optimizer's, loaded safely."""

from __future__ import annotations

import os
import pickle

import torch

HYBRID_STATE_NAME = "hybrid_state_rank{rank}.pt"


def save_hybrid_state(output_dir: str, rank: int, state: dict) -> None:
    torch.save(state, os.path.join(output_dir, HYBRID_STATE_NAME.format(rank=rank)))


def find_hybrid_state(checkpoint: str, rank: int) -> dict | None:
    """This rank's hybrid state in a checkpoint, or None when it has none."""
    path = os.path.join(checkpoint, HYBRID_STATE_NAME.format(rank=rank))
    if not os.path.isfile(path):
        # Resumed on more ranks than saved: under DDP every rank's state is the same, so rank 0's serves. A
        # rank that started fresh instead would take other phases than its peers and hang their collectives.
        path = os.path.join(checkpoint, HYBRID_STATE_NAME.format(rank=0))
    return load_hybrid_state(path) if os.path.isfile(path) else None


def load_hybrid_state(path: str) -> dict:
    """The hybrid state of a checkpoint, as plain types and tensors only: a file that holds any other object is
    refused, because unpickling it could run code."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise ValueError(
            f"{path} holds objects other than tensors and plain Python types, so hf_hybrid will not load it "
            "(unpickling it could run code). Resume from a checkpoint written by hf_hybrid, or delete this file to "
            f"resume without the hybrid state. ({str(err).splitlines()[0]})"
        ) from None
