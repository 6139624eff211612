import types

import torch

from hf_hybrid.memory import vram as memory
from hf_hybrid.memory.vram import VramMonitor

MIB = 2**20


class FakeNVMLError(Exception):
    pass


class FakeNvml:
    """Stands in for the pynvml module: devices by UUID, with settable free memory, and call counts."""

    NVMLError = FakeNVMLError

    def __init__(self, devices: dict[str, dict[str, int]], init_error: bool = False) -> None:
        self.devices = devices
        self.init_error = init_error
        self.inits = 0
        self.shutdowns = 0
        self.memory_queries = 0

    def nvmlInit(self):
        if self.init_error:
            raise FakeNVMLError("NVML Shared Library Not Found")
        self.inits += 1

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetHandleByUUID(self, uuid):
        if uuid not in self.devices:
            raise FakeNVMLError("Not Found")
        return uuid

    def nvmlDeviceGetMemoryInfo(self, handle):
        self.memory_queries += 1
        return types.SimpleNamespace(**self.devices[handle])


def fake_cuda(monkeypatch, current_device: int, uuids: dict[int, str]) -> None:
    """A machine with CUDA: `uuids` maps CUDA indices (after CUDA_VISIBLE_DEVICES) to CUDA's bare UUIDs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current_device)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(uuid=uuids[i]))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda i: (100 + i) * MIB)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda i: (200 + i) * MIB)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda i: (300 + i) * MIB)


def two_gpus() -> FakeNvml:
    return FakeNvml(
        {
            "GPU-aaaa": {"total": 80_000 * MIB, "free": 70_000 * MIB, "used": 10_000 * MIB},
            "GPU-bbbb": {"total": 40_000 * MIB, "free": 1_500 * MIB, "used": 38_500 * MIB},
        }
    )


def test_monitor_without_cuda_is_an_unavailable_no_op(monkeypatch):
    nvml = two_gpus()
    monkeypatch.setattr(memory, "pynvml", nvml)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monitor = VramMonitor()
    assert not monitor.available
    assert monitor.metrics() == {}
    assert monitor.free_mb() is None
    monitor.shutdown()
    assert (nvml.inits, nvml.shutdowns, nvml.memory_queries) == (0, 0, 0)


def test_monitor_on_this_machine():
    monitor = VramMonitor()
    if torch.cuda.is_available():
        assert monitor.available
        assert len(monitor.metrics()) == 6
        assert 0 < monitor.free_mb() <= monitor.metrics()["hybrid/vram_total_mb"]
    else:
        assert not monitor.available
        assert monitor.metrics() == {}
        assert monitor.free_mb() is None
    monitor.shutdown()


def test_monitor_is_unavailable_when_nvml_init_fails(monkeypatch):
    monkeypatch.setattr(memory, "pynvml", FakeNvml({}, init_error=True))
    fake_cuda(monkeypatch, 0, {0: "aaaa"})
    monitor = VramMonitor()
    assert not monitor.available
    assert monitor.metrics() == {}
    assert monitor.free_mb() is None


def test_metrics_come_from_the_nvml_device_with_the_cuda_uuid(monkeypatch):
    nvml = two_gpus()
    monkeypatch.setattr(memory, "pynvml", nvml)
    # As with CUDA_VISIBLE_DEVICES=1,0: CUDA device 0 is NVML's second GPU, so indices must not be trusted.
    fake_cuda(monkeypatch, 0, {0: "bbbb", 1: "aaaa"})
    monitor = VramMonitor()
    assert monitor.available
    assert monitor.metrics() == {
        "hybrid/vram_used_mb": 38_500.0,
        "hybrid/vram_free_mb": 1_500.0,
        "hybrid/vram_total_mb": 40_000.0,
        "hybrid/torch_allocated_mb": 100.0,
        "hybrid/torch_max_allocated_mb": 200.0,
        "hybrid/torch_max_reserved_mb": 300.0,
    }
    assert monitor.free_mb() == 1_500.0
    assert VramMonitor(device=torch.device("cuda", 1)).free_mb() == 70_000.0
    assert VramMonitor(device=1).metrics()["hybrid/torch_allocated_mb"] == 101.0
    assert nvml.inits == 3


def test_mig_instance_is_found_by_its_mig_uuid(monkeypatch):
    monkeypatch.setattr(memory, "pynvml", FakeNvml({"MIG-cccc": {"total": 10 * MIB, "free": 4 * MIB, "used": 6 * MIB}}))
    fake_cuda(monkeypatch, 0, {0: "cccc"})
    assert VramMonitor().free_mb() == 4.0


def test_unknown_device_is_unavailable_and_releases_nvml(monkeypatch):
    nvml = two_gpus()
    monkeypatch.setattr(memory, "pynvml", nvml)
    fake_cuda(monkeypatch, 0, {0: "ffff"})
    monitor = VramMonitor()
    assert not monitor.available
    assert monitor.metrics() == {}
    assert (nvml.inits, nvml.shutdowns) == (1, 1)


def test_shutdown_releases_nvml_once(monkeypatch):
    nvml = two_gpus()
    monkeypatch.setattr(memory, "pynvml", nvml)
    fake_cuda(monkeypatch, 0, {0: "aaaa"})
    monitor = VramMonitor()
    monitor.shutdown()
    monitor.shutdown()
    assert nvml.shutdowns == 1
    assert not monitor.available
    assert monitor.metrics() == {}
