"""A step's inputs to the device in one copy, from one pinned host buffer (and its sampled
ids back in one copy: `ReadBack`, which async scheduling starts early and reads late).

The engine builds a step's integer inputs on the host (token ids, positions, slot_mapping,
block tables, cu_seqlens, the rows to sample). Sent one by one, each `torch.tensor(...,
device="cuda")` is a separate, synchronous copy from pageable memory: a dozen round trips
per step, each a few µs of the GPU waiting for the CPU. `HostToDevice.send` packs them
into one page-locked (pinned) buffer, copies it with ONE asynchronous host-to-device
transfer, and returns views of the device copy with each tensor's dtype and shape.

Invariants:
- `send(ts)[i]` equals `ts[i]` (same values, dtype and shape) on the target device.
- On a CPU device nothing is copied: `send` returns its arguments.
- The pinned buffer is reused by the next `send` only after the previous copy out of it
  has finished (`CopyFence`; in practice the step's read-back of its sampled ids has
  already waited for it), so an in-flight copy never reads half-overwritten inputs.
"""
from __future__ import annotations

import torch

ALIGN = 16  # bytes: every tensor starts at a multiple of any element size


class CopyFence:
    """Marks when the last asynchronous copy out of a pinned host buffer has finished, so
    that the host may write the buffer again (a step with no sampled rows reads nothing
    back, and so does not wait for its own copy)."""

    def __init__(self):
        self._event: torch.cuda.Event | None = None

    def copied(self) -> None:
        """Call right after queueing the copy."""
        self._event = torch.cuda.Event()
        self._event.record()

    def wait(self) -> None:
        """Block until that copy is done (at once if it is, the common case)."""
        if self._event is not None and not self._event.query():
            self._event.synchronize()


class HostToDevice:
    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._host = torch.empty(0, dtype=torch.uint8)
        self._fence = CopyFence()
        self.num_copies = 0  # host-to-device transfers made

    def send(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """`tensors` (on the CPU) on the device, through one copy."""
        if self.device.type == "cpu":
            return list(tensors)
        flat = [t.contiguous().reshape(-1) for t in tensors]
        offsets, end = [], 0
        for t in flat:
            offsets.append(end)
            end += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        self._fence.wait()
        if self._host.numel() < end:
            self._host = torch.empty(max(end, 2 * self._host.numel()), dtype=torch.uint8,
                                     pin_memory=self.device.type == "cuda")
        for t, at in zip(flat, offsets):
            self._host[at:at + t.numel() * t.element_size()].copy_(t.view(torch.uint8))
        dev = self._host[:end].to(self.device, non_blocking=True)
        self.num_copies += 1
        if self.device.type == "cuda":
            self._fence.copied()
        return [dev[at:at + t.numel() * t.element_size()].view(t.dtype).view(orig.shape)
                for t, at, orig in zip(flat, offsets, tensors)]


class ReadBack:
    """A device tensor's copy to the host, started now and read later (async scheduling).

    The copy is queued on the stream right behind the work that produced the tensor, into
    pinned memory, and an event marks its end. `tolist()` waits for that event only: for
    this step's work, not for the next step, queued since. (A plain `.tolist()` issued
    after the next step is queued would wait for that step too: no overlap.)"""

    def __init__(self, t: torch.Tensor):
        self._event: torch.cuda.Event | None = None
        if t.device.type == "cuda":
            self._host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._host.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = t

    def tolist(self) -> list:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()
