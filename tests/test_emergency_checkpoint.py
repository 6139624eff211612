"""The emergency checkpoint: a checkpoint when free GPU memory runs low, once per low-memory episode, decided alike on
every rank (NVML and CUDA faked, as in tests/test_memory.py)."""

import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import Trainer, TrainerControl, TrainerState, TrainingArguments

from hf_hybrid.memory import vram as memory
from hf_hybrid.memory.vram import EmergencyCheckpointCallback, VramMonitor

from .test_memory import MIB, FakeNvml, fake_cuda


@pytest.fixture
def low_memory_gpu(monkeypatch):
    nvml = FakeNvml({"GPU-aaaa": {"total": 10_000 * MIB, "free": 9_000 * MIB, "used": 1_000 * MIB}})
    monkeypatch.setattr(memory, "pynvml", nvml)
    fake_cuda(monkeypatch, 0, {0: "aaaa"})
    return nvml


def set_free(nvml: FakeNvml, free_mb: float) -> None:
    nvml.devices["GPU-aaaa"]["free"] = free_mb * MIB


def step_end(callback: EmergencyCheckpointCallback, step: int) -> bool:
    state = TrainerState()
    state.global_step = step
    control = callback.on_step_end(types.SimpleNamespace(device=torch.device("cpu")), state, TrainerControl())
    return control.should_save


def test_emergency_checkpoint_once_per_episode_and_rearms(low_memory_gpu, caplog):
    nvml = low_memory_gpu
    callback = EmergencyCheckpointCallback(VramMonitor(), min_free_mb=1_000, check_every=10)
    queries = nvml.memory_queries

    set_free(nvml, 500)
    assert not any(step_end(callback, step) for step in range(1, 10))
    assert nvml.memory_queries == queries, "NVML was read between checks"
    with caplog.at_level("WARNING", logger="hf_hybrid.memory.vram"):
        assert step_end(callback, 10)
    assert "500 MB" in caplog.text and "1000 MB" in caplog.text
    assert not step_end(callback, 20), "a second checkpoint in the same low-memory episode"
    set_free(nvml, 1_000)
    assert not step_end(callback, 30)
    set_free(nvml, 999)
    assert step_end(callback, 40), "did not re-arm after memory recovered"
    assert nvml.memory_queries == queries + 4


def test_emergency_checkpoint_without_a_gpu_does_nothing():
    monitor = VramMonitor()
    if monitor.available:
        pytest.skip("needs a machine without a usable GPU")
    callback = EmergencyCheckpointCallback(monitor, min_free_mb=float("inf"), check_every=1)
    assert not step_end(callback, 1)


def test_emergency_checkpoint_rejects_zero_period():
    with pytest.raises(ValueError):
        EmergencyCheckpointCallback(VramMonitor(), min_free_mb=1, check_every=0)


class ScriptedMonitor:
    """Hands out one scripted free-memory reading per call, so reading at the wrong steps breaks the script."""

    def __init__(self, readings: list[float]) -> None:
        self.readings = iter(readings)

    def free_mb(self) -> float | None:
        return next(self.readings)


class TinyRegression(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x, y):
        return {"loss": torch.nn.functional.mse_loss(self.linear(x).squeeze(-1), y)}


def test_trainer_saves_a_checkpoint_when_memory_runs_low(tmp_path):
    torch.manual_seed(0)
    data = [{"x": torch.randn(4), "y": torch.randn(())} for _ in range(16)]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=20,
        per_device_train_batch_size=4,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    # Read at steps 5, 10, 15 and 20: only the first reading of the low episode may save.
    callback = EmergencyCheckpointCallback(ScriptedMonitor([9_000, 100, 100, 9_000]), min_free_mb=1_000, check_every=5)
    Trainer(model=TinyRegression(), args=args, train_dataset=data, callbacks=[callback]).train()
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-10"]


def _distributed_rank(rank: int, init_file: str, results: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        # Only rank 0 is short of memory; rank 1 must still checkpoint with it.
        callback = EmergencyCheckpointCallback(ScriptedMonitor([[100, 9_000][rank]]), min_free_mb=1_000, check_every=1)
        results[rank] = step_end(callback, 1)
    finally:
        dist.destroy_process_group()


def test_emergency_checkpoint_decision_is_the_same_on_every_rank(tmp_path):
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_distributed_rank, args=(str(tmp_path / "store"), results), nprocs=2)
        assert dict(results) == {0: True, 1: True}
