"""GPU memory: read it (`VramMonitor`) and react when it runs low (`EmergencyCheckpointCallback`)."""

from __future__ import annotations

import logging
import math
from typing import Any

import pynvml
import torch
import torch.distributed as dist
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

logger = logging.getLogger(__name__)

_MIB = float(2**20)


class VramMonitor:
    """Device memory of one CUDA device, from NVML (what the whole GPU has left) and from PyTorch's caching
    allocator (what this process holds). All values are in MiB.

    `device` defaults to `torch.cuda.current_device()`, so build the monitor after the process has picked its GPU
    (creating `TrainingArguments` does that); a monitor built earlier in a multi-GPU job watches GPU 0 on every rank.

    NVML ignores `CUDA_VISIBLE_DEVICES` and numbers every GPU of the machine in PCI order, while CUDA numbers only
    the visible ones, fastest first by default, so the two indices need not agree. The device is therefore matched
    by the UUID CUDA reports for it. Caveat: under MIG, NVML's figures are those of the MIG instance only when the
    driver accepts the instance's `MIG-` UUID (R470 and later); when no NVML device matches, the monitor is
    unavailable rather than reporting another GPU's memory.

    When there is no CUDA, or NVML cannot be initialised, `available` is False and every method is a cheap no-op.
    """

    def __init__(self, device: int | torch.device | None = None) -> None:
        self._handle: Any = None
        if not torch.cuda.is_available():
            return
        if isinstance(device, torch.device):
            device = device.index
        self._device = torch.cuda.current_device() if device is None else device
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as err:
            logger.warning("NVML is unavailable (%s); VRAM metrics are off.", err)
            return
        uuid = str(torch.cuda.get_device_properties(self._device).uuid)
        try:
            handle = _handle_for_uuid(uuid)
            # Probe once here so that a device whose memory NVML cannot report fails now, not on every step.
            pynvml.nvmlDeviceGetMemoryInfo(handle)
        except pynvml.NVMLError as err:
            logger.warning("NVML cannot report memory of CUDA device %d (%s); VRAM metrics are off.", self._device, err)
            pynvml.nvmlShutdown()
            return
        self._handle = handle

    @property
    def available(self) -> bool:
        return self._handle is not None

    def metrics(self) -> dict[str, float]:
        """NVML's view of the device and the caching allocator's, under `hybrid/` keys, ready for `Trainer.log`."""
        if self._handle is None:
            return {}
        info = pynvml.nvmlDeviceGetMemoryInfo(self._handle)
        return {
            "hybrid/vram_used_mb": info.used / _MIB,
            "hybrid/vram_free_mb": info.free / _MIB,
            "hybrid/vram_total_mb": info.total / _MIB,
            "hybrid/torch_allocated_mb": torch.cuda.memory_allocated(self._device) / _MIB,
            "hybrid/torch_max_allocated_mb": torch.cuda.max_memory_allocated(self._device) / _MIB,
            "hybrid/torch_max_reserved_mb": torch.cuda.max_memory_reserved(self._device) / _MIB,
        }

    def free_mb(self) -> float | None:
        """Free device memory as NVML sees it (other processes included), or None when unavailable."""
        if self._handle is None:
            return None
        return pynvml.nvmlDeviceGetMemoryInfo(self._handle).free / _MIB

    def shutdown(self) -> None:
        """Release this monitor's NVML reference; the monitor is unavailable afterwards. Safe to call twice."""
        if self._handle is None:
            return
        self._handle = None
        pynvml.nvmlShutdown()


def _handle_for_uuid(uuid: str) -> Any:
    # CUDA gives the bare UUID; NVML names a whole GPU "GPU-<uuid>" and a MIG instance "MIG-<uuid>".
    try:
        return pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
    except pynvml.NVMLError:
        return pynvml.nvmlDeviceGetHandleByUUID(f"MIG-{uuid}")


class EmergencyCheckpointCallback(TrainerCallback):
    """Ask the Trainer for a checkpoint when free VRAM drops below `min_free_mb`, so that an out-of-memory crash
    loses as little work as possible.

    One checkpoint per low-memory episode: after firing, the callback stays quiet until free memory is back at or
    above the threshold. Free memory is read every `check_every` optimizer steps only, to keep NVML off most steps.
    In a distributed run the ranks agree on the minimum free memory over all ranks (one scalar all-reduce per
    check), because a checkpoint save contains collectives that hang when only some ranks save.
    """

    def __init__(self, monitor: VramMonitor, min_free_mb: float, check_every: int = 10) -> None:
        if check_every < 1:
            raise ValueError(f"check_every must be >= 1, got {check_every}")
        self.monitor = monitor
        self.min_free_mb = min_free_mb
        self.check_every = check_every
        self._armed = True

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        if state.global_step % self.check_every:
            return control
        free = self._min_free_mb_over_ranks(args.device)
        if free is None:
            return control
        if free >= self.min_free_mb:
            self._armed = True
        elif self._armed:
            self._armed = False
            control.should_save = True
            if state.is_world_process_zero:
                logger.warning(
                    "Free VRAM is %.0f MB, below the %.0f MB threshold: saving a checkpoint at step %d.",
                    free,
                    self.min_free_mb,
                    state.global_step,
                )
        return control

    def _min_free_mb_over_ranks(self, device: torch.device) -> float | None:
        free = self.monitor.free_mb()
        if not (dist.is_available() and dist.is_initialized()):
            return free
        # A rank without a reading must still join the collective; infinity leaves the minimum to the others.
        value = torch.tensor([math.inf if free is None else free], dtype=torch.float64, device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
        reduced = value.item()
        return None if math.isinf(reduced) else reduced
