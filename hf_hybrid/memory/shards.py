"""Parameter-sized tensors as each rank holds them: its local shard under FSDP2, and a checkpoint's copies loaded
into a run's buffers."""

from __future__ import annotations

from torch import Tensor

GB = 1e9  # the unit of the hybrid's lines about memory


def nbytes(t: Tensor) -> int:
    """The bytes a tensor's elements take."""
    return t.numel() * t.element_size()


def local_shard(t: Tensor) -> Tensor:
    """This rank's part of a tensor: under FSDP2 a DTensor's local shard, which aliases the parameter's storage so
    in-place work reaches it; otherwise the tensor itself. Looked up at each use rather than kept, because FSDP2 may
    re-pad a shard into new storage at its lazy init (the first forward). Working on shards keeps every predictor
    operation local: a reduction over a DTensor would all-gather, and element-wise DTensor ops pay sharding
    propagation on every call."""
    return t.to_local() if hasattr(t, "to_local") else t


def local_shards(params: list[Tensor]) -> list[Tensor]:
    """Each parameter's `local_shard`, looked up now."""
    return [local_shard(p) for p in params]


def load_tensors(live: list[Tensor], saved: list[Tensor], what: str) -> None:
    """Copy a checkpoint's parameter-sized tensors into this run's buffers, refusing a layout that does not match."""
    if len(saved) != len(live) or any(s.shape != t.shape for s, t in zip(saved, live)):
        raise ValueError(
            f"the checkpoint's {what} ({len(saved)} tensors) does not match this run's trainable parameters "
            f"({len(live)} tensors, or other shapes). Resume with the model, trainable parameters and (under FSDP2) "
            "number of ranks it was saved with, or delete the checkpoint's hybrid_*.pt files to resume without the "
            "hybrid state."
        )
    for t, s in zip(live, saved):
        t.copy_(s)
