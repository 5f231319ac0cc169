"""The device a plan runs on, as config selection sees it: one cached record per device.

A CUDA device is described by its own properties (name, SM count, shared memory and registers
per SM, compute capability). The CPU, where the kernels run in Triton's interpreter, is a device
too: it has a name and one "SM" per core, so tables tuned there are found there and nothing
pretends to be an H200.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from dataclasses import dataclass
from typing import Any, Mapping

import torch

# Triton reads TRITON_INTERPRET when a kernel is decorated, so the value at import is the truth
# for this process.
INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
CPU_NAME = "cpu (Triton interpreter)"
# Triton's interpreter keeps a launch's grid and its patched language module in globals: one
# interpreted launch at a time, whichever thread or wrapper it comes from.
_INTERPRETER_LOCK = threading.Lock()


def interpreted_launch():
    """Held around a kernel launch: the interpreter's lock, nothing on a GPU."""
    return _INTERPRETER_LOCK if INTERPRETER else contextlib.nullcontext()


# sm_70 to sm_90 (and the CPU stand-in): 64K 32-bit registers per SM.
DEFAULT_REGISTERS_PER_SM = 65536
# H100/H200's shared memory per SM; the CPU stand-in's, and any device torch does not report.
DEFAULT_SHARED_MEMORY_PER_SM = 233472


@dataclass(frozen=True)
class DeviceProperties:
    """What config selection and table matching look at."""

    name: str
    sm_count: int
    compute_capability: tuple[int, int]
    total_memory: int = 0  # bytes
    shared_memory_per_sm: int = DEFAULT_SHARED_MEMORY_PER_SM
    registers_per_sm: int = DEFAULT_REGISTERS_PER_SM

    @property
    def is_gpu(self) -> bool:
        return self.compute_capability != (0, 0)

    def describe(self) -> str:
        if not self.is_gpu:
            return f"'{self.name}' ({self.sm_count} CPU cores)"
        major, minor = self.compute_capability
        return f"'{self.name}' (compute capability {major}.{minor}, {self.sm_count} SMs)"

    def to_dict(self) -> dict[str, Any]:
        """The fields a tuned table records of its device."""
        return {"name": self.name, "sm_count": self.sm_count,
                "compute_capability": list(self.compute_capability), "total_memory": self.total_memory}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "DeviceProperties":
        """From ``to_dict`` (a table's device) or ``dataclasses.asdict`` (every field)."""
        cc = data["compute_capability"]
        return cls(data["name"], int(data["sm_count"]), (int(cc[0]), int(cc[1])),
                   int(data.get("total_memory", 0)),
                   int(data.get("shared_memory_per_sm", DEFAULT_SHARED_MEMORY_PER_SM)),
                   int(data.get("registers_per_sm", DEFAULT_REGISTERS_PER_SM)))


_override: DeviceProperties | None = None


def set_override(props: DeviceProperties | None) -> None:
    """Describe every device as ``props`` (None: as itself): for tests and for choosing configs
    for another GPU than the one in this machine."""
    if props is not None and not isinstance(props, DeviceProperties):
        raise TypeError(f"expected a tsdecode.device.DeviceProperties or None, got {type(props).__name__}")
    global _override
    _override = props


def device_properties(device: torch.device | str | int | None = None) -> DeviceProperties:
    """The properties of ``device`` (default: the current CUDA device, else the CPU)."""
    if _override is not None:
        return _override
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda":
        return _cpu_properties()
    index = torch.cuda.current_device() if device.index is None else device.index
    return _cuda_properties(index)


@functools.lru_cache(maxsize=None)
def _cuda_properties(index: int) -> DeviceProperties:
    p = torch.cuda.get_device_properties(index)
    return DeviceProperties(
        name=p.name, sm_count=p.multi_processor_count, compute_capability=(p.major, p.minor),
        total_memory=p.total_memory,
        shared_memory_per_sm=int(getattr(p, "shared_memory_per_multiprocessor", DEFAULT_SHARED_MEMORY_PER_SM)),
        registers_per_sm=int(getattr(p, "regs_per_multiprocessor", DEFAULT_REGISTERS_PER_SM)),
    )


@functools.lru_cache(maxsize=1)
def _cpu_properties() -> DeviceProperties:
    return DeviceProperties(name=CPU_NAME, sm_count=os.cpu_count() or 1, compute_capability=(0, 0))
