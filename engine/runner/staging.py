"""Host-to-device copies of a step's inputs that never make the host wait.

A copy from pageable host memory (a numpy array, a tensor made from one) is staged by CUDA through a pinned buffer
of its own and returns only once it is done: the host then waits for everything queued before it on the stream,
the step in flight included, and overlapped steps stop overlapping. Here each input is written into a pinned
buffer of ours and copied with non_blocking=True, which queues the copy and returns at once.

The buffers come in two sets used in turn, a step each: step N's copies may still be queued behind step N-1 while
the host writes step N+1's inputs, but by the time it writes step N+2's it has landed step N, whose copies ran
before its kernels.
"""

from __future__ import annotations

import numpy as np
import torch

_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32, np.dtype(np.float32): torch.float32,
           np.dtype(np.bool_): torch.bool}


class Staging:
    def __init__(self, device: torch.device, copies: bool | None = None) -> None:
        """copies: stage and copy (the default on CUDA); False hands numpy's memory over as the tensor (the default on
        a CPU, where it already is where the forward reads it); True on a CPU runs the CUDA path's code there."""
        self.device = device
        self.pinned = device.type == "cuda"
        self.copies = self.pinned if copies is None else copies
        self._sets: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] = ({}, {})
        self._turn = 0

    def next_step(self) -> None:
        """Stage the next step's inputs in the other set of buffers."""
        self._turn ^= 1

    def to_device(self, name: str, array: np.ndarray) -> torch.Tensor:
        """`array` as a tensor on the device (a new one: it stays valid while later steps are staged)."""
        if not self.copies:
            return torch.from_numpy(array)
        host = self.host(name, array)
        out = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        out.copy_(host, non_blocking=True)
        return out

    def copy_into(self, dst: torch.Tensor, name: str, array: np.ndarray) -> None:
        """dst (on the device, array's shape) <- array."""
        if not self.copies:
            dst.copy_(torch.from_numpy(array))
            return
        dst.copy_(self.host(name, array), non_blocking=True)

    def host(self, name: str, array: np.ndarray) -> torch.Tensor:
        """This step's host buffer `name` holding `array` (pinned on CUDA), shaped like it."""
        buffers = self._sets[self._turn]
        dtype = _DTYPES[array.dtype]
        buffer = buffers.get(name)
        if buffer is None or buffer.dtype != dtype or buffer.numel() < array.size:
            size = max(array.size, 2 * buffer.numel() if buffer is not None and buffer.dtype == dtype else 0, 64)
            buffer = buffers[name] = torch.empty(size, dtype=dtype, pin_memory=self.pinned)
        view = buffer[: array.size]
        np.copyto(view.numpy(), array.reshape(-1), casting="no")
        return view.view(array.shape)

    def is_staged(self, t: torch.Tensor) -> bool:
        """Whether t is (a view of) one of the host buffers: the sync tracer's test asks."""
        return any(t.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                   for buffers in self._sets for b in buffers.values())
