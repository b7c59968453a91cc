"""A sync tracer for the engine's launch path, on any machine (tests/engine/test_sync_free.py uses it).

On a GPU, a step is launched while the one before still runs; the host must not wait for the device anywhere on
the way, or the steps stop overlapping. What makes it wait, CUDA-side: a tensor made from host data (torch.tensor,
as_tensor, from_numpy) and copied over from pageable memory, a copy from a staging buffer without non_blocking, and
any read of device data by the host (item, tolist, cpu, numpy, bool, int, float). None of these depends on the
device being a GPU, so the tracer records them wherever the engine runs: every call made from the engine's own code
(modules engine.*, kernels.triton_ops), with who made it, and lists as `blocking` those that would wait.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

SCOPE = ("engine.", "pagedq_kernels.triton_ops")
STAGING = "engine.runner.staging"  # makes host buffers and reads them by design: only its copies are checked
CREATES = {"tensor", "as_tensor", "asarray"}  # torch functions
READS = {"tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"}  # tensor methods
COPIES = {"copy_", "to"}  # tensor methods


@dataclass
class Call:
    what: str  # "create", "read" or "copy"
    op: str
    where: str  # module:line of the engine's code that made the call
    blocking: bool
    detail: str = ""


@dataclass
class SyncTracer(TorchFunctionMode):
    staging: object | None = None  # an engine.runner.staging.Staging: copies from its buffers must be non_blocking
    calls: list[Call] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__()

    @property
    def blocking(self) -> list[Call]:
        return [c for c in self.calls if c.blocking]

    def __enter__(self):
        self._from_numpy = torch.from_numpy

        def traced_from_numpy(array):
            self._record("create", "from_numpy", sys._getframe(1), array.shape)
            return self._from_numpy(array)

        torch.from_numpy = traced_from_numpy
        return super().__enter__()

    def __exit__(self, *exc):
        torch.from_numpy = self._from_numpy
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        frame = sys._getframe(1)
        name = getattr(func, "__name__", "")
        method = getattr(func, "__qualname__", "").startswith(("TensorBase.", "Tensor."))
        if name in CREATES and not method:
            self._record("create", name, frame)
        elif name in READS and method:
            self._record("read", name, frame)
        elif name in COPIES and method and self.staging is not None:
            source = args[1] if name == "copy_" else args[0]
            if isinstance(source, torch.Tensor) and self.staging.is_staged(source):
                waits = not kwargs.get("non_blocking", len(args) > 2 and args[2] is True)
                self._record("copy", name, frame, "from a staging buffer", waits=waits)
        return func(*args, **kwargs)

    def _record(self, what: str, op: str, frame, detail: object = "", waits: bool = True) -> None:
        module = frame.f_globals.get("__name__", "")
        if not module.startswith(SCOPE):
            return
        staged = module == STAGING
        if staged and what != "copy":
            return
        self.calls.append(Call(what, op, f"{module}:{frame.f_lineno}", waits, str(detail)))
