"""Staging for kvd saves and loads: the device interface (streams, events) and a bounded pool of
pinned host buffers.

A save on a GPU gathers the chunk's pages on a side stream into a device staging buffer, then
copies that device-to-host into a pinned buffer, still on the side stream; the compute stream only
waits (on the device, never the host) for the gather before it next writes KV, so a freed block is
not overwritten while it is read. The saver thread waits on the copy's event, then hands the
pinned buffer to kvd. A load copies the arena bytes into a pinned buffer (the seqlock is checked
after that copy), then host-to-device and a scatter per layer on the side stream, recording one
event per layer; the forward waits (on the device) only for the layer it is about to run.

``CpuDevice`` does the same with no streams: the gather writes straight into the host buffer, a
load scatters straight from it, events are already complete. The tests run it; ``AcceleratorDevice``
runs the same code on CUDA or ROCm (torch.cuda).
"""
from __future__ import annotations

import threading
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from typing import Any, Iterator, Protocol

import torch


class KvDevice(Protocol):
    """What the connector's copies need from the device holding the KV cache."""

    direct: bool  # True: host buffers are device memory (CPU): gather/scatter in place, no staging

    def side(self) -> Any:
        """Context manager: ops inside run on the side stream."""

    def after_compute(self) -> None:
        """Side stream: wait for the work the compute stream queued so far (the step's KV writes)."""

    def record(self) -> Any:
        """An event completing when the side stream's work queued so far is done."""

    def compute_waits(self, event: Any) -> None:
        """The compute stream waits (on the device) for ``event``."""

    def host_waits(self, event: Any) -> None:
        """The calling thread waits for ``event``."""

    def empty(self, nbytes: int) -> torch.Tensor:
        """A device staging buffer (uint8)."""

    def host_empty(self, nbytes: int) -> torch.Tensor:
        """A host buffer the device copies to and from asynchronously (pinned on an accelerator)."""


class CpuDevice:
    """The KV cache in host memory. ``staged=True`` runs the accelerator's path (separate staging and
    host buffers, copies between them) with plain tensors: the tests' way to cover it here."""

    def __init__(self, staged: bool = False):
        self.direct = not staged

    def side(self):
        return nullcontext()

    def after_compute(self) -> None:
        return None

    def record(self) -> None:
        return None

    def compute_waits(self, event: Any) -> None:
        return None

    def host_waits(self, event: Any) -> None:
        return None

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def host_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)


class AcceleratorDevice:
    """CUDA or ROCm (torch.cuda) with one side stream for every kvd copy."""

    direct = False

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    @contextmanager
    def side(self) -> Iterator[None]:
        with torch.cuda.stream(self.stream):
            yield

    def after_compute(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def record(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def compute_waits(self, event: torch.cuda.Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def host_waits(self, event: torch.cuda.Event) -> None:
        event.synchronize()

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def host_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def device_for(tensor: torch.Tensor) -> KvDevice:
    return CpuDevice() if tensor.device.type == "cpu" else AcceleratorDevice(tensor.device)


class BufferPool:
    """Host (pinned) or device buffers, reused by size, at most ``max_bytes`` in all (in use or free).

    ``take`` returns None when the budget is spent by buffers in use: the caller drops the save (or
    loads without staging). Free buffers of other sizes are released to make room; pinning is slow,
    so steady chunk sizes reuse the same buffers.
    """

    def __init__(self, allocate, max_bytes: int):
        self._allocate = allocate
        self.max_bytes = max_bytes
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._held = 0  # bytes allocated (in use + free)
        self._free_bytes = 0
        self._lock = threading.Lock()
        self.allocated = 0  # buffers allocated over the pool's life (tests: reuse)

    def take(self, nbytes: int) -> torch.Tensor | None:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self._free_bytes -= nbytes
                return free.pop()
            while self._held + nbytes > self.max_bytes and self._free_bytes:
                size = next(s for s, bufs in self._free.items() if bufs)
                self._free[size].pop()
                self._free_bytes -= size
                self._held -= size
            if self._held + nbytes > self.max_bytes:
                return None
            self._held += nbytes
            self.allocated += 1
        return self._allocate(nbytes)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free[buf.numel()].append(buf)
            self._free_bytes += buf.numel()

    @property
    def in_use_bytes(self) -> int:
        with self._lock:
            return self._held - self._free_bytes


__all__ = ["AcceleratorDevice", "BufferPool", "CpuDevice", "KvDevice", "device_for"]
