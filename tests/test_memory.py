import copy
import types
import weakref

import pytest
import torch

from hf_hybrid import memory
from hf_hybrid.memory import OptimizerStateOffloader, VramMonitor

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


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def assert_state_equal(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype and actual[key].device == value.device, key
        assert torch.equal(bits(actual[key]), bits(value)), key


def trained_adamw(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.AdamW]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))
    model[1].to(torch.bfloat16)  # state dtypes follow their parameters: keep one that is not float32
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        train_step(model, optimizer)
    return model, optimizer


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    torch.manual_seed(123)
    hidden = model[0](torch.randn(5, 8))
    model[1](hidden.to(torch.bfloat16)).float().pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_offload_of_cpu_state_is_a_no_op_by_default():
    _, optimizer = trained_adamw()
    before = {id(t) for state in optimizer.state.values() for t in state.values()}
    offloader = OptimizerStateOffloader(optimizer)
    offloader.offload()
    assert not offloader.is_offloaded
    assert {id(t) for state in optimizer.state.values() for t in state.values()} == before


def test_adamw_state_round_trips_bit_exactly():
    model, optimizer = trained_adamw()
    reference_model, reference = trained_adamw()
    snapshot = copy.deepcopy(optimizer.state_dict()["state"])
    originals = [weakref.ref(t) for state in optimizer.state.values() for t in state.values()]
    assert {"step", "exp_avg", "exp_avg_sq"} <= set(snapshot[0])

    offloader = OptimizerStateOffloader(optimizer, include_cpu_state=True)
    offloader.offload()
    assert offloader.is_offloaded
    assert all(ref() is None for ref in originals), "the state still holds the tensors it offloaded"
    for index, state in enumerate(optimizer.state.values()):
        assert_state_equal(state, snapshot[index])

    offloader.restore()
    offloader.wait()
    assert not offloader.is_offloaded
    buffers = {b.data_ptr() for b in offloader._buffers.values()}
    for index, state in enumerate(optimizer.state.values()):
        assert_state_equal(state, snapshot[index])
        assert not {t.data_ptr() for t in state.values()} & buffers, "restored state aliases the host buffers"

    # The restored state must drive the optimizer exactly as if it had never left.
    for _ in range(2):
        train_step(model, optimizer)
        train_step(reference_model, reference)
    for p, q in zip(model.parameters(), reference_model.parameters(), strict=True):
        assert torch.equal(bits(p), bits(q))


def test_host_buffers_are_reused_across_offloads():
    _, optimizer = trained_adamw()
    offloader = OptimizerStateOffloader(optimizer, include_cpu_state=True)
    offloader.offload()
    first = {key: b.data_ptr() for key, b in offloader._buffers.items()}
    offloader.offload()  # already offloaded: a no-op
    assert len(offloader._offloaded) == len(first)
    offloader.restore(non_blocking=False)
    offloader.offload()
    assert {key: b.data_ptr() for key, b in offloader._buffers.items()} == first
    assert len(first) == sum(len(state) for state in optimizer.state.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_state_round_trips_through_pinned_memory():
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024, device="cuda")
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)  # fused keeps `step` on the GPU too
    model(torch.randn(8, 1024, device="cuda")).sum().backward()
    optimizer.step()
    snapshot = copy.deepcopy(optimizer.state_dict()["state"])
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()

    offloader = OptimizerStateOffloader(optimizer)
    offloader.offload()
    assert torch.cuda.memory_allocated() <= allocated - 2 * 1024 * 1024 * 4
    assert all(t.is_pinned() for state in optimizer.state.values() for t in state.values())
    offloader.restore()
    offloader.wait()
    for index, state in enumerate(optimizer.state.values()):
        assert_state_equal(state, snapshot[index])
