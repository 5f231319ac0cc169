"""Device properties as config selection sees them: the CPU stand-in, CUDA properties read once
and cached, and the override used to choose configs for another GPU."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from tsdecode import device as D
from tsdecode.device import DeviceProperties, device_properties, set_override

H200 = DeviceProperties("NVIDIA H200", 132, (9, 0), 150_109_880_320)


@pytest.fixture(autouse=True)
def fresh_cache():
    D._cuda_properties.cache_clear()
    D._cpu_properties.cache_clear()
    set_override(None)
    yield
    set_override(None)
    D._cuda_properties.cache_clear()
    D._cpu_properties.cache_clear()


@pytest.mark.parametrize("cores", [1, 3, 132, None])
def test_the_cpu_is_described_by_its_own_cores(cores, monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    cpu = device_properties("cpu")
    assert cpu.name == D.CPU_NAME == "cpu (Triton interpreter)"
    assert cpu.sm_count == (cores or 1)
    assert cpu.compute_capability == (0, 0) and not cpu.is_gpu
    assert cpu.describe() == f"'cpu (Triton interpreter)' ({cores or 1} CPU cores)"
    assert "SMs" not in cpu.describe()
    assert device_properties(torch.device("cpu")) is cpu  # one record per device


def test_the_cpu_is_never_an_h200(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu = device_properties()  # no CUDA: the default device is the CPU
    assert (cpu.name, cpu.sm_count) == (D.CPU_NAME, 2)
    assert cpu.to_dict() == {"name": D.CPU_NAME, "sm_count": 2, "compute_capability": [0, 0], "total_memory": 0}


class FakeCuda:
    """Stands in for torch.cuda.get_device_properties: counts the calls."""

    def __init__(self, **extra):
        self.calls = []
        self.extra = extra

    def __call__(self, index):
        self.calls.append(index)
        return SimpleNamespace(name=f"NVIDIA H200 #{index}" if index else "NVIDIA H200",
                               multi_processor_count=132, major=9, minor=0, total_memory=150_109_880_320,
                               **self.extra)


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = FakeCuda(shared_memory_per_multiprocessor=233472, regs_per_multiprocessor=65536)
    monkeypatch.setattr(torch.cuda, "get_device_properties", fake)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return fake


def test_cuda_properties_are_read_once_and_cached(fake_cuda):
    first = device_properties("cuda")
    assert first == DeviceProperties("NVIDIA H200", 132, (9, 0), 150_109_880_320, 233472, 65536)
    assert first.is_gpu and first.describe() == "'NVIDIA H200' (compute capability 9.0, 132 SMs)"
    for same in ("cuda", "cuda:0", 0, torch.device("cuda", 0), torch.device("cuda"), None):
        assert device_properties(same) is first
    assert fake_cuda.calls == [0]
    other = device_properties("cuda:1")
    assert other.name == "NVIDIA H200 #1" and fake_cuda.calls == [0, 1]
    device_properties(1)
    assert fake_cuda.calls == [0, 1]


def test_cuda_properties_torch_does_not_report_take_the_defaults(monkeypatch):
    fake = FakeCuda()  # an older torch: no shared memory / register counts
    monkeypatch.setattr(torch.cuda, "get_device_properties", fake)
    props = device_properties(torch.device("cuda", 0))
    assert props.shared_memory_per_sm == D.DEFAULT_SHARED_MEMORY_PER_SM
    assert props.registers_per_sm == D.DEFAULT_REGISTERS_PER_SM


def test_set_override_describes_every_device_as_given(fake_cuda, monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    small = DeviceProperties("L40S-like", 142, (8, 9), shared_memory_per_sm=102400)
    set_override(small)
    assert device_properties("cpu") is small and device_properties("cuda") is small
    assert device_properties() is small
    assert fake_cuda.calls == []  # nothing read while overridden
    set_override(None)
    assert device_properties("cpu").name == D.CPU_NAME
    assert device_properties("cuda").name == "NVIDIA H200"
    with pytest.raises(TypeError, match="DeviceProperties or None"):
        set_override({"name": "NVIDIA H200"})


def test_table_device_record_round_trips():
    data = H200.to_dict()
    assert data == {"name": "NVIDIA H200", "sm_count": 132, "compute_capability": [9, 0],
                    "total_memory": 150_109_880_320}
    assert DeviceProperties.from_dict(data) == H200
    # a table records no shared memory or registers: the defaults stand in
    assert DeviceProperties.from_dict({**data, "total_memory": 0}).shared_memory_per_sm == 233472
